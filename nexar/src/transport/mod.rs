//! QUIC transport: endpoints, TLS and certificates, framed streams, and per-peer links with
//! their router and lanes.

pub mod bulk;
pub(crate) mod byte_budget;
pub mod chaos;
pub(crate) mod copy;
pub(crate) mod drivable;
pub(crate) mod eager_read;
pub mod endpoint;
pub mod framed;
pub(crate) mod inbox;
pub mod incoming;
pub mod lanes;
pub(crate) mod lent;
pub mod link;
pub(crate) mod links;
pub(crate) mod liveness;
pub mod pool;
pub(crate) mod reading;
pub(crate) mod relay_hook;
pub mod relay_seal;
pub(crate) mod route;
pub(crate) mod shm;
pub mod tcp_lane;
pub mod tls;

use std::net::SocketAddr;
use std::time::Duration;

use crate::proto::frame::FrameError;

/// Failures of the transport layer.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Certificates or TLS configuration could not be built or did not verify.
    #[error("tls: {0}")]
    Tls(String),
    /// The UDP socket could not be set up.
    #[error("cannot bind {addr}: {reason}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the OS or quinn said.
        reason: String,
    },
    /// Dialling a peer failed (refused, unreachable, handshake or certificate rejected).
    #[error("cannot connect to {peer} at {addr}: {reason}")]
    Connect {
        /// Who was dialled ("rank 3", "the seed").
        peer: String,
        /// Where.
        addr: SocketAddr,
        /// Why it failed.
        reason: String,
    },
    /// An established connection went away.
    #[error("connection to {peer} lost: {reason}")]
    ConnectionLost {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A peer sent bytes that break the wire protocol.
    #[error("{peer} broke the wire protocol: {error}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        error: FrameError,
    },
    /// A wait ran past its limit.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The limit.
        after: Duration,
    },
    /// Bytes a peer sent could not be read as sent (a record failed authentication: it was
    /// altered on the way).
    #[error("bytes from {peer} are unusable: {error}")]
    Payload {
        /// The peer.
        peer: String,
        /// What was wrong.
        error: framed::PayloadError,
    },
}
