//! Errors of the RDMA transport.

/// Why the RDMA transport could not be used, or stopped working.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// No usable RDMA device on this host; collective payloads stay on QUIC.
    #[error("no RDMA device: {reason}")]
    NoDevice {
        /// What discovery found (or why it could not look).
        reason: String,
    },
    /// A verbs call failed.
    #[error("{call} failed: {reason}")]
    Verbs {
        /// The verbs function.
        call: &'static str,
        /// What the library or the OS said.
        reason: String,
    },
    /// The peer's setup message is malformed or from an incompatible version.
    #[error("rank {peer} sent a bad RDMA setup message: {what}")]
    Setup {
        /// The peer's rank.
        peer: usize,
        /// What was wrong.
        what: String,
    },
    /// A completion reported an error, or the peer broke the transport's protocol.
    #[error("RDMA link to rank {peer} failed: {what}")]
    Link {
        /// The peer's rank.
        peer: usize,
        /// What happened.
        what: String,
    },
    /// Device memory cannot be registered with a NIC on this host (feature `gpudirect`).
    #[error("GPUDirect RDMA is unavailable: {reason}")]
    GpuDirect {
        /// Why: no GPU, no peer-memory support in the kernel, an empty buffer, ...
        reason: String,
    },
    /// The configuration asks for something the transport cannot do.
    #[error("invalid RDMA configuration: {0}")]
    Config(String),
    /// A nexar hook (setup messages, attaching the channel) failed.
    #[error(transparent)]
    Backend(#[from] nexar::BackendError),
}

impl RdmaError {
    /// A failed verbs call, with the OS error it left.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn verbs(call: &'static str, err: std::io::Error) -> RdmaError {
        RdmaError::Verbs { call, reason: err.to_string() }
    }
}
