//! The communicator the user holds: [`NexarClient`] with typed point-to-point messaging.

mod client;
mod mailbox;
mod p2p;

pub use client::NexarClient;
pub use p2p::P2pError;
