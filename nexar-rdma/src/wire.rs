//! What the channel engine needs from a connected queue pair, whatever carries it: a real
//! NIC ([`crate::verbs`]) or the in-process emulation ([`crate::emulated`]).
//!
//! Both ends own a *staging* area (registered memory the NIC reads from) and a *ring*
//! (registered memory the peer writes into), each of `slots` slots of `slot_size` bytes.
//! Data moves by RDMA write with immediate from local staging slot `s` to remote ring slot
//! `s`; the immediate value tells the receiver which slot filled and how. Every write with
//! immediate consumes one posted receive on the peer.

use crate::RdmaError;

/// One work completion, as the engine sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    /// A write this side posted has reached the peer (`slot` for data, `None` for a credit).
    Written { slot: Option<usize> },
    /// The peer wrote `len` bytes with immediate value `imm`.
    Arrived { imm: u32, len: usize },
    /// A work request failed; the link is unusable. Only a real NIC reports it.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Failed { what: String },
}

/// A connected queue pair with its registered staging area and receive ring.
pub(crate) trait Wire: Send + 'static {
    /// Slots in the staging area and in the ring.
    fn slots(&self) -> usize;
    /// Bytes per slot.
    fn slot_size(&self) -> usize;
    /// Local staging slot `slot`, to fill before [`write`](Wire::write).
    fn staging(&mut self, slot: usize) -> &mut [u8];
    /// Appends the first `len` bytes of ring slot `slot` to `out`.
    fn read_ring(&self, slot: usize, len: usize, out: &mut Vec<u8>);
    /// Writes the first `len` bytes of staging slot `slot` (nothing for `None`) into the
    /// peer's ring slot of the same index, with immediate value `imm`.
    fn write(&mut self, slot: Option<usize>, len: usize, imm: u32) -> Result<(), RdmaError>;
    /// Moves the completions that are ready into `out` (never waits).
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), RdmaError>;
    /// Posts one receive in place of one that completed.
    fn repost(&mut self) -> Result<(), RdmaError>;
}
