//! A collective call from arguments to schedule: checking it, choosing its algorithm and
//! segments, staging device buffers, and running it with a sequence number.

use std::sync::Arc;

use nexar_types::{DeviceError, Element, RecvBuf, ReduceError, ReduceOp, SendBuf, segment_ranges};

use super::{CACHED_STEPS, CollectiveError, Exchange, ScheduleCache, ScheduleKey};
use crate::comm::client::NexarClient;
use crate::comm::exec::CollCall;
use crate::comm::exec::pieces::{Data, Pieces, runs_on_pieces};
use crate::comm::exec::wire_codec::AsIs;
use crate::proto::algo::hierarchical::HostLayout;
use crate::proto::algo::{Algorithm, Collective, generate_on, select_on};
use crate::proto::schedule::Schedule;

impl NexarClient {
    /// The algorithm a collective of `bytes` gets here: the one the configuration pins, or
    /// the size table's choice.
    pub(crate) fn algorithm_for(&self, kind: Collective, bytes: usize) -> Algorithm {
        let cfg = self.config();
        let pinned = match kind {
            Collective::AllReduce => cfg.allreduce_algorithm,
            Collective::Broadcast { .. } => cfg.broadcast_algorithm,
            Collective::Barrier => cfg.barrier_algorithm,
            _ => None,
        };
        let layout = self.layout_ref();
        let runs_two_level = |l: &HostLayout| match kind {
            Collective::AllReduce | Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => {
                l.ranks_per_host().is_some()
            }
            Collective::Broadcast { .. } | Collective::Reduce { .. } => true,
            _ => false,
        };
        match pinned {
            // Pinned where it cannot run (no layout, hosts of different sizes): the table.
            Some(Algorithm::Hierarchical { .. }) if !layout.is_some_and(runs_two_level) => {
                select_on(kind, bytes, self.world_size(), None)
            }
            Some(pinned) => pinned,
            None => select_on(kind, bytes, self.world_size(), layout),
        }
    }

    /// The algorithm an allreduce of `bytes` bytes per rank runs with on this communicator
    /// (the size table's choice, or the one `NEXAR_ALLREDUCE_ALGORITHM` pins), by name:
    /// `recursive_doubling`, `halving_doubling`, `pipelined_ring`, `hierarchical`, ...
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// println!("a 64 MiB allreduce runs {}", comm.allreduce_algorithm(64 << 20));
    /// # }
    /// ```
    pub fn allreduce_algorithm(&self, bytes: usize) -> &'static str {
        self.algorithm_for(Collective::AllReduce, bytes).name()
    }

    /// The algorithm a broadcast of `bytes` bytes runs with on this communicator (the size
    /// table's choice, or the one `NEXAR_BROADCAST_ALGORITHM` pins): `binomial_tree`,
    /// `pipelined_chain`, or `hierarchical` where ranks share hosts.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// println!("a 64 MiB broadcast runs {}", comm.broadcast_algorithm(64 << 20));
    /// # }
    /// ```
    pub fn broadcast_algorithm(&self, bytes: usize) -> &'static str {
        self.algorithm_for(Collective::Broadcast { root: 0 }, bytes).name()
    }

    /// The algorithm a reduce of `bytes` bytes per rank runs with on this communicator.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// println!("a 64 MiB reduce runs {}", comm.reduce_algorithm(64 << 20));
    /// # }
    /// ```
    pub fn reduce_algorithm(&self, bytes: usize) -> &'static str {
        self.algorithm_for(Collective::Reduce { root: 0 }, bytes).name()
    }

    /// The algorithm an all-gather of `block_bytes` bytes from each rank runs with on this
    /// communicator (its `send` buffer's bytes).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// println!("an all-gather of 1 MiB blocks runs {}", comm.all_gather_algorithm(1 << 20));
    /// # }
    /// ```
    pub fn all_gather_algorithm(&self, block_bytes: usize) -> &'static str {
        self.algorithm_for(Collective::AllGather, block_bytes).name()
    }

    /// The algorithm a reduce-scatter leaving `block_bytes` bytes on each rank runs with on
    /// this communicator (its `recv` buffer's bytes).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// println!("a reduce-scatter into 1 MiB blocks runs {}", comm.reduce_scatter_algorithm(1 << 20));
    /// # }
    /// ```
    pub fn reduce_scatter_algorithm(&self, block_bytes: usize) -> &'static str {
        self.algorithm_for(Collective::ReduceScatter, block_bytes).name()
    }

    /// The algorithm an all-to-all of `block_bytes` bytes per destination runs with on this
    /// communicator (its `send` buffer's bytes over the world size): `pairwise`,
    /// `pipelined_pairwise`, or `hierarchical` for small blocks across hosts with several
    /// ranks each.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// println!("an all-to-all of 4 KiB blocks runs {}", comm.all_to_all_algorithm(4 << 10));
    /// # }
    /// ```
    pub fn all_to_all_algorithm(&self, block_bytes: usize) -> &'static str {
        self.algorithm_for(Collective::AllToAll, block_bytes).name()
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
        self.execute::<T, AsIs>(seq, call, &schedule, &mut Data::Flat(data), input).await
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
        self.execute::<T, AsIs>(seq, call, &schedule, &mut Data::Pieces(pieces), &[]).await?;
        Ok(true)
    }

    /// This rank's schedule for `call`, by the algorithm the size table or the configuration
    /// picks: from `cache` (a plan's; else the communicator's own) when it has it, else
    /// generated (and kept there unless it is long).
    pub(super) fn schedule_for<T: Element>(
        &self,
        seq: u64,
        call: &CollCall,
        cache: Option<&ScheduleCache>,
    ) -> Result<Arc<Schedule>, CollectiveError> {
        let (rank, op) = (self.rank(), call.kind.name());
        let count = call.count as usize;
        let algorithm = self.algorithm_for(call.kind, count.saturating_mul(T::DTYPE.size()));
        let layout = self.layout_ref();
        let key = ScheduleKey {
            kind: call.kind,
            algorithm,
            rank,
            world: self.world_size(),
            count,
            elem: T::DTYPE.size(),
            hosts_known: layout.is_some(),
        };
        let cache = cache.unwrap_or(&self.comm.schedules);
        if let Some(schedule) = cache.get(&key) {
            return Ok(schedule);
        }
        let mut schedule = generate_on(call.kind, algorithm, rank, key.world, count, key.elem, layout)
            .map_err(|source| CollectiveError::Algorithm { rank, op, source })?;
        schedule.algorithm = algorithm.name();
        tracing::trace!(rank, op, seq, %algorithm, steps = schedule.steps.len(), "collective");
        let schedule = Arc::new(schedule);
        if schedule.steps.len() <= CACHED_STEPS {
            cache.keep(key, schedule.clone());
        }
        Ok(schedule)
    }

    /// What is wrong with this rank's own call, found before anything is sent.
    pub(super) fn bad_call<T: Element>(&self, call: &CollCall) -> Option<String> {
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
    pub(super) fn segment_len<T: Element>(&self, kind: Collective, count: usize) -> Option<usize> {
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
    pub(super) async fn collective_staged<B: RecvBuf + ?Sized>(
        &self,
        kind: Collective,
        op: Option<ReduceOp>,
        buf: &mut B,
    ) -> Result<(), CollectiveError> {
        #[cfg(feature = "nccl")]
        if let Some(done) = self.try_nccl(kind, op, buf).await {
            return self.reported(kind.name(), done);
        }
        let done = self.staged(kind, op, buf).await;
        self.reported(kind.name(), done)
    }

    /// [`collective_staged`](Self::collective_staged) on nexar's own links, never NCCL.
    pub(in crate::comm) async fn staged<B: RecvBuf + ?Sized>(
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
    pub(super) async fn exchange_staged<S, R>(&self, x: Exchange, send: &S, recv: &mut R) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        let op = self.plan_exchange(x, 0, 0).0.kind.name();
        let done = self.exchange_routed(x, send, recv).await;
        self.reported(op, done)
    }

    /// [`exchange_staged`](Self::exchange_staged) on NCCL where it takes the call, else on
    /// nexar's own links.
    async fn exchange_routed<S, R>(&self, x: Exchange, send: &S, recv: &mut R) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        #[cfg(feature = "nccl")]
        {
            let kind = match x {
                Exchange::AllGather => Some((Collective::AllGather, None)),
                Exchange::ReduceScatter(op) => Some((Collective::ReduceScatter, Some(op))),
                _ => None,
            };
            if let Some((kind, op)) = kind
                && let Some(done) = self.try_nccl_exchange(kind, op, send, recv).await
            {
                return done;
            }
        }
        self.exchange_host(x, send, recv).await
    }

    /// [`exchange_staged`](Self::exchange_staged) on nexar's own links, never NCCL.
    pub(in crate::comm) async fn exchange_host<S, R>(
        &self,
        x: Exchange,
        send: &S,
        recv: &mut R,
    ) -> Result<(), CollectiveError>
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
    pub(super) async fn fail_device(&self, call: CollCall, source: DeviceError) -> CollectiveError {
        self.fail_device_seq(self.comm.next_seq(), call, source).await
    }

    pub(in crate::comm) async fn collective<T: Element>(
        &self,
        call: CollCall,
        data: &mut [T],
        input: &[T],
    ) -> Result<(), CollectiveError> {
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
    pub(super) async fn run_segmented<B: RecvBuf + ?Sized>(
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
    pub(super) async fn fail_device_seq(&self, seq: u64, call: CollCall, source: DeviceError) -> CollectiveError {
        let _ = self.fail_seq(seq, call, source.to_string()).await;
        CollectiveError::Device { rank: self.rank(), op: call.kind.name(), source }
    }

    pub(super) fn call(kind: Collective, op: Option<ReduceOp>, count: usize) -> CollCall {
        CollCall::whole(kind, op, count as u64, 0)
    }

    pub(super) fn blocks(&self, block: usize) -> Option<usize> {
        block.checked_mul(self.world_size())
    }

    /// The call a two-buffer collective makes, and what is wrong with this rank's buffer
    /// lengths, if anything.
    pub(super) fn plan_exchange(&self, x: Exchange, send: usize, recv: usize) -> (CollCall, Option<String>) {
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
}
