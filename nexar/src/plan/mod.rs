//! Fused collective plans: what `#[nexar::collective_plan]` compiles to.
//!
//! A plan is a list of statements over the plan function's buffers. Compatible statements (all
//! allreduces with one element type and reduction; all broadcasts with one element type and
//! root) are fused into buckets under a size cap, so many small tensors travel as few large
//! transfers (each bucket is one collective over its buffers, which the executor addresses as
//! one run where they lie); the buckets of one phase run concurrently and overlap on the wire. Every
//! collective a plan runs carries the plan's fingerprint, so a rank running another plan gets a
//! clear error on every rank.

mod run;

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use nexar_types::{Buf, DType, Element};

use crate::proto::algo::{Algorithm, Collective, select};
pub(crate) use crate::proto::plan::{Layout, Lossy, Unit};
pub use crate::proto::plan::{PlanSpec, Shape, Statement};

pub use run::PlanRun;

impl PlanSpec {
    /// Describes how the plan runs for buffers of these shapes on `world` ranks with the
    /// default settings: phases, buckets with their sizes, and the algorithm each collective
    /// gets. [`explain_on`](Self::explain_on) describes a run on a given communicator, whose
    /// configuration may pin algorithms.
    pub fn explain(&self, shapes: &[Shape], world: usize) -> String {
        self.describe(shapes, world, &|kind, bytes| select(kind, bytes, world))
    }

    /// Describes how the plan runs for buffers of these shapes on `comm`: as
    /// [`explain`](Self::explain), with the algorithms `comm`'s configuration picks
    /// (`NEXAR_ALLREDUCE_ALGORITHM` and the others pin them), so it says exactly what a run
    /// there does.
    pub fn explain_on(&self, shapes: &[Shape], comm: &crate::comm::NexarClient) -> String {
        self.describe(shapes, comm.world_size(), &|kind, bytes| comm.algorithm_for(kind, bytes))
    }

    fn describe(&self, shapes: &[Shape], world: usize, pick: &dyn Fn(Collective, usize) -> Algorithm) -> String {
        let layout = self.layout(shapes);
        let mut out = format!("plan {} (fingerprint {:#018x}) on {world} ranks\n", self.name, self.fingerprint);
        for (i, phase) in layout.phases.iter().enumerate() {
            let _ = writeln!(out, "  phase {i}: {} collective(s), run concurrently", phase.len());
            for unit in phase {
                match unit {
                    Unit::Bucket { kind, op, dtype, members, elems } => {
                        let bytes = elems * dtype.size();
                        let _ = writeln!(
                            out,
                            "    {} bucket: {} buffer(s) {members:?}, {elems} {dtype} elements ({bytes} bytes){}, algorithm {}",
                            kind.name(),
                            members.len(),
                            op.map(|o| format!(", {o}")).unwrap_or_default(),
                            pick(*kind, bytes)
                        );
                    }
                    Unit::Single(st) => {
                        let _ = writeln!(out, "    {}", describe_single(st, shapes, pick));
                    }
                    Unit::Lossy { how, members, elems } => {
                        let what = match how {
                            Lossy::Wire { op, compression } => {
                                format!("all_reduce_compressed bucket ({} on the wire, {op})", compression.name())
                            }
                            Lossy::TopK { ratio_ppm } => {
                                format!(
                                    "all_reduce_topk bucket ({} ppm sent, sum, error feedback kept per bucket)",
                                    ratio_ppm
                                )
                            }
                        };
                        let _ = writeln!(
                            out,
                            "    {what}: {} buffer(s) {members:?}, {elems} f32 elements ({} bytes), flattened",
                            members.len(),
                            elems * 4
                        );
                    }
                }
            }
        }
        out
    }
}

/// One statement that runs on its own (not in a bucket), as `explain` shows it: its buffers
/// with their shapes, and the algorithm a run picks for it (by the same count the run uses).
fn describe_single(st: &Statement, shapes: &[Shape], pick: &dyn Fn(Collective, usize) -> Algorithm) -> String {
    let shape = |i: usize| shapes.get(i).copied();
    let buffer = |i: usize| match shape(i) {
        Some((dtype, elems)) => format!("buffer {i} ({elems} {dtype} elements)"),
        None => format!("buffer {i}"),
    };
    let bytes = |i: usize| shape(i).map_or(0, |(dtype, elems)| elems * dtype.size());
    match *st {
        Statement::ReduceScatter { send, recv, op } => format!(
            "reduce_scatter: {} into {}, {op}, algorithm {}",
            buffer(send),
            buffer(recv),
            pick(Collective::ReduceScatter, bytes(recv))
        ),
        Statement::AllGather { send, recv } => format!(
            "all_gather: {} into {}, algorithm {}",
            buffer(send),
            buffer(recv),
            pick(Collective::AllGather, bytes(send))
        ),
        Statement::AllReduce { buf, op } => {
            format!("all_reduce: {}, {op}, algorithm {}", buffer(buf), pick(Collective::AllReduce, bytes(buf)))
        }
        Statement::Broadcast { buf, root } => format!(
            "broadcast: {} from rank {root}, algorithm {}",
            buffer(buf),
            pick(Collective::Broadcast { root }, bytes(buf))
        ),
        Statement::Barrier => "barrier".to_string(),
        // Grouped into `Unit::Lossy`, never single.
        Statement::AllReduceCompressed { buf, .. } | Statement::AllReduceTopK { buf, .. } => {
            format!("lossy all_reduce: {}", buffer(buf))
        }
    }
}

/// One rank's handle on a communicator, held weakly (an entry of a communicator that is gone
/// is dropped).
type RankOfComm = std::sync::Weak<crate::comm::CommState>;

/// The layout a plan computed for the last shapes it ran with, and the schedules of its
/// collectives (one per plan function), so a plan run again plans nothing.
#[derive(Debug, Default)]
pub struct PlanCache {
    last: Mutex<Option<(Vec<Shape>, Arc<Layout>)>>,
    /// The schedules of the plan's collectives, generated on the first run.
    pub(crate) schedules: crate::comm::ScheduleCache,
    /// The error feedback of each top-k bucket (by its buffers), carried from run to run.
    pub(crate) feedback: Mutex<Vec<(Vec<usize>, crate::comm::ErrorFeedback)>>,
    /// The shapes each (communicator, rank) last ran the plan with, checked across the ranks.
    checked: Mutex<Vec<(RankOfComm, Vec<Shape>)>>,
}

impl PlanCache {
    /// An empty cache (usable in a `static`).
    pub const fn new() -> Self {
        PlanCache {
            last: Mutex::new(None),
            schedules: crate::comm::ScheduleCache::new(),
            feedback: Mutex::new(Vec::new()),
            checked: Mutex::new(Vec::new()),
        }
    }

    /// The layout for `shapes`.
    pub(crate) fn layout(&self, spec: &PlanSpec, shapes: &[Shape]) -> Arc<Layout> {
        let mut last = crate::sync::lock(&self.last);
        if let Some((s, layout)) = last.as_ref()
            && s == shapes
        {
            return layout.clone();
        }
        let layout = Arc::new(spec.layout(shapes));
        *last = Some((shapes.to_vec(), layout.clone()));
        layout
    }

    /// Whether this rank runs the plan on `comm` with other shapes than last time (or for the
    /// first time): such a run checks its buffers' lengths against the other ranks first. Kept
    /// per rank's communicator state, so that ranks with the same history on a communicator
    /// agree, also when several ranks (or several clusters, one after the other) share this
    /// process and so this cache.
    pub(crate) fn shapes_changed(&self, comm: &Arc<crate::comm::CommState>, shapes: &[Shape]) -> bool {
        let mut checked = crate::sync::lock(&self.checked);
        checked.retain(|(key, _)| key.strong_count() > 0);
        let me = Arc::downgrade(comm);
        match checked.iter_mut().find(|(key, _)| key.ptr_eq(&me)) {
            Some((_, last)) if last.as_slice() == shapes => false,
            Some((_, last)) => {
                *last = shapes.to_vec();
                true
            }
            None => {
                checked.push((me, shapes.to_vec()));
                true
            }
        }
    }

    /// Forgets what this rank last checked on `comm` (its check failed: the next run checks
    /// again, as every rank's does).
    pub(crate) fn forget_shapes(&self, comm: &Arc<crate::comm::CommState>) {
        let me = Arc::downgrade(comm);
        crate::sync::lock(&self.checked).retain(|(key, _)| !key.ptr_eq(&me));
    }
}

/// A plan buffer, by reference, with its element type erased (plans mix element types): a
/// host `Buf<T>`, `Vec<T>` or `[T; N]`, as for the collectives themselves.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a buffer of a collective plan",
    label = "not a plan buffer",
    note = "a plan's buffers are host `Buf<T>`, `Vec<T>` or `[T; N]` of an element type, taken as `&` when only read and `&mut` when written"
)]
pub trait PlanBuffer: Send + Sync {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn elems(&self) -> usize;
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, for writing.
    fn bytes_mut(&mut self) -> &mut [u8];
}

macro_rules! plan_buffers {
    ($([$($g:tt)*] $ty:ty;)*) => {$(
        impl<$($g)*> PlanBuffer for $ty {
            fn dtype(&self) -> DType {
                T::DTYPE
            }
            fn elems(&self) -> usize {
                self[..].len()
            }
            fn bytes(&self) -> &[u8] {
                bytemuck::cast_slice(&self[..])
            }
            fn bytes_mut(&mut self) -> &mut [u8] {
                bytemuck::cast_slice_mut(&mut self[..])
            }
        }
    )*};
}

plan_buffers! {
    [T: Element] Buf<T>;
    [T: Element] Vec<T>;
    [T: Element, const N: usize] [T; N];
}

#[cfg(test)]
mod tests {
    use super::*;
    use nexar_types::ReduceOp;

    #[test]
    fn explain_names_buckets_and_single_statements() {
        const STATEMENTS: &[Statement] = &[
            Statement::AllReduce { buf: 0, op: ReduceOp::Sum },
            Statement::AllGather { send: 1, recv: 2 },
            Statement::Barrier,
        ];
        let spec = PlanSpec { name: "t", fingerprint: 1, statements: STATEMENTS, bucket_bytes: 1 << 20 };
        let text = spec.explain(&[(DType::F32, 100), (DType::I32, 8), (DType::I32, 16)], 2);
        assert!(text.contains("all_reduce bucket: 1 buffer(s) [0], 100 f32 elements (400 bytes), sum"), "{text}");
        assert!(
            text.contains("all_gather: buffer 1 (8 i32 elements) into buffer 2 (16 i32 elements), algorithm"),
            "{text}"
        );
        assert!(text.contains("phase 1: 1 collective(s)") && text.contains("barrier"), "{text}");
    }
}
