//! Remote procedure calls: the registry that `#[nexar::rpc]` fills, the typed errors a caller
//! sees, the server that every client runs by itself, and the calling side.
//!
//! ```no_run
//! #[nexar::rpc]
//! async fn load_shard(id: u32, offset: u64) -> Result<Vec<u8>, String> {
//!     if id < 100 { Ok(vec![id as u8; offset as usize]) } else { Err(format!("no shard {id}")) }
//! }
//!
//! # async fn run(client: nexar::NexarClient) -> Result<(), Box<dyn std::error::Error>> {
//! let bytes = load_shard::call(&client, 1, 7, 0).await??;
//! # Ok(()) }
//! # fn main() {}
//! ```
//!
//! The attribute goes on module-level functions (the stub module it generates calls the
//! function through `super::`).

pub(crate) mod body;
mod call;
mod context;
mod serve;
mod service;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub(crate) use context::StateMap;
pub use context::{RpcContext, State};
pub(crate) use serve::{serve_requests, serve_responses};
pub(crate) use service::{RpcService, Served};

/// Why an RPC failed. Each case is distinct so callers can react to it; a handler's own
/// error travels inside the `Ok` value, typed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The peer rank does not exist.
    #[error("rank {rank} rpc {name}: peer rank {peer} does not exist (world size {world})")]
    InvalidPeer {
        /// The calling rank.
        rank: usize,
        /// The function.
        name: &'static str,
        /// The rank asked for.
        peer: usize,
        /// The world size.
        world: usize,
    },
    /// The peer has no function with this id.
    #[error("rank {rank} rpc: rank {peer} has no `{name}`")]
    UnknownFunction {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The function.
        name: &'static str,
    },
    /// The peer has the function, built with another signature.
    #[error("rank {rank} rpc: rank {peer} has no `{name}` with this signature ({signature})")]
    SignatureMismatch {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The function.
        name: &'static str,
        /// The signature the caller was built with.
        signature: &'static str,
    },
    /// The handler panicked on the peer; the peer keeps serving.
    #[error("rank {rank} rpc {name}: the handler panicked on rank {peer}: {message}")]
    HandlerPanicked {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The function.
        name: &'static str,
        /// The panic message.
        message: String,
    },
    /// Arguments or result could not be encoded or decoded.
    #[error("rank {rank} rpc {name} (peer {peer}): {what}")]
    Codec {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The function.
        name: &'static str,
        /// What failed.
        what: String,
    },
    /// No answer within `op_timeout`.
    #[error("rank {rank} rpc {name}: rank {peer} did not answer within {after:?}")]
    Timeout {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The function.
        name: &'static str,
        /// The limit (NEXAR_OP_TIMEOUT_MS).
        after: Duration,
    },
    /// The arguments are larger than this rank's RPC limit (`NEXAR_MAX_RPC_BYTES`), so the call
    /// was not sent.
    #[error(
        "rank {rank} rpc {name} (peer {peer}): the arguments are {len} bytes, over the RPC limit of {limit} bytes \
         (NEXAR_MAX_RPC_BYTES); send bulk data with send/recv"
    )]
    TooLarge {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The function.
        name: &'static str,
        /// The arguments' encoded length.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// The peer could not run the handler for this call: it lacks what the handler asks for
    /// (a [`State`] it provides none of), or it is shutting down.
    #[error("rank {rank} rpc {name}: rank {peer} could not run it: {why}")]
    Refused {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The function.
        name: &'static str,
        /// Why, in the peer's words.
        why: String,
    },
    /// The connection to the peer is gone.
    #[error("rank {rank} rpc {name}: rank {peer} is unreachable: {reason}")]
    PeerLost {
        /// The calling rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The function.
        name: &'static str,
        /// What the transport said.
        reason: String,
    },
}

/// Response status codes on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Status {
    Ok = 0,
    Unknown = 1,
    Signature = 2,
    Panicked = 3,
    Codec = 4,
    Refused = 5,
}

impl Status {
    pub(crate) fn from_wire(code: u8) -> Option<Status> {
        [Status::Ok, Status::Unknown, Status::Signature, Status::Panicked, Status::Codec, Status::Refused]
            .get(code as usize)
            .copied()
    }
}

/// Why a handler did not produce an answer (besides panicking).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandlerError {
    /// The arguments or the result could not be decoded or encoded.
    Codec(String),
    /// The handler could not run here (see [`RpcError::Refused`]).
    Refused(String),
}

impl From<String> for HandlerError {
    fn from(what: String) -> Self {
        HandlerError::Codec(what)
    }
}

/// A handler's future: the encoded result, or why there is none.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<bytes::Bytes, HandlerError>> + Send>>;

/// One function registered by `#[nexar::rpc]` (collected at link time; users do not build
/// these by hand).
#[derive(Debug)]
pub struct RpcHandler {
    /// Stable function id.
    pub id: u64,
    /// Hash of the signature text.
    pub sig_hash: u64,
    /// Path of the function.
    pub name: &'static str,
    /// The signature, as written.
    pub signature: &'static str,
    /// Decodes the arguments, runs the function, encodes the result.
    pub handle: fn(RpcContext, body::RpcBytes) -> HandlerFuture,
}

inventory::collect!(RpcHandler);

/// Every handler linked into this program, by id.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    by_id: HashMap<u64, &'static RpcHandler>,
}

impl Registry {
    /// Collects the linked handlers. Two functions with one id is an error naming both.
    pub(crate) fn collect() -> Result<Registry, String> {
        let mut by_id: HashMap<u64, &'static RpcHandler> = HashMap::new();
        for h in inventory::iter::<RpcHandler> {
            if let Some(other) = by_id.insert(h.id, h) {
                if std::ptr::eq(other, h) {
                    continue;
                }
                return Err(format!(
                    "rpc id {:#018x} is used by both `{}` and `{}`; give one of them another `#[nexar::rpc(id = ...)]`",
                    h.id, other.name, h.name
                ));
            }
        }
        Ok(Registry { by_id })
    }

    pub(crate) fn get(&self, id: u64) -> Option<&'static RpcHandler> {
        self.by_id.get(&id).copied()
    }

    /// `(id, signature hash)` of every handler, as sent to peers.
    pub(crate) fn entries(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self.by_id.values().map(|h| (h.id, h.sig_hash)).collect();
        v.sort_unstable();
        v
    }
}
