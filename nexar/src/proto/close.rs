//! Every QUIC close code nexar sends, in one place: what a closed connection tells the peer
//! about why it ended.

/// Why nexar closed a QUIC connection: the application error code it sends with the close.
/// Peer links, seed connections and joiners share one numbering, so a code read off any
/// connection means one thing.
///
/// ```ignore
/// use nexar::proto::close::CloseCode;
/// assert_eq!(CloseCode::of(5), Some(CloseCode::DeclaredDead));
/// assert_eq!(CloseCode::DeclaredDead.value(), 5);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum CloseCode {
    /// The orderly end: the rank shuts down, or drops a second link to the same peer.
    Shutdown = 0,
    /// The seed rejected a join request.
    Rejected = 1,
    /// The peer broke the wire protocol.
    ProtocolViolation = 2,
    /// The mesh refused the connection: a key the seed did not certify, or a certificate for
    /// another rank.
    Refused = 3,
    /// The rank aborted.
    Abort = 4,
    /// This rank declared the peer dead.
    DeclaredDead = 5,
    /// This rank was excluded by the others and leaves.
    Excluded = 6,
    /// A joiner found that the seed does not know the job's shared secret.
    SeedUnproven = 7,
}

impl CloseCode {
    const ALL: [CloseCode; 8] = [
        CloseCode::Shutdown,
        CloseCode::Rejected,
        CloseCode::ProtocolViolation,
        CloseCode::Refused,
        CloseCode::Abort,
        CloseCode::DeclaredDead,
        CloseCode::Excluded,
        CloseCode::SeedUnproven,
    ];

    /// The code on the wire.
    pub const fn value(self) -> u32 {
        self as u32
    }

    /// The close code `code` read off a connection, if nexar sends it.
    pub fn of(code: u64) -> Option<CloseCode> {
        CloseCode::ALL.into_iter().find(|c| u64::from(c.value()) == code)
    }
}

#[cfg(test)]
mod tests {
    use super::CloseCode;

    #[test]
    fn every_code_reads_back_as_itself() {
        for code in CloseCode::ALL {
            assert_eq!(CloseCode::of(code.value().into()), Some(code));
        }
        assert_eq!(CloseCode::of(8), None);
    }
}
