//! The setup messages of the TCP lane, exchanged over QUIC: an offer (where to dial, with
//! which token) or a refusal, then whether both connections came up.

/// Bytes of the token that binds a connection to its link.
pub(crate) const TOKEN_LEN: usize = 16;

const MAGIC: u8 = 0x4c; // 'L'
const VERSION: u8 = 1;
/// Longest reason kept from a peer.
const MAX_REASON: usize = 512;

/// One setup message of the TCP lane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LaneMsg {
    /// Dial my lane listener on this port (at the address of my QUIC endpoint) with this token.
    Offer { port: u16, token: [u8; TOKEN_LEN] },
    /// No TCP lane from my side, and why.
    Decline { reason: String },
    /// Both connections of our link are up here.
    Ready,
    /// They are not, and why.
    Failed { reason: String },
}

impl LaneMsg {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![MAGIC, VERSION];
        match self {
            LaneMsg::Offer { port, token } => {
                out.push(0);
                out.extend_from_slice(&port.to_le_bytes());
                out.extend_from_slice(token);
            }
            LaneMsg::Decline { reason } => {
                out.push(1);
                out.extend_from_slice(reason.as_bytes());
            }
            LaneMsg::Ready => out.push(2),
            LaneMsg::Failed { reason } => {
                out.push(3);
                out.extend_from_slice(reason.as_bytes());
            }
        }
        out
    }

    /// A message from untrusted bytes, or what is wrong with them.
    pub fn decode(bytes: &[u8]) -> Result<LaneMsg, String> {
        let [magic, version, kind, rest @ ..] = bytes else {
            return Err(format!("a {}-byte tcp lane setup message is too short", bytes.len()));
        };
        if (*magic, *version) != (MAGIC, VERSION) {
            return Err(format!(
                "tcp lane setup message with magic {magic:#x} version {version}, expected {MAGIC:#x} {VERSION}"
            ));
        }
        let reason = || String::from_utf8_lossy(&rest[..rest.len().min(MAX_REASON)]).into_owned();
        match kind {
            0 => match rest {
                [p0, p1, token @ ..] if token.len() == TOKEN_LEN => Ok(LaneMsg::Offer {
                    port: u16::from_le_bytes([*p0, *p1]),
                    token: token.try_into().map_err(|_| "token length".to_string())?,
                }),
                _ => Err(format!("a tcp lane offer of {} bytes, expected {}", rest.len(), 2 + TOKEN_LEN)),
            },
            1 => Ok(LaneMsg::Decline { reason: reason() }),
            2 if rest.is_empty() => Ok(LaneMsg::Ready),
            3 => Ok(LaneMsg::Failed { reason: reason() }),
            other => Err(format!("unknown tcp lane setup message kind {other}")),
        }
    }
}

/// The setup tag of round `round` (0: offers, 1: outcomes) of exchange `attempt`.
pub(crate) fn lane_tag(attempt: u64, round: u64) -> u64 {
    0x7463_706c_0000_0000 | ((attempt & 0x7fff_ffff) << 1) | (round & 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_round_trip_and_bad_ones_say_why() {
        for msg in [
            LaneMsg::Offer { port: 40123, token: [7; TOKEN_LEN] },
            LaneMsg::Decline { reason: "no listener".into() },
            LaneMsg::Ready,
            LaneMsg::Failed { reason: "refused".into() },
        ] {
            assert_eq!(LaneMsg::decode(&msg.encode()), Ok(msg));
        }
        assert!(LaneMsg::decode(&[MAGIC]).unwrap_err().contains("too short"));
        assert!(LaneMsg::decode(&[MAGIC, 9, 2]).unwrap_err().contains("version 9"));
        assert!(LaneMsg::decode(&[MAGIC, VERSION, 0, 1, 2]).unwrap_err().contains("offer of 2 bytes"));
        assert!(LaneMsg::decode(&[MAGIC, VERSION, 8]).unwrap_err().contains("kind 8"));
        assert_ne!(lane_tag(0, 0), lane_tag(0, 1));
        assert_ne!(lane_tag(0, 1), lane_tag(1, 0));
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = LaneMsg::decode(&bytes);
        }
    }
}
