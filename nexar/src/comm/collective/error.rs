//! What a collective can fail with.

use std::time::Duration;

use nexar_types::{DeviceError, ReduceError};

use crate::proto::algo::Unsupported;
use crate::transport::TransportError;

/// Failures of collectives. Each names the reporting rank and the operation.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// This rank's own arguments are wrong (buffer lengths, root); nothing was sent, and the
    /// other ranks are told so at once.
    #[error("rank {rank} {op}: {reason}")]
    InvalidArgument {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A peer called something else than this rank (operation, count, element type, reduction,
    /// root or plan). No data of that call was used.
    #[error("rank {rank} {op}: ranks disagree: {what}")]
    Mismatch {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The peer whose message disagreed.
        peer: usize,
        /// The disagreement, naming both sides.
        what: String,
    },
    /// Another rank stopped this collective; its reason is quoted.
    #[error("rank {rank} {op}: aborted: {reason}")]
    Aborted {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The reason the aborting rank gave.
        reason: String,
    },
    /// A runtime [`ReduceOp`](crate::ReduceOp) that the element type does not support.
    #[error("rank {rank} {op}: {source}")]
    Reduce {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What the reduction reported.
        source: ReduceError,
    },
    /// A configured algorithm does not implement the operation.
    #[error("rank {rank} {op}: {source}")]
    Algorithm {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The mismatch.
        source: Unsupported,
    },
    /// A peer's message did not arrive within `op_timeout`. `report` is the stall
    /// inspector's account of where every other member was (see [`crate::trace`]).
    #[error("rank {rank} {op}: no message from rank {peer} within {after:?}: {report}")]
    Timeout {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The silent peer.
        peer: usize,
        /// The limit (NEXAR_OP_TIMEOUT_MS).
        after: Duration,
        /// Where the other members were when the time ran out.
        report: String,
    },
    /// A peer this collective needs is gone (crashed, aborted or left).
    #[error("rank {rank} {op}: rank {peer} is gone: {reason}")]
    PeerGone {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The rank that is gone.
        peer: usize,
        /// How its connection ended.
        reason: String,
    },
    /// The connection to a peer failed.
    #[error("rank {rank} {op}(peer {peer}): {source}")]
    Transport {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The peer.
        peer: usize,
        /// What the transport said.
        source: TransportError,
    },
    /// A bulk transport of this rank (RDMA) failed while it carried messages of this
    /// operation, so some may be lost; later operations go over QUIC.
    #[error("rank {rank} {op}: {reason}")]
    LinkFailed {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Which link failed.
        reason: String,
    },
    /// This rank's buffer is in device memory that could not be read or written.
    #[error("rank {rank} {op}: {source}")]
    Device {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What the device reported.
        source: DeviceError,
    },
    /// A compressed collective's result does not fit its wire format (an f16 sum beyond
    /// ±65504); every rank reports it alike.
    #[error("rank {rank} {op}: {what}")]
    Overflow {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Which element, and what to do.
        what: String,
    },
    /// A rooted collective this rank had already returned from failed on another rank. A
    /// broadcast, reduce, gather, scatter or scan returns as soon as this rank's part is done;
    /// its confirmation, that every rank finished it too, is collected by the next collective
    /// on the communicator. That call did its own work (its results are valid, and it was
    /// not stopped on the other ranks) and reports the earlier failure: each rank gets one
    /// error for one failure, at the call or at the next. `barrier()` collects every such
    /// confirmation.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let mut weights = vec![0f32; 1024];
    /// comm.broadcast(&mut weights, 0).await?; // on the root: returns once it has sent
    /// match comm.barrier().await {
    ///     Err(nexar::CollectiveError::EarlierFailed { earlier, seq, source, .. }) => {
    ///         eprintln!("{earlier} #{seq} failed elsewhere: {source}");
    ///     }
    ///     other => other?,
    /// }
    /// # Ok(()) }
    /// ```
    #[error("rank {rank} {op}: completed, but the earlier {earlier} (#{seq}) failed: {source}")]
    EarlierFailed {
        /// The rank reporting.
        rank: usize,
        /// The operation that reports it (it completed).
        op: &'static str,
        /// The earlier rooted collective that failed.
        earlier: &'static str,
        /// Its sequence number on the communicator (as in the flight recorder).
        seq: u64,
        /// Why it failed, as this rank learnt it (another rank's abort, quoted).
        source: Box<CollectiveError>,
    },
    /// This rank is shutting down.
    #[error("rank {rank} {op}: the client is shut down")]
    Closed {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
    },
    /// A bug in nexar (a schedule that does not fit its buffers): please report it.
    #[error("rank {rank} {op}: internal error: {what}")]
    Internal {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What went wrong.
        what: String,
    },
}

impl CollectiveError {
    /// Whether this rank found the problem itself (and so must tell the others), as opposed
    /// to having been told by an abort.
    pub(crate) fn is_local_origin(&self) -> bool {
        !matches!(
            self,
            CollectiveError::Aborted { .. } | CollectiveError::Closed { .. } | CollectiveError::EarlierFailed { .. }
        )
    }

    /// Whether the flight recorder is dumped for this failure: a timeout, or a failure that
    /// involves another rank (its disagreement, its abort, its death, the link to it).
    pub(crate) fn involves_peers(&self) -> bool {
        matches!(
            self,
            CollectiveError::Timeout { .. }
                | CollectiveError::Mismatch { .. }
                | CollectiveError::Aborted { .. }
                | CollectiveError::PeerGone { .. }
                | CollectiveError::Transport { .. }
                | CollectiveError::LinkFailed { .. }
                | CollectiveError::EarlierFailed { .. }
        )
    }
}
