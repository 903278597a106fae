//! Feature `nccl`: a communicator's NCCL member (made by its first device collective, kept in
//! the communicator's state) and what a program can see of it.

use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use nexar_types::NcclComm;

use crate::comm::state::CommState;

/// What NCCL does for a communicator's device buffers (see [`NexarClient::nccl_state`](crate::NexarClient::nccl_state)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NcclState {
    /// No device collective has asked for it yet.
    NotTried,
    /// Device allreduces and broadcasts run on NCCL within the host.
    Ready {
        /// Ranks in this host's NCCL communicator.
        ranks: usize,
        /// This rank's device.
        device: usize,
    },
    /// Device collectives are staged through host memory; why, in words.
    Unusable {
        /// Why.
        reason: String,
    },
}

/// A communicator's NCCL member, made by its first device collective.
#[derive(Default)]
pub(crate) struct NcclSlot {
    /// Held for the whole of each NCCL call: this rank issues them one at a time, in call order.
    pub(in crate::comm) turn: tokio::sync::Mutex<()>,
    pub(in crate::comm) state: Mutex<Slot>,
    pub(in crate::comm) logged: AtomicBool,
}

/// Where a communicator's NCCL member stands.
#[derive(Default)]
pub(in crate::comm) enum Slot {
    #[default]
    NotTried,
    Ready(std::sync::Arc<NcclGroup>),
    Unusable(String),
}

/// This rank's NCCL communicator within its host, and, where the communicator spans several
/// hosts, the nexar communicator of the ranks with its local index on every host (its state
/// only: a client holds the runtime, which must not be kept alive from a communicator's state).
pub(crate) struct NcclGroup {
    pub(in crate::comm) local: NcclComm,
    pub(in crate::comm) across: Option<std::sync::Arc<CommState>>,
}

impl std::fmt::Debug for NcclSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclSlot")
    }
}

impl NcclSlot {
    pub(in crate::comm) fn set(&self, slot: Slot) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = slot;
    }

    pub(in crate::comm) fn ready(&self) -> Option<std::sync::Arc<NcclGroup>> {
        match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            Slot::Ready(comm) => Some(comm.clone()),
            _ => None,
        }
    }
}
