//! The communicator the user holds: [`NexarClient`] with typed point-to-point messaging.

mod backends;
mod client;
mod collective;
mod diagnostics;
pub(crate) mod exec;
pub(crate) mod matcher;
pub(crate) mod membership;
mod p2p;
pub(crate) mod state;

pub use crate::cluster::health::PeerFailure;
pub use backends::hooks::{BackendError, MAX_SETUP_BODY};
#[cfg(feature = "nccl")]
pub use backends::nccl::NcclState;
pub use backends::negotiate::{Connecting, LinkSetup, NotAttached, negotiate, setup_tags};
pub(crate) use client::Inner;
pub use client::{LinkStats, NexarClient};
pub(crate) use collective::ScheduleCache;
pub use collective::{CollectiveError, CollectiveHandle, Compression, ErrorFeedback, ExchangeHandle};
pub(crate) use exec::{CollCall, broadcast_abort};
pub use membership::failure_watch::FailureWatch;
pub use membership::recovery::RecoveryError;
pub use p2p::P2pError;
pub(crate) use state::CommState;
