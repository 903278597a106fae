//! Groups of records made for tests: their wire bytes, and sessions whose keys both ends agree
//! on.

use std::sync::Arc;

use super::cipher::LaneAead;
use super::records::{Direction, Exporter, GroupHead, Opener, Sealer, Session};

/// A session for plaintext records in tests, which need no keys (exporting fails).
pub(crate) struct NoKeys;

impl Exporter for NoKeys {
    fn export(&self, _: &mut [u8], _: &[u8]) -> Result<(), rustls::Error> {
        Err(rustls::Error::General("no keys in this test".into()))
    }
}

/// The wire bytes of one group of `parts`, for tests.
pub(crate) fn sealed_group(sealer: &mut Sealer, parts: &[&[u8]]) -> Vec<u8> {
    let mut wire = Vec::new();
    sealer
        .seal_group(parts, Vec::new, |c, _| {
            wire.extend_from_slice(&c);
            true
        })
        .unwrap();
    wire
}

/// A group of `parts` in plaintext records, for tests: its head, the wire bytes of its
/// records, and an opener to read them with.
pub(crate) fn plain_group(parts: &[&[u8]]) -> (GroupHead, Vec<u8>, Opener) {
    test_group(parts, None)
}

/// A session whose two ends export the same keys, for tests.
struct SameKeys;

impl Exporter for SameKeys {
    fn export(&self, out: &mut [u8], context: &[u8]) -> Result<(), rustls::Error> {
        let mixed = context.iter().fold(5u8, |h, c| h.wrapping_mul(31).wrapping_add(*c));
        for (i, b) in out.iter_mut().enumerate() {
            *b = mixed ^ (i as u8).wrapping_mul(13);
        }
        Ok(())
    }
}

/// As [`plain_group`], with the records sealed by `encrypt` (`None`: plaintext).
pub(crate) fn test_group(parts: &[&[u8]], encrypt: Option<LaneAead>) -> (GroupHead, Vec<u8>, Opener) {
    let session: Session = match encrypt {
        Some(_) => Arc::new(SameKeys),
        None => Arc::new(NoKeys),
    };
    let mut sealer = Sealer::new(&session, Direction::FromDialler, encrypt).unwrap();
    let wire = sealed_group(&mut sealer, parts);
    let mut opener = Opener::new(&session, Direction::FromDialler, encrypt).unwrap();
    let mut rest = &wire[..];
    let head = opener.read_group_head(&mut rest).unwrap().unwrap();
    (head, rest.to_vec(), opener)
}
