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

use nexar_types::{Buf, DType, Element, ReduceOp};

use crate::proto::algo::{Algorithm, Collective, select};

pub use run::PlanRun;

/// One statement of a plan, as the macro recorded it (buffers by parameter index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Statement {
    /// `all_reduce(buf, op)`
    AllReduce {
        /// Parameter index of the buffer.
        buf: usize,
        /// The reduction.
        op: ReduceOp,
    },
    /// `broadcast(buf, root)`
    Broadcast {
        /// Parameter index of the buffer.
        buf: usize,
        /// The root rank.
        root: usize,
    },
    /// `reduce_scatter(send, recv, op)`
    ReduceScatter {
        /// Parameter index of the send buffer.
        send: usize,
        /// Parameter index of the receive buffer.
        recv: usize,
        /// The reduction.
        op: ReduceOp,
    },
    /// `all_gather(send, recv)`
    AllGather {
        /// Parameter index of the send buffer.
        send: usize,
        /// Parameter index of the receive buffer.
        recv: usize,
    },
    /// `barrier()`
    Barrier,
}

impl Statement {
    fn buffers(&self) -> Vec<usize> {
        match *self {
            Statement::AllReduce { buf, .. } | Statement::Broadcast { buf, .. } => vec![buf],
            Statement::ReduceScatter { send, recv, .. } | Statement::AllGather { send, recv } => vec![send, recv],
            Statement::Barrier => vec![],
        }
    }
}

/// A plan as compiled by the macro: its statements and fingerprint.
#[derive(Debug)]
pub struct PlanSpec {
    /// The plan function's path.
    pub name: &'static str,
    /// Compile-time fingerprint of the statements and buffer types.
    pub fingerprint: u64,
    /// The statements, in source order.
    pub statements: &'static [Statement],
    /// Largest bucket in bytes.
    pub bucket_bytes: usize,
}

/// How one set of buffers is grouped: computed on first use for given buffer shapes, then reused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Phases run one after another; the units of a phase run concurrently.
    pub phases: Vec<Vec<Unit>>,
}

/// One collective of a plan run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unit {
    /// Buffers fused into one allreduce or broadcast.
    Bucket { kind: Collective, op: Option<ReduceOp>, dtype: DType, members: Vec<usize>, elems: usize },
    /// A statement run as it is (reduce-scatter, all-gather, barrier).
    Single(Statement),
}

/// The shape of one plan buffer: element type and length.
pub type Shape = (DType, usize);

impl PlanSpec {
    /// Groups the statements for buffers of these shapes.
    pub(crate) fn layout(&self, shapes: &[Shape]) -> Layout {
        // A statement that touches a buffer an earlier statement of the current phase touched
        // starts a new phase, so fusion never reorders dependent statements.
        let mut phases: Vec<Vec<Statement>> = vec![Vec::new()];
        let mut used: Vec<usize> = Vec::new();
        for st in self.statements {
            let bufs = st.buffers();
            if bufs.iter().any(|b| used.contains(b)) || (*st == Statement::Barrier && !used.is_empty()) {
                phases.push(Vec::new());
                used.clear();
            }
            used.extend(bufs);
            phases.last_mut().expect("one phase at least").push(*st);
        }
        let phases =
            phases.into_iter().filter(|p| !p.is_empty()).map(|statements| self.group(&statements, shapes)).collect();
        Layout { phases }
    }

    fn group(&self, statements: &[Statement], shapes: &[Shape]) -> Vec<Unit> {
        let mut units: Vec<Unit> = Vec::new();
        for st in statements {
            let (kind, op, buf) = match *st {
                Statement::AllReduce { buf, op } => (Collective::AllReduce, Some(op), buf),
                Statement::Broadcast { buf, root } => (Collective::Broadcast { root }, None, buf),
                other => {
                    units.push(Unit::Single(other));
                    continue;
                }
            };
            let (dtype, len) = shapes[buf];
            let cap = (self.bucket_bytes / dtype.size()).max(1);
            let open = units.iter_mut().find(|u| {
                matches!(u, Unit::Bucket { kind: k, op: o, dtype: d, elems, .. }
                    if *k == kind && *o == op && *d == dtype && (*elems + len <= cap || *elems == 0))
            });
            match open {
                Some(Unit::Bucket { members, elems, .. }) => {
                    members.push(buf);
                    *elems += len;
                }
                _ => units.push(Unit::Bucket { kind, op, dtype, members: vec![buf], elems: len }),
            }
        }
        units
    }

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
    pub fn explain_on(&self, shapes: &[Shape], comm: &crate::NexarClient) -> String {
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
    }
}

/// The layout a plan computed for the last shapes it ran with, and the schedules of its
/// collectives (one per plan function), so a plan run again plans nothing.
#[derive(Debug, Default)]
pub struct PlanCache {
    last: Mutex<Option<(Vec<Shape>, Arc<Layout>)>>,
    /// The schedules of the plan's collectives, generated on the first run.
    pub(crate) schedules: crate::comm::ScheduleCache,
}

impl PlanCache {
    /// An empty cache (usable in a `static`).
    pub const fn new() -> Self {
        PlanCache { last: Mutex::new(None), schedules: crate::comm::ScheduleCache::new() }
    }

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

    const STATEMENTS: &[Statement] = &[
        Statement::AllReduce { buf: 0, op: ReduceOp::Sum },
        Statement::AllReduce { buf: 1, op: ReduceOp::Sum },
        Statement::AllReduce { buf: 2, op: ReduceOp::Sum },
        Statement::Broadcast { buf: 3, root: 0 },
        Statement::AllReduce { buf: 0, op: ReduceOp::Max },
    ];

    #[test]
    fn compatible_statements_share_buckets_and_dependent_ones_wait() {
        let spec = PlanSpec { name: "t", fingerprint: 1, statements: STATEMENTS, bucket_bytes: 1 << 20 };
        let shapes = [(DType::F32, 100), (DType::F32, 50), (DType::I64, 7), (DType::F32, 3)];
        let layout = spec.layout(&shapes);
        assert_eq!(layout.phases.len(), 2, "buffer 0 is used again, so a second phase follows");
        assert_eq!(layout.phases[0].len(), 3, "f32 sum bucket, i64 sum bucket, broadcast");
        assert!(matches!(&layout.phases[0][0], Unit::Bucket { members, elems: 150, .. } if members == &vec![0, 1]));
        let tiny = PlanSpec { bucket_bytes: 400, ..spec };
        let split = tiny.layout(&shapes);
        assert_eq!(split.phases[0].len(), 4, "the cap splits the f32 bucket");
        assert!(tiny.explain(&shapes, 2).contains("all_reduce bucket"));
    }
}
