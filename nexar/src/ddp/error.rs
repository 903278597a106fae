//! What the data-parallel layer can fail with.

use crate::comm::CollectiveError;

/// Failures of [`Ddp`](super::Ddp). Each names the reporting rank and, where there is one, the
/// parameter and the step.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// The ranks did not register the same parameters (names, shapes, element types, in the
    /// same order) or the same bucket settings. Every rank gets this error from construction
    /// or `rebuild`, before any gradient is sent.
    #[error("rank {rank} ddp: ranks registered different parameters: {what}")]
    Registration {
        /// The rank reporting.
        rank: usize,
        /// The first difference, naming the parameter and the ranks.
        what: String,
    },
    /// A setting or argument of this rank is wrong (an empty name, a bucket cap of zero, a
    /// hook that does not fit); nothing was sent.
    #[error("rank {rank} ddp: {reason}")]
    InvalidArgument {
        /// The rank reporting.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
    /// A gradient was handed over for a name that was never registered.
    #[error("rank {rank} ddp step {step}: no parameter named `{name}` was registered")]
    UnknownParameter {
        /// The rank reporting.
        rank: usize,
        /// The step in progress.
        step: u64,
        /// The name given.
        name: String,
    },
    /// A gradient's length or element type differs from its parameter's; it was not copied
    /// and nothing was sent.
    #[error("rank {rank} ddp step {step}: the gradient of `{name}` has {got}, the parameter is {expected}")]
    WrongGradient {
        /// The rank reporting.
        rank: usize,
        /// The step in progress.
        step: u64,
        /// The parameter.
        name: String,
        /// The parameter's shape and element type, as `[128, 64] f32 (8192 elements)`.
        expected: String,
        /// What was handed over, as `4096 f32 elements`.
        got: String,
    },
    /// A parameter's gradient was handed over twice in one step.
    #[error("rank {rank} ddp step {step}: the gradient of `{name}` was already handed over in this step")]
    HandedTwice {
        /// The rank reporting.
        rank: usize,
        /// The step in progress.
        step: u64,
        /// The parameter.
        name: String,
    },
    /// `finish` (or `no_sync`'s end of step) came before these parameters' gradients; their
    /// buckets were not sent, so the other ranks wait for this rank until their timeout.
    #[error(
        "rank {rank} ddp step {step}: the step ended before the gradients of {names} were handed over (hand a parameter that got no gradient over as zeros)"
    )]
    Missing {
        /// The rank reporting.
        rank: usize,
        /// The step in progress.
        step: u64,
        /// The parameters, listed as `` `a` (bucket 2), `b` (bucket 3) ``, at most eight.
        names: String,
    },
    /// The collective of a bucket failed (a dead rank, a rank that never handed a gradient
    /// over, a timeout); the source names the rank at fault.
    #[error("rank {rank} ddp step {step}, bucket {bucket} ({params}): {source}")]
    Bucket {
        /// The rank reporting.
        rank: usize,
        /// The step.
        step: u64,
        /// The bucket, in launch order.
        bucket: usize,
        /// The bucket's parameters, as `` 3 parameters from `fc2.weight` to `fc1.bias` ``.
        params: String,
        /// What the collective reported.
        source: Box<CollectiveError>,
    },
    /// A collective of the layer's own (registration check, broadcast, metric) failed.
    #[error("rank {rank} ddp {op}: {source}")]
    Collective {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What the collective reported.
        source: Box<CollectiveError>,
    },
    /// A call in the wrong place: a blocking call inside an async task, a step used after a
    /// failure before `rebuild`.
    #[error("rank {rank} ddp: {what}")]
    Usage {
        /// The rank reporting.
        rank: usize,
        /// What was wrong.
        what: String,
    },
}
