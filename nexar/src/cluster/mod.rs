//! Cluster formation: join tokens, the seed node, workers joining through it, in-process
//! clusters, and the direct peer mesh; and finding out how the job was launched ([`launcher`],
//! with SLURM host lists parsed by [`hostlist`]).

pub mod hostlist;
mod join;
pub mod launcher;
mod local;
mod mesh;
mod seed;
mod token;

use std::net::SocketAddr;
use std::time::Duration;

pub(crate) use join::join;
pub(crate) use local::bootstrap_local;
pub(crate) use mesh::{MeshSetup, form_mesh};
pub use seed::SeedNode;
pub use token::JoinToken;

use crate::transport::TransportError;

/// Failures while forming or joining a cluster.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ClusterError {
    /// A join token does not parse.
    #[error("invalid join token: {0}")]
    InvalidToken(String),
    /// A cluster of this size cannot be formed.
    #[error("invalid world size {0}: a cluster needs at least one rank")]
    InvalidWorldSize(usize),
    /// The seed refused the join.
    #[error("the seed at {seed} refused the join: {reason}")]
    JoinRejected {
        /// The seed's address.
        seed: SocketAddr,
        /// Its reason.
        reason: String,
    },
    /// The seed answered something the join protocol does not allow.
    #[error("the seed at {seed} broke the join protocol: {reason}")]
    SeedProtocol {
        /// The seed's address.
        seed: SocketAddr,
        /// What was wrong.
        reason: String,
    },
    /// The mesh did not form.
    #[error("rank {rank} could not form the mesh: {reason}")]
    Mesh {
        /// The rank reporting.
        rank: usize,
        /// What went wrong, naming the peers concerned.
        reason: String,
    },
    /// A wait ran past its limit.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The limit.
        after: Duration,
    },
    /// Two `#[nexar::rpc]` functions share an id (or the registry is otherwise unusable).
    #[error("the rpc registry is invalid: {0}")]
    RpcRegistry(String),
    /// The transport failed underneath.
    #[error(transparent)]
    Transport(#[from] TransportError),
}
