//! What a transport back end is written against: a [`BulkChannel`] carries one link's
//! collective payloads (as the TCP lane does, and `nexar-rdma` over RDMA), and a
//! [`BulkInbound`] takes the groups it receives from the peer, checks them and delivers them
//! as if they had come over QUIC.
//!
//! A back end negotiates with its peers through [`negotiate`], the driver that shared memory,
//! the TCP lane and `nexar-rdma` all use: it offers, connects and confirms each link in two
//! rounds of the communicator's setup messages, and the back end supplies only its offer's
//! bytes and a [`LinkSetup`] (how to connect a link, how to start it). A started link attaches
//! one channel with [`NexarClient::attach_bulk`](crate::NexarClient::attach_bulk); the
//! receiving side of each link is [`NexarClient::bulk_inbound`](crate::NexarClient::bulk_inbound).
//! The setup messages themselves ([`NexarClient::send_setup`](crate::NexarClient::send_setup)
//! and [`recv_setup`](crate::NexarClient::recv_setup)) are there for anything else.
//!
//! ```no_run
//! # async fn run(comm: nexar::NexarClient, channel: std::sync::Arc<dyn nexar::backend::BulkChannel>) -> Result<(), nexar::BackendError> {
//! // Both ranks of a link offer their back end on a setup tag of their own, then attach it
//! // where both sides can (the trait's own docs show a channel).
//! let peer = 1 - comm.rank();
//! comm.send_setup(peer, 0x6d79_6265, b"my-fabric v1".to_vec()).await?;
//! if comm.recv_setup(peer, 0x6d79_6265).await? == b"my-fabric v1" {
//!     comm.attach_bulk(peer, channel)?;
//! }
//! # Ok(()) }
//! ```

pub use crate::comm::{Connecting, LinkSetup, NotAttached, negotiate, setup_tags};
pub use crate::transport::bulk::{Awaited, Awaiting, BulkChannel, BulkClosed, BulkInbound, BulkSend, Sent};
