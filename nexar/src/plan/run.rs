//! Running a plan: run the phase's collectives concurrently (one sequence number each, taken
//! in the same order on every rank). A bucket's buffers are reduced where they lie when its
//! schedule only sends and receives; otherwise they are flattened into pooled staging memory
//! and copied back.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use nexar_types::{DType, Element, bf16, f16};

use super::{Layout, Lossy, PlanBuffer, PlanCache, PlanSpec, Shape, Statement, Unit};
use crate::comm::{CollCall, CollectiveError, NexarClient};
use crate::proto::algo::Collective;

/// A plan argument: read-only (send buffers) or writable.
pub enum PlanArg<'a> {
    /// A buffer the plan only reads.
    Read(&'a dyn PlanBuffer),
    /// A buffer the plan writes.
    Write(&'a mut dyn PlanBuffer),
}

impl PlanArg<'_> {
    fn shape(&self) -> Shape {
        match self {
            PlanArg::Read(b) => (b.dtype(), b.elems()),
            PlanArg::Write(b) => (b.dtype(), b.elems()),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            PlanArg::Read(b) => b.bytes(),
            PlanArg::Write(b) => b.bytes(),
        }
    }
}

/// One execution of a plan over its buffers (built by the code `#[nexar::collective_plan]`
/// generates).
pub struct PlanRun<'a> {
    spec: &'static PlanSpec,
    cache: &'static PlanCache,
    args: Vec<PlanArg<'a>>,
}

type UnitFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<(usize, PlanArg<'a>)>, CollectiveError>> + Send + 'a>>;

/// Runs `$body` with `$t` bound to the element type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            DType::I8 => {
                type $t = i8;
                $body
            }
            DType::I16 => {
                type $t = i16;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::U16 => {
                type $t = u16;
                $body
            }
            DType::U32 => {
                type $t = u32;
                $body
            }
            DType::U64 => {
                type $t = u64;
                $body
            }
        }
    };
}

/// Runs the units of a phase concurrently. Returns at the first failure: the other units are
/// dropped, which tells their peers they were cancelled.
async fn join_all<'a>(mut futures: Vec<UnitFuture<'a>>) -> Result<Vec<Vec<(usize, PlanArg<'a>)>>, CollectiveError> {
    let mut out: Vec<Option<Vec<(usize, PlanArg<'a>)>>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futures.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(Ok(v)) => *slot = Some(v),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending { Poll::Pending } else { Poll::Ready(Ok(())) }
    })
    .await?;
    Ok(out.into_iter().flatten().collect())
}

fn typed<'b, T: Element>(bytes: &'b [u8], rank: usize, op: &'static str) -> Result<&'b [T], CollectiveError> {
    bytemuck::try_cast_slice(bytes).map_err(|e| CollectiveError::Internal { rank, op, what: e.to_string() })
}

fn typed_mut<'b, T: Element>(
    bytes: &'b mut [u8],
    rank: usize,
    op: &'static str,
) -> Result<&'b mut [T], CollectiveError> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| CollectiveError::Internal { rank, op, what: e.to_string() })
}

impl<'a> PlanRun<'a> {
    /// Starts a run of `spec`; add the plan function's buffers in parameter order.
    pub fn new(spec: &'static PlanSpec, cache: &'static PlanCache) -> Self {
        PlanRun { spec, cache, args: Vec::new() }
    }

    /// Adds a buffer the plan only reads.
    pub fn read(mut self, buf: &'a dyn PlanBuffer) -> Self {
        self.args.push(PlanArg::Read(buf));
        self
    }

    /// Adds a buffer the plan writes.
    pub fn write(mut self, buf: &'a mut dyn PlanBuffer) -> Self {
        self.args.push(PlanArg::Write(buf));
        self
    }

    /// Runs the plan on `comm`.
    ///
    /// The whole run takes one sequence number of `comm` (so ranks stay in step even when they
    /// run different plans) and runs its collectives on a private communicator derived from it.
    /// If any of them fails, every other collective of the run is aborted on every rank.
    pub async fn run(self, comm: &NexarClient) -> Result<(), CollectiveError> {
        let shapes: Vec<Shape> = self.args.iter().map(PlanArg::shape).collect();
        let layout: std::sync::Arc<Layout> = self.cache.layout(self.spec, &shapes);
        let state = comm.comm.clone();
        let fresh = self.cache.shapes_changed(&state, &shapes);
        let cache = self.cache;
        let run = comm.plan_view(comm.comm.next_seq());
        // The length check takes the run's first sequence number when it runs.
        let units: u64 = layout.phases.iter().map(|p| p.len() as u64).sum::<u64>() + u64::from(fresh);
        let spec = self.spec;
        let result = async {
            if fresh && let Err(e) = lengths_agree(&run, spec, &shapes).await {
                cache.forget_shapes(&state);
                return Err(e);
            }
            self.run_layout(&run, &layout).await
        }
        .await;
        if let Err(e) = &result {
            let reason = e.to_string();
            for seq in 0..units {
                crate::comm::broadcast_abort(&run, seq, &reason).await;
            }
            return result;
        }
        // The run's communicator ends here: its rooted collectives are confirmed before it
        // does (every rank's run ends the same way), and a failure among them is the run's.
        run.confirm_all().await;
        comm.reported("plan", run.reported("plan", result))
    }

    async fn run_layout(self, comm: &NexarClient, layout: &Layout) -> Result<(), CollectiveError> {
        let mut slots: Vec<Option<PlanArg<'a>>> = self.args.into_iter().map(Some).collect();
        for phase in &layout.phases {
            let mut futures: Vec<UnitFuture<'a>> = Vec::with_capacity(phase.len());
            for unit in phase {
                // Sequence numbers in unit order: the same on every rank running this plan.
                let seq = comm.comm.next_seq();
                let taken: Vec<(usize, PlanArg<'a>)> = unit_buffers(unit)
                    .into_iter()
                    .filter_map(|i| slots.get_mut(i).and_then(Option::take).map(|a| (i, a)))
                    .collect();
                let unit_run = run_unit(comm.clone(), self.spec.fingerprint, unit.clone(), seq, taken, self.cache);
                futures.push(Box::pin(unit_run));
            }
            for args in join_all(futures).await? {
                for (i, a) in args {
                    slots[i] = Some(a);
                }
            }
        }
        Ok(())
    }
}

/// Checks that every rank passes buffers of the same lengths: one allreduce of each length and
/// its complement (their maxima are the largest and the smallest length on any rank). Without
/// it, ranks that pass the same total in different buffers would fuse mismatched tensors into
/// buckets of one size, which the collectives' own checks (the bucket's count) cannot see.
async fn lengths_agree(run: &NexarClient, spec: &PlanSpec, shapes: &[Shape]) -> Result<(), CollectiveError> {
    let mut lens: Vec<u64> = Vec::with_capacity(2 * shapes.len());
    for (_, elems) in shapes {
        lens.push(*elems as u64);
        lens.push(!(*elems as u64));
    }
    if lens.is_empty() {
        return Ok(());
    }
    run.all_reduce(&mut lens[..], nexar_types::Max).await?;
    match lens.chunks(2).position(|l| l[0] != !l[1]) {
        None => Ok(()),
        Some(i) => Err(CollectiveError::InvalidArgument {
            rank: run.rank(),
            op: "plan",
            reason: format!(
                "plan {}: buffer {i} has {} elements on this rank, and between {} and {} across the ranks; every rank passes buffers of the same lengths",
                spec.name,
                shapes[i].1,
                !lens[2 * i + 1],
                lens[2 * i]
            ),
        }),
    }
}

fn unit_buffers(unit: &Unit) -> Vec<usize> {
    match unit {
        Unit::Bucket { members, .. } | Unit::Lossy { members, .. } => members.clone(),
        Unit::Single(st) => st.buffers(),
    }
}

async fn run_unit<'a>(
    comm: NexarClient,
    fingerprint: u64,
    unit: Unit,
    seq: u64,
    mut args: Vec<(usize, PlanArg<'a>)>,
    cache: &'static PlanCache,
) -> Result<Vec<(usize, PlanArg<'a>)>, CollectiveError> {
    let rank = comm.rank();
    let schedules = Some(&cache.schedules);
    match unit {
        Unit::Bucket { kind, op, dtype, elems, .. } => {
            let name = kind.name();
            let call = CollCall::whole(kind, op, elems as u64, fingerprint);
            // A bucket of buffers the plan writes (allreduce, broadcast) is reduced where its
            // buffers lie when the schedule allows; otherwise through one flat copy.
            if args.iter().all(|(_, a)| matches!(a, PlanArg::Write(_))) {
                let in_place = with_dtype!(dtype, T => {
                    let mut parts = Vec::with_capacity(args.len());
                    for (_, a) in args.iter_mut() {
                        if let PlanArg::Write(b) = a {
                            parts.push(typed_mut::<T>(b.bytes_mut(), rank, name)?);
                        }
                    }
                    comm.run_collective_in_place::<T>(seq, call, parts, schedules).await?
                });
                if in_place {
                    return Ok(args);
                }
            }
            let bytes = elems * dtype.size();
            let pool = comm.inner.pool.clone();
            let mut staging = pool.lend(bytes);
            {
                let flat = staging.slice_mut::<u8>(bytes);
                let mut at = 0;
                for (_, a) in &args {
                    let b = a.bytes();
                    flat[at..at + b.len()].copy_from_slice(b);
                    at += b.len();
                }
            }
            let flat = staging.slice_mut::<u8>(bytes);
            with_dtype!(dtype, T => {
                let data = typed_mut::<T>(flat, rank, name)?;
                comm.run_collective_cached::<T>(seq, call, data, &[], schedules).await?;
            });
            let flat = staging.slice_mut::<u8>(bytes);
            let mut at = 0;
            for (_, a) in args.iter_mut() {
                if let PlanArg::Write(b) = a {
                    let out = b.bytes_mut();
                    let n = out.len();
                    out.copy_from_slice(&flat[at..at + n]);
                    at += n;
                }
            }
            drop(staging);
            Ok(args)
        }
        Unit::Lossy { how, members, elems } => {
            run_lossy(&comm, fingerprint, seq, how, &members, elems, &mut args, cache).await?;
            Ok(args)
        }
        Unit::Single(Statement::Barrier) => {
            let call = CollCall::whole(Collective::Barrier, None, 0, fingerprint);
            comm.run_collective_cached::<u8>(seq, call, &mut [], &[], schedules).await?;
            Ok(args)
        }
        Unit::Single(st) => {
            let (kind, op) = match st {
                Statement::ReduceScatter { op, .. } => (Collective::ReduceScatter, Some(op)),
                _ => (Collective::AllGather, None),
            };
            let name = kind.name();
            let (send_i, recv_i) = match st {
                Statement::ReduceScatter { send, recv, .. } | Statement::AllGather { send, recv } => (send, recv),
                _ => (usize::MAX, usize::MAX),
            };
            let mut take = |i: usize| args.iter().position(|(j, _)| *j == i).map(|p| args.swap_remove(p).1);
            let (Some(send), Some(mut recv)) = (take(send_i), take(recv_i)) else {
                return Err(CollectiveError::Internal { rank, op: name, what: "plan buffers missing".into() });
            };
            let (send_shape, recv_shape) = (send.shape(), recv.shape());
            let world = comm.world_size();
            let (block, fits) = match kind {
                Collective::ReduceScatter => (recv_shape.1, send_shape.1 == recv_shape.1 * world),
                _ => (send_shape.1, recv_shape.1 == send_shape.1 * world),
            };
            let call = CollCall::whole(kind, op, block as u64, fingerprint);
            if !fits || send_shape.0 != recv_shape.0 {
                let reason = format!(
                    "{name} buffers of {} and {} elements do not fit {world} ranks",
                    send_shape.1, recv_shape.1
                );
                return Err(comm.fail_seq(seq, call, reason).await);
            }
            let PlanArg::Write(out) = &mut recv else {
                return Err(CollectiveError::Internal { rank, op: name, what: "receive buffer is read-only".into() });
            };
            // Plan buffers are `Buf<T>`s, so their bytes are aligned for `T`.
            with_dtype!(send_shape.0, T => {
                let input = typed::<T>(send.bytes(), rank, name)?;
                let data = typed_mut::<T>(out.bytes_mut(), rank, name)?;
                comm.run_collective_cached::<T>(seq, call, data, input, schedules).await?;
            });
            args.push((send_i, send));
            args.push((recv_i, recv));
            Ok(args)
        }
    }
}

/// A compressed or top-k bucket: the ranks first check the plan's fingerprint at the unit's
/// sequence number (a rank running another plan is refused there, as for every plan
/// collective), then the `f32` buffers are flattened into one copy, reduced by the operation
/// on a communicator of its own for this unit (it runs several collectives), and copied back.
#[allow(clippy::too_many_arguments)]
async fn run_lossy(
    comm: &NexarClient,
    fingerprint: u64,
    seq: u64,
    how: Lossy,
    members: &[usize],
    elems: usize,
    args: &mut [(usize, PlanArg<'_>)],
    cache: &'static PlanCache,
) -> Result<(), CollectiveError> {
    let rank = comm.rank();
    let op = match how {
        Lossy::Wire { .. } => "all_reduce_compressed",
        Lossy::TopK { .. } => "all_reduce_topk",
    };
    let check = CollCall::whole(Collective::Barrier, None, 0, fingerprint);
    if let Some((i, _)) = args.iter().find(|(_, a)| a.shape().0 != DType::F32) {
        let reason = format!("plan buffer {i} is not f32: {op} takes f32 elements");
        return Err(comm.fail_seq(seq, check, reason).await);
    }
    comm.run_collective_cached::<u8>(seq, check, &mut [], &[], Some(&cache.schedules)).await?;
    let mut flat: Vec<f32> = Vec::with_capacity(elems);
    for (_, a) in args.iter() {
        flat.extend_from_slice(typed::<f32>(a.bytes(), rank, op)?);
    }
    let unit = comm.plan_view(seq);
    match how {
        Lossy::Wire { op, compression } => unit.all_reduce_compressed(&mut flat[..], op, compression).await?,
        Lossy::TopK { ratio_ppm } => {
            let ratio = f64::from(ratio_ppm) / 1e6;
            let kept = {
                let mut kept = crate::sync::lock(&cache.feedback);
                let at = kept.iter().position(|(m, _)| m == members);
                at.map(|at| kept.swap_remove(at).1)
            };
            let mut feedback = kept.unwrap_or_else(|| crate::comm::ErrorFeedback::new(ratio));
            let outcome = unit.all_reduce_topk(&mut flat[..], nexar_types::Sum, &mut feedback).await;
            crate::sync::lock(&cache.feedback).push((members.to_vec(), feedback));
            outcome?;
        }
    }
    let mut at = 0;
    for (_, a) in args.iter_mut() {
        if let PlanArg::Write(b) = a {
            let out = typed_mut::<f32>(b.bytes_mut(), rank, op)?;
            out.copy_from_slice(&flat[at..at + out.len()]);
            at += out.len();
        }
    }
    Ok(())
}
