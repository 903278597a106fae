//! nexar: a distributed runtime for Rust — typed collectives, tagged point-to-point messages and
//! RPC over authenticated QUIC.
//!
//! ```no_run
//! use nexar::prelude::*;
//!
//! # async fn run() -> Result<(), NexarError> {
//! // Four ranks in this process, connected by real QUIC on 127.0.0.1.
//! let ranks = NexarClient::bootstrap_local(4).await?;
//! let (a, b) = (&ranks[0], &ranks[1]);
//! a.send(&[1.0f32, 2.0, 3.0], 1, 7).await?;
//! let mut got = [0f32; 3];
//! b.recv(&mut got, 0, 7).await?;
//! assert_eq!(got, [1.0, 2.0, 3.0]);
//! # Ok(()) }
//! ```
//!
//! Layers, from the bottom up: [`proto`] (sans-IO framing and messages), [`transport`] (QUIC,
//! TLS, links and lanes), [`cluster`] (seed node, joining, mesh formation), and the
//! communicator the user holds, [`NexarClient`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cluster;
pub mod comm;
pub mod config;
mod error;
pub mod proto;
mod sync;
pub mod transport;

pub use cluster::{ClusterError, JoinToken, SeedNode};
pub use comm::{CollectiveError, CollectiveHandle, NexarClient, P2pError};
pub use config::{ConfigError, NexarConfig};
pub use error::NexarError;
pub use nexar_types::{
    BitAnd, BitOr, BitXor, Buf, DType, Element, Host, Max, MemorySpace, Min, Prod, RecvBuf, ReduceError, ReduceOp,
    Reduction, SendBuf, Sum, bf16, f16, reduce, reduce_slice, stable_hash, stable_id,
};
pub use proto::algo::Algorithm;
pub use transport::TransportError;

/// The everyday names: `use nexar::prelude::*;`.
pub mod prelude {
    pub use crate::{
        BitAnd, BitOr, BitXor, Buf, DType, Element, Max, Min, NexarClient, NexarConfig, NexarError, Prod, ReduceOp,
        SeedNode, Sum,
    };
}
