//! The plan compiler, sans-IO: what `#[nexar::collective_plan]` records (statements over
//! buffers by parameter index) and how a plan's statements are grouped for buffers of given
//! shapes. Compatible statements (allreduces of one element type and reduction; broadcasts of
//! one element type and root) are fused into buckets under a size cap; a statement that
//! touches a buffer the current phase already touched starts a new phase, so fusion never
//! reorders dependent work. Running a layout is `crate::plan`'s job.

use nexar_types::{DType, ReduceOp};

use crate::proto::algo::Collective;
use crate::proto::compression::Compression;

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
    /// `all_reduce_compressed(buf, op, Bf16 | F16)`: an `f32` buffer, 16-bit on the wire.
    AllReduceCompressed {
        /// Parameter index of the buffer.
        buf: usize,
        /// The reduction (`Sum`, `Max` or `Min`).
        op: ReduceOp,
        /// The wire format.
        compression: Compression,
    },
    /// `all_reduce_topk(buf, Sum, ratio)`: an `f32` buffer's largest entries, with error
    /// feedback that the plan keeps per bucket between runs.
    AllReduceTopK {
        /// Parameter index of the buffer.
        buf: usize,
        /// The share of elements sent, in parts per million (1 to 1,000,000).
        ratio_ppm: u32,
    },
    /// `barrier()`
    Barrier,
}

impl Statement {
    /// The buffers the statement touches, by parameter index.
    pub(crate) fn buffers(&self) -> Vec<usize> {
        match *self {
            Statement::AllReduce { buf, .. }
            | Statement::Broadcast { buf, .. }
            | Statement::AllReduceCompressed { buf, .. }
            | Statement::AllReduceTopK { buf, .. } => vec![buf],
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
    /// `f32` buffers fused into one compressed or top-k allreduce (through a flat copy).
    Lossy { how: Lossy, members: Vec<usize>, elems: usize },
}

/// How a [`Unit::Lossy`] allreduce loses precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lossy {
    /// 16-bit on the wire, reduced with `op`.
    Wire { op: ReduceOp, compression: Compression },
    /// The largest `ratio_ppm` parts per million, summed, with error feedback.
    TopK { ratio_ppm: u32 },
}

/// The shape of one plan buffer: element type and length.
pub type Shape = (DType, usize);

impl PlanSpec {
    /// Groups the statements for buffers of these shapes.
    pub(crate) fn layout(&self, shapes: &[Shape]) -> Layout {
        // A statement that touches a buffer an earlier statement of the current phase touched
        // starts a new phase, so fusion never reorders dependent statements.
        let mut phases: Vec<Vec<Statement>> = Vec::new();
        let mut current: Vec<Statement> = Vec::new();
        let mut used: Vec<usize> = Vec::new();
        for st in self.statements {
            let bufs = st.buffers();
            if bufs.iter().any(|b| used.contains(b)) || (*st == Statement::Barrier && !used.is_empty()) {
                phases.push(std::mem::take(&mut current));
                used.clear();
            }
            used.extend(bufs);
            current.push(*st);
        }
        phases.push(current);
        let phases =
            phases.into_iter().filter(|p| !p.is_empty()).map(|statements| self.group(&statements, shapes)).collect();
        Layout { phases }
    }

    fn group(&self, statements: &[Statement], shapes: &[Shape]) -> Vec<Unit> {
        let mut units: Vec<Unit> = Vec::new();
        for st in statements {
            let lossy = match *st {
                Statement::AllReduceCompressed { buf, op, compression } => Some((Lossy::Wire { op, compression }, buf)),
                Statement::AllReduceTopK { buf, ratio_ppm } => Some((Lossy::TopK { ratio_ppm }, buf)),
                _ => None,
            };
            if let Some((how, buf)) = lossy {
                let len = shapes[buf].1;
                let cap = (self.bucket_bytes / size_of::<f32>()).max(1);
                let open = units.iter_mut().find(|u| {
                    matches!(u, Unit::Lossy { how: h, elems, .. } if *h == how && (*elems + len <= cap || *elems == 0))
                });
                match open {
                    Some(Unit::Lossy { members, elems, .. }) => {
                        members.push(buf);
                        *elems += len;
                    }
                    _ => units.push(Unit::Lossy { how, members: vec![buf], elems: len }),
                }
                continue;
            }
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
    }
}
