//! Typed collectives: every operation is a schedule from `proto::algo`, run by the executor.
//!
//! All ranks of a communicator must call its collectives in the same order (as in MPI). Every
//! call carries a header; ranks that disagree on operation, count, type, reduction or root get
//! a clear error on every rank, and the communicator stays usable for the next call.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use nexar_types::{Buf, DeviceError, Element, RecvBuf, ReduceError, ReduceOp, Reduction, SendBuf, segment_ranges};
use tokio::task::JoinHandle;

use super::client::NexarClient;
use super::exec::CollCall;
use super::pieces::{Data, Pieces, runs_on_pieces};
use super::state::CommState;
use crate::proto::algo::{Algorithm, Collective, Unsupported, generate, select};
use crate::proto::schedule::Schedule;
use crate::transport::TransportError;
use std::sync::Arc;

/// Failures of collectives. Each names the reporting rank and the operation.
#[derive(Clone, Debug, thiserror::Error)]
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
    /// A runtime [`ReduceOp`] that the element type does not support.
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
    pub(super) fn is_local_origin(&self) -> bool {
        !matches!(self, CollectiveError::Aborted { .. } | CollectiveError::Closed { .. })
    }

    /// Whether the flight recorder is dumped for this failure: a timeout, or a failure that
    /// involves another rank (its disagreement, its abort, its death, the link to it).
    pub(super) fn involves_peers(&self) -> bool {
        matches!(
            self,
            CollectiveError::Timeout { .. }
                | CollectiveError::Mismatch { .. }
                | CollectiveError::Aborted { .. }
                | CollectiveError::PeerGone { .. }
                | CollectiveError::Transport { .. }
                | CollectiveError::LinkFailed { .. }
        )
    }
}

/// A collective running in the background; `.await` it to get the buffer back.
///
/// The running collective owns the buffer, so forgetting or dropping the handle is sound:
/// the operation still completes with the other ranks (nobody is left waiting), and the buffer
/// is freed when it does.
#[must_use = "a collective handle does nothing unless awaited (the operation still runs)"]
pub struct CollectiveHandle<T: Element, Out = Buf<T>> {
    task: JoinHandle<Result<Out, CollectiveError>>,
    rank: usize,
    op: &'static str,
    _elem: std::marker::PhantomData<fn() -> T>,
}

/// A two-buffer collective running in the background; `.await` it to get `(send, recv)` back.
///
/// ```no_run
/// use nexar::prelude::*;
/// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
/// let w = comm.world_size();
/// let pending: nexar::ExchangeHandle<f32> = comm.all_gather_start(Buf::zeros(8), Buf::zeros(8 * w));
/// let (_send, gathered) = pending.await?;
/// # Ok(()) }
/// ```
pub type ExchangeHandle<T> = CollectiveHandle<T, (Buf<T>, Buf<T>)>;

/// The collectives with a send and a receive buffer.
#[derive(Clone, Copy)]
enum Exchange {
    AllGather,
    ReduceScatter(ReduceOp),
    AllToAll,
    Gather(usize),
    Scatter(usize),
}

impl<T: Element, Out> Future for CollectiveHandle<T, Out> {
    type Output = Result<Out, CollectiveError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (rank, op) = (self.rank, self.op);
        Pin::new(&mut self.task).poll(cx).map(|r| {
            r.unwrap_or_else(|e| {
                Err(CollectiveError::Internal { rank, op, what: format!("collective task failed: {e}") })
            })
        })
    }
}

/// Everything a schedule is generated from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScheduleKey {
    kind: Collective,
    algorithm: Algorithm,
    rank: usize,
    world: usize,
    count: usize,
    elem: usize,
}

/// Schedules kept for calls that repeat (a plan's collectives, run every iteration), so they
/// are generated once. Bounded: when full, it starts over.
#[derive(Debug, Default)]
pub(crate) struct ScheduleCache {
    kept: std::sync::Mutex<Vec<(ScheduleKey, Arc<Schedule>)>>,
}

/// Schedules a [`ScheduleCache`] keeps at most.
const CACHED_SCHEDULES: usize = 64;

impl ScheduleCache {
    /// An empty cache (usable in a `static`).
    pub(crate) const fn new() -> Self {
        ScheduleCache { kept: std::sync::Mutex::new(Vec::new()) }
    }

    fn get(&self, key: &ScheduleKey) -> Option<Arc<Schedule>> {
        crate::sync::lock(&self.kept).iter().find(|(k, _)| k == key).map(|(_, s)| s.clone())
    }

    fn keep(&self, key: ScheduleKey, schedule: Arc<Schedule>) {
        let mut kept = crate::sync::lock(&self.kept);
        if kept.len() >= CACHED_SCHEDULES {
            kept.clear();
        }
        kept.push((key, schedule));
    }
}

impl NexarClient {
    fn algorithm_for(&self, kind: Collective, bytes: usize) -> Algorithm {
        let cfg = self.config();
        let pinned = match kind {
            Collective::AllReduce => cfg.allreduce_algorithm,
            Collective::Broadcast { .. } => cfg.broadcast_algorithm,
            Collective::Barrier => cfg.barrier_algorithm,
            _ => None,
        };
        pinned.unwrap_or_else(|| select(kind, bytes, self.world_size()))
    }

    /// Plans and runs one collective with sequence number `seq`.
    pub(crate) async fn run_collective<T: Element>(
        &self,
        seq: u64,
        call: CollCall,
        data: &mut [T],
        input: &[T],
    ) -> Result<(), CollectiveError> {
        self.run_collective_cached(seq, call, data, input, None).await
    }

    /// [`run_collective`](Self::run_collective), taking the schedule from `cache` when it
    /// holds one for this call on this rank (a plan run again).
    pub(crate) async fn run_collective_cached<T: Element>(
        &self,
        seq: u64,
        call: CollCall,
        data: &mut [T],
        input: &[T],
        cache: Option<&ScheduleCache>,
    ) -> Result<(), CollectiveError> {
        let schedule = self.schedule_for::<T>(seq, &call, cache)?;
        self.execute(seq, call, &schedule, &mut Data::Flat(data), input).await
    }

    /// Runs one-buffer collective `call` on `parts`, which its schedule sees as one buffer,
    /// where they lie: no copy into a contiguous buffer and back. Returns `Ok(false)`, having
    /// sent nothing, when the schedule needs one contiguous buffer (local copies, scratch
    /// space); the caller then runs it on a flat copy under the same sequence number.
    pub(crate) async fn run_collective_in_place<T: Element>(
        &self,
        seq: u64,
        call: CollCall,
        parts: Vec<&mut [T]>,
        cache: Option<&ScheduleCache>,
    ) -> Result<bool, CollectiveError> {
        let schedule = self.schedule_for::<T>(seq, &call, cache)?;
        let pieces = Pieces::new(parts);
        if !runs_on_pieces(&schedule) || pieces.len() as u64 != call.count {
            return Ok(false);
        }
        self.execute(seq, call, &schedule, &mut Data::Pieces(pieces), &[]).await?;
        Ok(true)
    }

    /// This rank's schedule for `call`, by the algorithm the size table or the configuration
    /// picks: from `cache` when it has it, else generated (and kept there).
    fn schedule_for<T: Element>(
        &self,
        seq: u64,
        call: &CollCall,
        cache: Option<&ScheduleCache>,
    ) -> Result<Arc<Schedule>, CollectiveError> {
        let (rank, op) = (self.rank(), call.kind.name());
        let count = call.count as usize;
        let algorithm = self.algorithm_for(call.kind, count.saturating_mul(T::DTYPE.size()));
        let key =
            ScheduleKey { kind: call.kind, algorithm, rank, world: self.world_size(), count, elem: T::DTYPE.size() };
        if let Some(schedule) = cache.and_then(|c| c.get(&key)) {
            return Ok(schedule);
        }
        let mut schedule = generate(call.kind, algorithm, rank, key.world, count, key.elem)
            .map_err(|source| CollectiveError::Algorithm { rank, op, source })?;
        schedule.algorithm = algorithm.name();
        tracing::trace!(rank, op, seq, %algorithm, steps = schedule.steps.len(), "collective");
        let schedule = Arc::new(schedule);
        if let Some(cache) = cache {
            cache.keep(key, schedule.clone());
        }
        Ok(schedule)
    }

    /// What is wrong with this rank's own call, found before anything is sent.
    fn bad_call<T: Element>(&self, call: &CollCall) -> Option<String> {
        if let Some(op) = call.op
            && !op.supports(T::DTYPE)
        {
            return Some(ReduceError::Unsupported { op, dtype: T::DTYPE }.to_string());
        }
        match call.kind.root() {
            Some(root) if root >= self.world_size() => {
                Some(format!("root {root} does not exist (world size {})", self.world_size()))
            }
            _ => None,
        }
    }

    /// Elements per segment when a one-buffer collective of `count` elements of `T` runs as
    /// consecutive segments ([`NexarConfig::segment_bytes`](crate::NexarConfig::segment_bytes)),
    /// `None` when it runs whole. Every rank with the same configuration decides the same.
    ///
    /// Only allreduce is split. Any element-wise collective could be, but splitting measured
    /// slower for broadcast and reduce (each segment drains the pipeline of the one before),
    /// while a split allreduce measured faster (each segment's working set stays in cache).
    fn segment_len<T: Element>(&self, kind: Collective, count: usize) -> Option<usize> {
        let bytes = self.config().segment_bytes;
        if bytes == 0 || kind != Collective::AllReduce {
            return None;
        }
        let segment = (bytes / T::DTYPE.size()).max(1);
        (count > segment).then_some(segment)
    }

    /// A one-buffer collective on `buf`'s elements as host memory. A buffer larger than a
    /// segment runs segment by segment; otherwise a device buffer is staged through one host
    /// copy, written back only when the collective succeeded.
    async fn collective_staged<B: RecvBuf + ?Sized>(
        &self,
        kind: Collective,
        op: Option<ReduceOp>,
        buf: &mut B,
    ) -> Result<(), CollectiveError> {
        let total = buf.elems();
        if let Some(segment) = self.segment_len::<B::Elem>(kind, total) {
            let seq = self.comm.next_seq();
            return self.run_segmented(seq, kind, op, buf, segment).await;
        }
        let mut stage = match buf.host_stage() {
            Ok(stage) => stage,
            Err(source) => return Err(self.fail_device(Self::call(kind, op, 0), source).await),
        };
        let call = Self::call(kind, op, stage.len());
        self.collective(call, &mut stage, &[]).await?;
        stage.commit().map_err(|source| CollectiveError::Device { rank: self.rank(), op: kind.name(), source })
    }

    /// A two-buffer collective; see [`collective_staged`](Self::collective_staged).
    async fn exchange_staged<S, R>(&self, x: Exchange, send: &S, recv: &mut R) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        let staged = send.host_view().and_then(|view| recv.host_stage().map(|stage| (view, stage)));
        let (input, mut data) = match staged {
            Ok(both) => both,
            Err(source) => return Err(self.fail_device(self.plan_exchange(x, 0, 0).0, source).await),
        };
        let (call, bad) = self.plan_exchange(x, input.len(), data.len());
        if let Some(reason) = bad {
            return Err(self.fail_early(call, reason).await);
        }
        self.collective(call, &mut data, &input).await?;
        let op = call.kind.name();
        data.commit().map_err(|source| CollectiveError::Device { rank: self.rank(), op, source })
    }

    /// This rank cannot reach its buffer's memory: tells the others (as for a bad argument)
    /// and reports the device error here.
    async fn fail_device(&self, call: CollCall, source: DeviceError) -> CollectiveError {
        self.fail_device_seq(self.comm.next_seq(), call, source).await
    }

    async fn collective<T: Element>(&self, call: CollCall, data: &mut [T], input: &[T]) -> Result<(), CollectiveError> {
        let seq = self.comm.next_seq();
        if let Some(reason) = self.bad_call::<T>(&call) {
            return Err(self.fail_seq(seq, call, reason).await);
        }
        self.run_collective(seq, call, data, input).await
    }

    /// Runs element-wise collective `seq` on `buf` as consecutive segments of `segment`
    /// elements, each a collective of its own under the same sequence number (its messages
    /// tagged with the segment), every header carrying the whole count so ranks that disagree
    /// fail on the first segment, before any of their bytes are reduced. A device buffer stages the segments so
    /// that the copies of the next and the previous segment run while this one is on the
    /// network. On failure every rank fails (one abort covers every segment); segments
    /// before the failing one hold their results, as a host buffer would.
    async fn run_segmented<B: RecvBuf + ?Sized>(
        &self,
        seq: u64,
        kind: Collective,
        op: Option<ReduceOp>,
        buf: &mut B,
        segment: usize,
    ) -> Result<(), CollectiveError> {
        let total = buf.elems();
        let ranges: Vec<_> = segment_ranges(total, segment).collect();
        let call = |part: usize| CollCall {
            kind,
            op,
            count: ranges[part].len() as u64,
            total: total as u64,
            fingerprint: 0,
            segment: segment as u64,
            part: part as u32,
        };
        let rank = self.rank();
        if let Some(reason) = self.bad_call::<B::Elem>(&call(0)) {
            return Err(self.fail_seq(seq, call(0), reason).await);
        }
        let device = |source| CollectiveError::Device { rank, op: kind.name(), source };
        let mut stage = match buf.segment_stage(segment).and_then(|mut s| s.prefetch(ranges[0].clone()).map(|()| s)) {
            Ok(stage) => stage,
            Err(source) => return Err(self.fail_device_seq(seq, call(0), source).await),
        };
        for part in 0..ranges.len() {
            let next = ranges.get(part + 1).map_or(Ok(()), |r| stage.prefetch(r.clone()));
            let host = match next.and_then(|()| stage.host()) {
                Ok(host) => host,
                Err(source) => return Err(self.fail_device_seq(seq, call(part), source).await),
            };
            tracing::trace!(rank, op = kind.name(), seq, part, segments = ranges.len(), "segment");
            self.run_collective(seq, call(part), host, &[]).await?;
            if let Err(source) = stage.write_back() {
                // The others may already run the next segment: fail it for them.
                return Err(match ranges.get(part + 1) {
                    Some(_) => self.fail_device_seq(seq, call(part + 1), source).await,
                    None => device(source),
                });
            }
        }
        stage.finish().map_err(device)
    }

    /// [`fail_device`](Self::fail_device) for collective `seq`, already numbered.
    async fn fail_device_seq(&self, seq: u64, call: CollCall, source: DeviceError) -> CollectiveError {
        let _ = self.fail_seq(seq, call, source.to_string()).await;
        CollectiveError::Device { rank: self.rank(), op: call.kind.name(), source }
    }

    fn call(kind: Collective, op: Option<ReduceOp>, count: usize) -> CollCall {
        CollCall::whole(kind, op, count as u64, 0)
    }

    /// Reduces `buf` across all ranks with `op`; every rank ends with the result.
    ///
    /// Algorithms: recursive doubling for small buffers, recursive halving-doubling for
    /// medium ones, a pipelined ring (`2(w-1)/w` of the buffer sent per rank) for large ones.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let mut grads = Buf::from_vec(vec![1.0f32; 1 << 20]);
    /// comm.all_reduce(&mut grads, Sum).await?;
    /// # Ok(()) }
    /// ```
    pub async fn all_reduce<B: RecvBuf + ?Sized, O: Reduction<B::Elem>>(
        &self,
        buf: &mut B,
        op: O,
    ) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::AllReduce, Some(op.op()), buf).await
    }

    /// Copies `root`'s buffer into every rank's `buf` (binomial tree; pipelined chain for
    /// large buffers).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let mut weights = vec![0f64; 1000];
    /// comm.broadcast(&mut weights, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn broadcast<B: RecvBuf + ?Sized>(&self, buf: &mut B, root: usize) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::Broadcast { root }, None, buf).await
    }

    /// Reduces every rank's `buf` into `root`'s `buf` (binomial tree, large buffers in
    /// segments that move up the tree as soon as they are reduced). Other ranks' buffers are
    /// left unchanged.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let mut loss = [0.25f32];
    /// comm.reduce(&mut loss, Sum, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn reduce<B: RecvBuf + ?Sized, O: Reduction<B::Elem>>(
        &self,
        buf: &mut B,
        op: O,
        root: usize,
    ) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::Reduce { root }, Some(op.op()), buf).await
    }

    fn blocks(&self, block: usize) -> Option<usize> {
        block.checked_mul(self.world_size())
    }

    /// The call a two-buffer collective makes, and what is wrong with this rank's buffer
    /// lengths, if anything.
    fn plan_exchange(&self, x: Exchange, send: usize, recv: usize) -> (CollCall, Option<String>) {
        let world = self.world_size();
        let blocks_of = |what: &str, have: usize, other: &str, per: usize| {
            format!("{what} holds {have} elements, expected {other} ({per}) × world size ({world})")
        };
        match x {
            Exchange::AllGather => {
                let bad = (self.blocks(send) != Some(recv)).then(|| blocks_of("recv", recv, "send", send));
                (Self::call(Collective::AllGather, None, send), bad)
            }
            Exchange::ReduceScatter(op) => {
                let bad = (self.blocks(recv) != Some(send)).then(|| blocks_of("send", send, "recv", recv));
                (Self::call(Collective::ReduceScatter, Some(op), recv), bad)
            }
            Exchange::AllToAll => {
                let bad = (send != recv || !send.is_multiple_of(world)).then(|| {
                    format!("send ({send}) and recv ({recv}) must be equal and a multiple of the world size ({world})")
                });
                (Self::call(Collective::AllToAll, None, send / world), bad)
            }
            Exchange::Gather(root) => {
                let bad = (self.rank() == root && self.blocks(send) != Some(recv))
                    .then(|| blocks_of("the root's recv", recv, "send", send));
                (Self::call(Collective::Gather { root }, None, send), bad)
            }
            Exchange::Scatter(root) => {
                let bad = (self.rank() == root && self.blocks(recv) != Some(send))
                    .then(|| blocks_of("the root's send", send, "recv", recv));
                (Self::call(Collective::Scatter { root }, None, recv), bad)
            }
        }
    }

    /// Every rank's `send` block, concatenated in rank order into every rank's `recv`
    /// (`recv.len() == send.len() * world_size()`). Ring algorithm.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let mine = [comm.rank() as u32; 4];
    /// let mut all = vec![0u32; 4 * comm.world_size()];
    /// comm.all_gather(&mine, &mut all).await?;
    /// # Ok(()) }
    /// ```
    pub async fn all_gather<S, R>(&self, send: &S, recv: &mut R) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        self.exchange_staged(Exchange::AllGather, send, recv).await
    }

    /// Reduces every rank's `send` (`recv.len() * world_size()` elements) and leaves block
    /// `rank` of the result in each rank's `recv`. Ring algorithm.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let full = vec![1i64; 8 * comm.world_size()];
    /// let mut mine = vec![0i64; 8];
    /// comm.reduce_scatter(&full, &mut mine, Sum).await?;
    /// # Ok(()) }
    /// ```
    pub async fn reduce_scatter<S, R, O>(&self, send: &S, recv: &mut R, op: O) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
        O: Reduction<S::Elem>,
    {
        self.exchange_staged(Exchange::ReduceScatter(op.op()), send, recv).await
    }

    /// Block `j` of rank `i`'s `send` lands in block `i` of rank `j`'s `recv`; both hold
    /// `world_size()` equal blocks. Pairwise exchange.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let out = vec![comm.rank() as u16; 2 * comm.world_size()];
    /// let mut back = vec![0u16; out.len()];
    /// comm.all_to_all(&out, &mut back).await?;
    /// # Ok(()) }
    /// ```
    pub async fn all_to_all<S, R>(&self, send: &S, recv: &mut R) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        self.exchange_staged(Exchange::AllToAll, send, recv).await
    }

    /// Every rank's `send` block, concatenated in rank order into `root`'s `recv`
    /// (`send.len() * world_size()` elements there; other ranks' `recv` is not touched and may
    /// be empty).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let mut all = if comm.rank() == 0 { vec![0u8; comm.world_size()] } else { vec![] };
    /// comm.gather(&[comm.rank() as u8], &mut all, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn gather<S, R>(&self, send: &S, recv: &mut R, root: usize) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        self.exchange_staged(Exchange::Gather(root), send, recv).await
    }

    /// Block `i` of `root`'s `send` (`recv.len() * world_size()` elements there; other ranks'
    /// `send` is not read and may be empty) lands in rank `i`'s `recv`.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let work: Vec<u32> = if comm.rank() == 0 { (0..4 * comm.world_size() as u32).collect() } else { vec![] };
    /// let mut mine = [0u32; 4];
    /// comm.scatter(&work, &mut mine, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn scatter<S, R>(&self, send: &S, recv: &mut R, root: usize) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        self.exchange_staged(Exchange::Scatter(root), send, recv).await
    }

    /// Inclusive prefix reduction: rank `r` ends with `buf[0] op … op buf[r]` (recursive
    /// doubling, `ceil(log2 w)` rounds).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let mut offset = [10u64];
    /// comm.scan(&mut offset, Sum).await?; // rank r: 10 * (r + 1)
    /// # Ok(()) }
    /// ```
    pub async fn scan<B: RecvBuf + ?Sized, O: Reduction<B::Elem>>(
        &self,
        buf: &mut B,
        op: O,
    ) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::Scan, Some(op.op()), buf).await
    }

    /// Exclusive prefix reduction: rank `r > 0` ends with `buf[0] op … op buf[r-1]`; rank 0's
    /// buffer is left unchanged (MPI leaves it undefined).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let mut start = [100u64];
    /// comm.exclusive_scan(&mut start, Sum).await?; // rank r > 0: 100 * r
    /// # Ok(()) }
    /// ```
    pub async fn exclusive_scan<B: RecvBuf + ?Sized, O: Reduction<B::Elem>>(
        &self,
        buf: &mut B,
        op: O,
    ) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::ExclusiveScan, Some(op.op()), buf).await
    }

    /// Returns once every rank has entered the barrier (dissemination: `ceil(log2 w)` rounds).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// comm.barrier().await?;
    /// # Ok(()) }
    /// ```
    pub async fn barrier(&self) -> Result<(), CollectiveError> {
        let call = Self::call(Collective::Barrier, None, 0);
        self.collective::<u8>(call, &mut [], &[]).await
    }

    /// Starts an allreduce in the background. The handle owns the buffer and gives it back
    /// when awaited; dropping or forgetting it is sound and leaves no peer waiting.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let pending = comm.all_reduce_start(Buf::from_vec(vec![1.0f32; 1024]), Sum);
    /// // ... compute something else ...
    /// let grads = pending.await?;
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_start<T: Element, O: Reduction<T>>(&self, buf: Buf<T>, op: O) -> CollectiveHandle<T> {
        let call = Self::call(Collective::AllReduce, Some(op.op()), buf.len());
        self.start(call, buf)
    }

    /// Starts a broadcast in the background; see [`all_reduce_start`](Self::all_reduce_start).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let weights = comm.broadcast_start(nexar::Buf::<f32>::zeros(256), 0).await?;
    /// # Ok(()) }
    /// ```
    pub fn broadcast_start<T: Element>(&self, buf: Buf<T>, root: usize) -> CollectiveHandle<T> {
        let call = Self::call(Collective::Broadcast { root }, None, buf.len());
        self.start(call, buf)
    }

    /// Starts a reduce in the background; see [`all_reduce_start`](Self::all_reduce_start).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let total = comm.reduce_start(Buf::from_vec(vec![1u64; 8]), Sum, 0).await?;
    /// # Ok(()) }
    /// ```
    pub fn reduce_start<T: Element, O: Reduction<T>>(&self, buf: Buf<T>, op: O, root: usize) -> CollectiveHandle<T> {
        let call = Self::call(Collective::Reduce { root }, Some(op.op()), buf.len());
        self.start(call, buf)
    }

    /// Starts an inclusive scan in the background; see [`scan`](Self::scan).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let prefix = comm.scan_start(Buf::from_vec(vec![1u32]), Sum).await?;
    /// # Ok(()) }
    /// ```
    pub fn scan_start<T: Element, O: Reduction<T>>(&self, buf: Buf<T>, op: O) -> CollectiveHandle<T> {
        let call = Self::call(Collective::Scan, Some(op.op()), buf.len());
        self.start(call, buf)
    }

    /// Starts an exclusive scan in the background; see [`exclusive_scan`](Self::exclusive_scan).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let offset = comm.exclusive_scan_start(Buf::from_vec(vec![100u64]), Sum).await?;
    /// # Ok(()) }
    /// ```
    pub fn exclusive_scan_start<T: Element, O: Reduction<T>>(&self, buf: Buf<T>, op: O) -> CollectiveHandle<T> {
        let call = Self::call(Collective::ExclusiveScan, Some(op.op()), buf.len());
        self.start(call, buf)
    }

    /// Starts an all-gather in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let w = comm.world_size();
    /// let (_, all) = comm.all_gather_start(Buf::from_vec(vec![1u32; 4]), Buf::zeros(4 * w)).await?;
    /// # Ok(()) }
    /// ```
    pub fn all_gather_start<T: Element>(&self, send: Buf<T>, recv: Buf<T>) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::AllGather, send, recv)
    }

    /// Starts a reduce-scatter in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let w = comm.world_size();
    /// let (_, mine) = comm.reduce_scatter_start(Buf::from_vec(vec![1i64; 2 * w]), Buf::zeros(2), Sum).await?;
    /// # Ok(()) }
    /// ```
    pub fn reduce_scatter_start<T: Element, O: Reduction<T>>(
        &self,
        send: Buf<T>,
        recv: Buf<T>,
        op: O,
    ) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::ReduceScatter(op.op()), send, recv)
    }

    /// Starts an all-to-all in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let n = 2 * comm.world_size();
    /// let (_, back) = comm.all_to_all_start(Buf::from_vec(vec![7u16; n]), Buf::zeros(n)).await?;
    /// # Ok(()) }
    /// ```
    pub fn all_to_all_start<T: Element>(&self, send: Buf<T>, recv: Buf<T>) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::AllToAll, send, recv)
    }

    /// Starts a gather to `root` in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let recv = if comm.rank() == 0 { Buf::zeros(comm.world_size()) } else { Buf::zeros(0) };
    /// let (_, all) = comm.gather_start(Buf::from_vec(vec![comm.rank() as u8]), recv, 0).await?;
    /// # Ok(()) }
    /// ```
    pub fn gather_start<T: Element>(&self, send: Buf<T>, recv: Buf<T>, root: usize) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::Gather(root), send, recv)
    }

    /// Starts a scatter from `root` in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let send = if comm.rank() == 0 { Buf::from_vec(vec![5u32; comm.world_size()]) } else { Buf::zeros(0) };
    /// let (_, mine) = comm.scatter_start(send, Buf::zeros(1), 0).await?;
    /// # Ok(()) }
    /// ```
    pub fn scatter_start<T: Element>(&self, send: Buf<T>, recv: Buf<T>, root: usize) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::Scatter(root), send, recv)
    }

    /// Takes the sequence number now (so the call order is the order of `start` calls) and
    /// runs the collective in a task that owns the buffer.
    fn start<T: Element>(&self, call: CollCall, mut buf: Buf<T>) -> CollectiveHandle<T> {
        let client = self.clone();
        let seq = self.comm.next_seq();
        let (rank, op) = (self.rank(), call.kind.name());
        let segment = self.segment_len::<T>(call.kind, buf.len());
        let task = tokio::spawn(async move {
            if let Some(segment) = segment {
                return client.run_segmented(seq, call.kind, call.op, &mut buf, segment).await.map(|()| buf);
            }
            if let Some(reason) = client.bad_call::<T>(&call) {
                return Err(client.fail_seq(seq, call, reason).await);
            }
            client.run_collective(seq, call, buf.as_mut_slice(), &[]).await.map(|()| buf)
        });
        CollectiveHandle { task, rank, op, _elem: std::marker::PhantomData }
    }

    /// [`start`](Self::start) for collectives with a send and a receive buffer.
    fn start_exchange<T: Element>(&self, x: Exchange, send: Buf<T>, mut recv: Buf<T>) -> ExchangeHandle<T> {
        let client = self.clone();
        let seq = self.comm.next_seq();
        let (call, bad) = self.plan_exchange(x, send.len(), recv.len());
        let (rank, op) = (self.rank(), call.kind.name());
        let task = tokio::spawn(async move {
            if let Some(reason) = bad.or_else(|| client.bad_call::<T>(&call)) {
                return Err(client.fail_seq(seq, call, reason).await);
            }
            client.run_collective(seq, call, recv.as_mut_slice(), send.as_slice()).await.map(|()| (send, recv))
        });
        CollectiveHandle { task, rank, op, _elem: std::marker::PhantomData }
    }

    /// Splits this communicator: ranks that pass the same `color` form a new communicator,
    /// ordered by `key` (then by their rank here). Ranks that pass `None` get `None`. Every
    /// rank must call it. The new communicator's traffic is isolated from this one's, and both
    /// can run collectives concurrently.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let row = comm.split(Some((comm.rank() / 2) as u32), comm.rank() as u32).await?.unwrap();
    /// row.barrier().await?;
    /// # Ok(()) }
    /// ```
    pub async fn split(&self, color: Option<u32>, key: u32) -> Result<Option<NexarClient>, CollectiveError> {
        let world = self.world_size();
        let mine = [color.map_or(u64::MAX, u64::from), u64::from(key)];
        let mut all = vec![0u64; 2 * world];
        let seq = self.comm.next_seq();
        let call = Self::call(Collective::AllGather, None, 2);
        self.run_collective(seq, call, &mut all, &mine).await?;
        let Some(color) = color else { return Ok(None) };
        let mut group: Vec<(u64, usize)> =
            (0..world).filter(|r| all[2 * r] == u64::from(color)).map(|r| (all[2 * r + 1], r)).collect();
        group.sort();
        let me = group.iter().position(|(_, r)| *r == self.rank()).ok_or_else(|| CollectiveError::Internal {
            rank: self.rank(),
            op: "split",
            what: "this rank is missing from its own color group".into(),
        })?;
        let members = group.iter().map(|(_, r)| self.comm.members[*r]).collect();
        let id = nexar_types::stable_id(&[&self.comm.id.to_string(), &seq.to_string(), &color.to_string()]).max(1);
        Ok(Some(self.with_comm(CommState::new(id, members, me))))
    }
}

#[cfg(test)]
#[path = "collective_tests.rs"]
mod tests;
