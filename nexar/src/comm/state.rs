//! Communicator state: which world ranks belong to it, this rank's place in it, and the
//! sequence counter that keeps its collectives apart.

use std::sync::atomic::{AtomicU64, Ordering};

/// The id of the world communicator.
pub(crate) const WORLD_COMM: u64 = 0;

#[derive(Debug)]
pub(crate) struct CommState {
    /// Communicator id, carried by every message of its traffic.
    pub id: u64,
    /// World rank of each member, indexed by communicator rank.
    pub members: Vec<usize>,
    /// This rank's index in `members`.
    pub me: usize,
    /// Sequence number of the next collective (64 bits: never wraps in practice).
    seq: AtomicU64,
    /// Number of the next failure agreement on this communicator.
    recoveries: AtomicU64,
    /// Number of the next transport back-end setup on this communicator.
    setups: AtomicU64,
    /// Which host each member is on, once known (see `NexarClient::host_layout`).
    pub layout: std::sync::OnceLock<Option<std::sync::Arc<crate::proto::algo::hierarchical::HostLayout>>>,
    /// Schedules of the calls made on this communicator, so that a call repeated (as a
    /// training loop repeats them) is not planned again.
    pub schedules: crate::comm::ScheduleCache,
    /// Its rooted collectives that are not yet confirmed by every member (`comm/collective/confirm.rs`).
    pub unconfirmed: crate::comm::collective::confirm::Unconfirmed,
    /// This communicator's NCCL member for device collectives, once made.
    #[cfg(feature = "nccl")]
    pub nccl: crate::comm::backends::nccl_slot::NcclSlot,
}

impl CommState {
    pub fn world(rank: usize, world: usize) -> Self {
        CommState::new(WORLD_COMM, (0..world).collect(), rank)
    }

    pub fn new(id: u64, members: Vec<usize>, me: usize) -> Self {
        CommState {
            id,
            members,
            me,
            seq: AtomicU64::new(0),
            recoveries: AtomicU64::new(0),
            setups: AtomicU64::new(0),
            layout: std::sync::OnceLock::new(),
            schedules: crate::comm::ScheduleCache::new(),
            unconfirmed: Default::default(),
            #[cfg(feature = "nccl")]
            nccl: Default::default(),
        }
    }

    /// Takes the next sequence number. Every member calls collectives in the same order, so
    /// every member gets the same number for the same call.
    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes the number of the next failure agreement (survivors call them in the same order).
    pub fn next_recovery(&self) -> u64 {
        self.recoveries.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes the number of the next back-end setup (members call them in the same order).
    pub fn next_setup(&self) -> u64 {
        self.setups.fetch_add(1, Ordering::Relaxed)
    }

    /// Moves the counter (for tests of very long-running communicators).
    #[cfg(test)]
    pub fn set_seq(&self, seq: u64) {
        self.seq.store(seq, Ordering::Relaxed);
    }
}
