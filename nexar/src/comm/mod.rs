//! The communicator the user holds: [`NexarClient`] with typed point-to-point messaging.

mod client;
mod collective;
mod exec;
mod p2p;
mod spin;
mod state;

pub(crate) use client::Inner;
pub use client::NexarClient;
pub use collective::{CollectiveError, CollectiveHandle};
pub(crate) use exec::{CollCall, broadcast_abort};
pub use p2p::P2pError;
