//! A hostile member's lane (crate feature `hostile-member`): the next group it sends is
//! altered as a test asks ([`LaneTamper`]), after an honest sealing, so that the tests of
//! what a receiver refuses send exactly what a member holding its lane's keys could.

use std::io;

use super::records::{HEADER, Sealed, Sealer, TAG, lead_of};
use crate::transport::bulk::LaneTamper;

/// Seals one group as [`Sealer::seal_group`] does, then alters it as `tamper` says.
pub(super) fn seal_tampered(
    sealer: &mut Sealer,
    parts: &[&[u8]],
    tamper: LaneTamper,
    buffer: impl FnMut() -> Vec<u8>,
    mut emit: impl FnMut(Sealed, bool) -> bool,
) -> io::Result<bool> {
    let lead = lead_of(parts);
    let mut flip = FlipAt { target: tamper.flip_lead_byte.map(|k| lead + k), pos: None };
    let hint = tamper.lead.unwrap_or(lead as u64);
    sealer.seal_group_led(parts, hint, buffer, |mut sealed, last| {
        flip.apply(&mut sealed);
        emit(sealed, last)
    })
}

/// Flips the lowest bit of the ciphertext of group byte `target` as the group's sealed
/// buffers go by (each holds whole records; the first record is the group's header).
struct FlipAt {
    target: Option<usize>,
    /// The group byte the next record starts at; `None` before the header record.
    pos: Option<usize>,
}

impl FlipAt {
    fn apply(&mut self, sealed: &mut Sealed) {
        let bytes = sealed.bytes_mut();
        let mut at = 0;
        while let Some(header) = bytes.get(at..at + HEADER).and_then(|b| <[u8; HEADER]>::try_from(b).ok()) {
            let (body, n) = (at + HEADER, u32::from_le_bytes(header) as usize);
            if let Some(pos) = self.pos {
                if let Some(byte) =
                    self.target.filter(|t| (pos..pos + n).contains(t)).and_then(|t| bytes.get_mut(body + t - pos))
                {
                    *byte ^= 1;
                }
                self.pos = Some(pos + n);
            } else {
                self.pos = Some(0);
            }
            at = body + n + TAG;
        }
    }
}
