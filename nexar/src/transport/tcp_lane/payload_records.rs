//! What the lane's reader keeps of a group's payload records: where each lies, and whether
//! it is still sealed (with what opening it takes), was opened where it arrived, or failed
//! authentication there ([`super::records::Opener::take_record`]).

use std::sync::Arc;

use super::cipher::{LaneKey, NONCE_LEN};
use super::records::{HEADER, TAG};

/// The shortest record [`Opener::read_group`](super::records::Opener::read_group) leaves sealed: it bounds the bookkeeping per
/// group to a few bytes per [`DEFER_MIN`] bytes, whatever the sender's record sizes.
pub(crate) const DEFER_MIN: usize = 16 << 10;

/// A record of a group from its lead part on that [`Opener::read_group`](super::records::Opener::read_group) left sealed, or opened
/// where it arrived, at byte `at` of the group. The group's frames lie before the first.
#[derive(Clone, Debug)]
pub(crate) struct Deferred {
    /// Where the record's ciphertext starts in the group (where its plaintext belongs).
    pub at: usize,
    /// Its length in bytes.
    pub len: usize,
    /// Whether it is still sealed, and what opening it takes.
    pub kept: Kept,
}

/// What became of a record of a group's payload ([`Deferred`]).
#[derive(Clone, Debug)]
pub(crate) enum Kept {
    /// Left sealed, for the reader of the payload to open into its destination: what that
    /// takes besides the ciphertext.
    Sealed(SealedRecord),
    /// Opened where it arrived (the opener's AES-GCM works in place only).
    Opened,
    /// It failed authentication where it arrived: its bytes are zeros, and the operation that
    /// reads it fails ([`crate::transport::framed::PayloadError::Forged`]).
    Forged,
}

/// What opening a record that was left sealed needs besides its ciphertext: its header (the
/// associated data), nonce, tag and key. Opening it twice is harmless; a record that fails
/// authentication yields [`Forged`] and no bytes anyone should trust.
#[derive(Clone)]
pub(crate) struct SealedRecord {
    pub(super) header: [u8; HEADER],
    pub(super) nonce: [u8; NONCE_LEN],
    pub(super) tag: [u8; TAG],
    pub(super) key: Arc<LaneKey>,
}

/// A record that failed authentication: its bytes were altered after they were sealed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Forged;

impl SealedRecord {
    /// Authenticates `cipher` (this record's ciphertext) and decrypts it into `out`, which
    /// must be as long.
    pub fn open_into(&self, cipher: &[u8], out: &mut [u8]) -> Result<(), Forged> {
        self.key.open_into(self.nonce, &self.header, cipher, &self.tag, out).map_err(|_| Forged)
    }

    /// Authenticates and decrypts, in place, `body`: this record's ciphertext, already where
    /// its plaintext belongs. After [`Forged`] `body` is zeroed.
    pub fn open_in_place(&self, body: &mut [u8]) -> Result<(), Forged> {
        self.key.open_in_place_tagged(self.nonce, &self.header, &self.tag, body).map_err(|_| Forged)
    }
}

impl std::fmt::Debug for SealedRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SealedRecord({} bytes)", u32::from_le_bytes(self.header))
    }
}
