//! The communicator the user holds: [`NexarClient`] with typed point-to-point messaging.

mod backend;
mod build;
mod client;
mod collective;
mod confirm;
mod control;
mod exec;
mod failure_watch;
mod grow;
mod health;
mod host_peers;
mod hosts;
mod init;
mod inspect;
mod leave;
pub(crate) mod matcher;
mod meter;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "nccl")]
mod nccl_slot;
#[cfg(feature = "nccl")]
mod nccl_two_level;
mod negotiate;
mod p2p;
mod p2p_segments;
mod pieces;
mod recovery;
mod recovery_error;
pub(crate) mod route;
mod setup_inbox;
mod shm;
pub(crate) mod spin;
pub(crate) mod state;
mod tcp_lane;
mod wire_codec;

pub use crate::cluster::health::PeerFailure;
pub use backend::{BackendError, MAX_SETUP_BODY};
pub(crate) use client::Inner;
pub use client::{LinkStats, NexarClient};
pub(crate) use collective::ScheduleCache;
pub use collective::{CollectiveError, CollectiveHandle, Compression, ErrorFeedback, ExchangeHandle};
pub(crate) use exec::{CollCall, broadcast_abort};
pub use failure_watch::FailureWatch;
#[cfg(feature = "nccl")]
pub use nccl::NcclState;
pub use negotiate::{Connecting, LinkSetup, NotAttached, negotiate, setup_tags};
pub use p2p::P2pError;
pub use recovery::RecoveryError;
pub(crate) use state::CommState;
