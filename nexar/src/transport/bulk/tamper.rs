//! A hostile member's alteration of the next group its bulk channel sends (crate feature
//! `hostile-member`, for the tests of what a receiver refuses). It is defined beside the
//! channel trait, so transport depends on nothing above it; `nexar::hostile` re-exports it.

/// How a hostile member's
/// [`tamper_next_group`](crate::hostile::HostileMember::tamper_next_group) alters the next
/// group its TCP lane sends, after sealing it honestly with the lane's keys (which the member
/// holds for its own direction).
///
/// ```
/// use nexar::hostile::LaneTamper;
/// // The payload's first byte altered on the wire: its record no longer authenticates.
/// let flip = LaneTamper { flip_lead_byte: Some(0), ..Default::default() };
/// // A placement hint that says the group's frames are its payload.
/// let hint = LaneTamper { lead: Some(0), ..Default::default() };
/// # let _ = (flip, hint);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneTamper {
    /// The placement hint the group's header record gives, instead of where its largest part
    /// (its payload) starts.
    pub lead: Option<u64>,
    /// Flips the lowest bit of the ciphertext of this byte of the group's largest part.
    pub flip_lead_byte: Option<usize>,
}
