//! The executor: the only code that moves user bytes in a collective. It runs one rank's
//! schedule over the links, checks every incoming header against its own call, and turns any
//! disagreement, timeout or cancellation into an abort that reaches every rank.

pub(in crate::comm) mod host_peers;
pub(in crate::comm) mod pieces;
pub(crate) mod spin;
pub(in crate::comm) mod wire_codec;

use std::time::Instant;

use nexar_types::{Element, ReduceOp};
use tracing::Instrument;

use crate::comm::client::NexarClient;
use crate::comm::collective::CollectiveError;
use crate::comm::exec::pieces::{Data, Parts};
use crate::comm::exec::wire_codec::WireCodec;
use crate::comm::matcher::{Key, Refusal};
use crate::proto::algo::{Collective, name_of_code};
use crate::proto::message::{CollHeader, PeerMsg};
use crate::proto::schedule::{Schedule, Slot, Span, Step};
use crate::trace::{OpClass, OpDesc, OpTrace, StalledOp};
use crate::transport::TransportError;
use crate::transport::bulk::{Awaited, Awaiting};
use crate::transport::framed::BlockError;
use crate::transport::link::SendDone;
use crate::transport::pool::pooled_gather;

/// One collective call as this rank made it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CollCall {
    pub kind: Collective,
    pub op: Option<ReduceOp>,
    /// Elements this run works on: the count the caller passed (buffer length, or block size
    /// for block operations), or one segment of it.
    pub count: u64,
    /// The count the caller passed, which every rank must agree on (equal to `count` unless
    /// the call is split into segments).
    pub total: u64,
    pub fingerprint: u64,
    /// Elements per segment when the call is split (0 when it runs whole).
    pub segment: u64,
    /// Which segment of the call this run is (0 when not split).
    pub part: u32,
}

impl CollCall {
    /// A call run whole, not split into segments.
    pub fn whole(kind: Collective, op: Option<ReduceOp>, count: u64, fingerprint: u64) -> Self {
        CollCall { kind, op, count, total: count, fingerprint, segment: 0, part: 0 }
    }

    fn header<T: Element>(&self) -> CollHeader {
        CollHeader {
            kind: self.kind.code(),
            op: self.op.map_or(0, ReduceOp::to_wire),
            dtype: T::DTYPE.to_wire(),
            root: self.kind.root().unwrap_or(0) as u32,
            count: self.total,
            fingerprint: self.fingerprint,
            segment: self.segment,
        }
    }
}

/// The fingerprint of the allreduce by which the ranks agree to run a device collective on NCCL
/// (`comm/backends/nccl.rs`): a rank that passed host memory to the same call meets it instead of its
/// own collective, and the disagreement says so.
pub(crate) const AGREEMENT: u64 = 0x6e63_636c_2061_736b;

/// Describes how `theirs` differs from `ours`, field by field, in the words of the user's call.
pub(super) fn disagreement(ours: &CollHeader, theirs: &CollHeader, me: usize, peer: usize) -> String {
    let op_name = |c: u8| ReduceOp::from_wire(c).map_or("none", ReduceOp::name);
    let dtype_name = |c: u8| nexar_types::DType::from_wire(c).map_or("unknown", |d| d.name());
    if (ours.fingerprint == AGREEMENT) != (theirs.fingerprint == AGREEMENT) {
        let (device, host) = if ours.fingerprint == AGREEMENT { (me, peer) } else { (peer, me) };
        format!(
            "rank {device} passed device memory (its call first asks every rank whether NCCL can \
             run it) while rank {host} passed host memory or made another call: with the feature \
             `nccl`, one collective takes device memory on every rank or on none"
        )
    } else if ours.kind != theirs.kind {
        format!("rank {peer} called {} while rank {me} called {}", name_of_code(theirs.kind), name_of_code(ours.kind))
    } else if ours.count != theirs.count {
        format!("rank {peer} passed {} elements, rank {me} passed {}", theirs.count, ours.count)
    } else if ours.dtype != theirs.dtype {
        format!("rank {peer} passed {} elements, rank {me} passed {}", dtype_name(theirs.dtype), dtype_name(ours.dtype))
    } else if ours.op != theirs.op {
        format!("rank {peer} reduces with {}, rank {me} with {}", op_name(theirs.op), op_name(ours.op))
    } else if ours.root != theirs.root {
        format!("rank {peer} named root {}, rank {me} named root {}", theirs.root, ours.root)
    } else if ours.segment != theirs.segment {
        let split = |n: u64| {
            if n == 0 { "runs it whole".to_string() } else { format!("splits it into segments of {n} elements") }
        };
        format!(
            "rank {peer} {}, rank {me} {} (NEXAR_SEGMENT_BYTES differs)",
            split(theirs.segment),
            split(ours.segment)
        )
    } else {
        format!("rank {peer} runs plan {:#018x}, rank {me} runs plan {:#018x}", theirs.fingerprint, ours.fingerprint)
    }
}

fn view<'a, T>(span: Span, data: &'a [T], input: &'a [T], scratch: &'a [T]) -> Option<&'a [T]> {
    let buf = match span.slot {
        Slot::Data => data,
        Slot::Input => input,
        Slot::Scratch => scratch,
    };
    buf.get(span.offset..span.end())
}

fn view_mut<'a, T>(span: Span, data: &'a mut [T], scratch: &'a mut [T]) -> Option<&'a mut [T]> {
    let buf = match span.slot {
        Slot::Data => data,
        Slot::Scratch => scratch,
        Slot::Input => return None,
    };
    buf.get_mut(span.offset..span.end())
}

/// `(src, dst)` for a local step, including two disjoint spans of the same buffer.
fn local_pair<'a, T>(
    src: Span,
    dst: Span,
    data: &'a mut [T],
    input: &'a [T],
    scratch: &'a mut [T],
) -> Option<(&'a [T], &'a mut [T])> {
    if src.slot != dst.slot || src.slot == Slot::Input {
        return match (src.slot, dst.slot) {
            (Slot::Input, _) => Some((input.get(src.offset..src.end())?, view_mut(dst, data, scratch)?)),
            (Slot::Data, Slot::Scratch) => {
                Some((data.get(src.offset..src.end())?, scratch.get_mut(dst.offset..dst.end())?))
            }
            (Slot::Scratch, Slot::Data) => {
                Some((scratch.get(src.offset..src.end())?, data.get_mut(dst.offset..dst.end())?))
            }
            _ => None,
        };
    }
    let buf = if src.slot == Slot::Data { data } else { scratch };
    if src.end() <= dst.offset {
        let (lo, hi) = buf.split_at_mut(dst.offset);
        Some((lo.get(src.offset..src.end())?, hi.get_mut(..dst.len)?))
    } else if dst.end() <= src.offset {
        let (lo, hi) = buf.split_at_mut(src.offset);
        Some((hi.get(..src.len)?, lo.get_mut(dst.offset..dst.end())?))
    } else {
        None
    }
}

/// Where a received payload goes: consecutive slices, filled (or reduced into) in order.
struct Accumulator<'p, 'd, T> {
    parts: &'p mut [&'d mut [T]],
    part: usize,
    at: usize,
}

impl<T: Element> Accumulator<'_, '_, T> {
    /// Applies `f` to the next elements and `block`, piece by piece where the slices end.
    fn apply<W>(
        &mut self,
        mut block: &[W],
        mut f: impl FnMut(&mut [T], &[W]) -> Result<(), nexar_types::ReduceError>,
    ) -> Result<(), nexar_types::ReduceError> {
        while !block.is_empty() {
            let Some(part) = self.parts.get_mut(self.part) else {
                // More elements than the span holds: the router checked lengths, so not reached.
                return Err(nexar_types::ReduceError::LengthMismatch { left: 0, right: block.len() });
            };
            let n = (part.len() - self.at).min(block.len());
            f(&mut part[self.at..self.at + n], &block[..n])?;
            (self.at, block) = (self.at + n, &block[n..]);
            if self.at == part.len() {
                (self.part, self.at) = (self.part + 1, 0);
            }
        }
        Ok(())
    }
}

/// What a wait inside one collective needs: its flight-recorder entry (none for a
/// confirmation round made outside a call: by a task, a plan's end, `shutdown`), its deadline,
/// and what the stall inspector says of it.
pub(super) struct Watch<'t, 'r> {
    pub trace: Option<&'t OpTrace<'r>>,
    pub comm: u64,
    pub seq: u64,
    pub call: CollCall,
    pub dtype: nexar_types::DType,
    pub deadline: Instant,
    /// Whether a receive may spin before it parks (not in a task of nexar's own).
    pub spin: bool,
}

impl Watch<'_, '_> {
    fn stalled(&self, waiting_for: usize, waited: std::time::Duration) -> StalledOp {
        StalledOp {
            comm: self.comm,
            seq: self.seq,
            kind: self.call.kind.code(),
            dtype: self.dtype,
            count: self.call.total,
            root: self.call.kind.root().map(|r| r as u32),
            waited,
            waiting_for,
        }
    }
}

/// Sends an abort for collective `seq` to every other member, and drops its stale messages here.
pub(crate) async fn broadcast_abort(client: &NexarClient, seq: u64, reason: &str) {
    client.inner.coll.abort(client.comm.id, seq, reason);
    let msg = PeerMsg::Abort { comm: client.comm.id, seq, reason: reason.to_string() };
    for peer in (0..client.world_size()).filter(|p| *p != client.rank()) {
        if let Some(link) = client.link(peer) {
            let _ = link.send_queued(&msg, None).await;
        }
    }
}

/// Aborts the collective if its future is dropped before it finished, so no peer waits for a
/// rank that has gone.
/// (It borrows the client, and clones it only for the abort: a collective that finishes pays
/// no reference count.)
pub(super) struct AbortOnDrop<'c> {
    pub client: Option<&'c NexarClient>,
    pub seq: u64,
    pub op: &'static str,
}

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(client) = self.client.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let client = client.clone();
            let reason = format!("rank {} cancelled {}", client.rank(), self.op);
            let seq = self.seq;
            rt.spawn(async move { broadcast_abort(&client, seq, &reason).await });
        }
    }
}

impl NexarClient {
    /// Runs `schedule` as collective number `seq` of this communicator. `data` is written,
    /// `input` only read. The schedule counts elements, which `data` holds as `T` and
    /// messages carry as `C::Wire` ([`AsIs`](crate::comm::exec::wire_codec::AsIs): as they are). On any
    /// failure every other rank in the collective is told to stop.
    pub(super) async fn execute<T: Element, C: WireCodec<T>>(
        &self,
        seq: u64,
        call: CollCall,
        schedule: &Schedule,
        data: &mut Data<'_, T>,
        input: &[T],
    ) -> Result<(), CollectiveError> {
        let mut guard = AbortOnDrop { client: Some(self), seq, op: call.kind.name() };
        let began = Instant::now();
        let trace = self.inner.trace.recorder.start_at(
            OpDesc {
                class: OpClass::Collective,
                comm: self.comm.id,
                seq,
                op: call.kind.name(),
                kind: call.kind.code(),
                dtype: Some(C::Wire::DTYPE),
                count: call.total,
                root: call.kind.root().map(|r| r as u32),
                peer: None,
                algorithm: schedule.algorithm,
                bytes: call.count.saturating_mul(size_of::<C::Wire>() as u64),
            },
            began,
        );
        let span = tracing::debug_span!(
            "collective",
            comm = self.comm.id,
            op = call.kind.name(),
            seq,
            bytes = call.count.saturating_mul(size_of::<C::Wire>() as u64),
            dtype = C::Wire::DTYPE.name(),
            algorithm = schedule.algorithm,
            part = call.part,
        );
        let watch = Watch {
            trace: Some(&trace),
            comm: self.comm.id,
            seq,
            call,
            dtype: C::Wire::DTYPE,
            deadline: began + self.config().op_timeout,
            spin: true,
        };
        // Dropped here, the guard aborts the collective for every rank, as anywhere in it.
        crate::sync::take_a_turn().await;
        let mut result = self.run_steps::<T, C>(&watch, schedule, data, input).instrument(span.clone()).await;
        // A rooted collective is confirmed behind it (`comm/collective/confirm.rs`): its first
        // confirmations go now, the rest of the round at the next call.
        let mut own = None;
        if result.is_ok() && call.kind.needs_confirmation() {
            match self.begin_confirmation(seq, call, call.header::<C::Wire>(), C::Wire::DTYPE, schedule).await {
                Ok(round) => own = round,
                Err(e) => result = Err(e),
            }
        }
        // This call's work is done: the rooted collectives before it are confirmed now (a
        // failure among them is kept for the user's call to report).
        if result.is_ok() {
            self.settle_confirmations(Some(&trace), own).instrument(span).await;
        }
        guard.client = None;
        trace.end(&result);
        if let Err(e) = &result
            && e.involves_peers()
        {
            self.inner.trace.dump_after_failure(&e.to_string());
        }
        if let Err(e) = &result
            && e.is_local_origin()
        {
            broadcast_abort(self, seq, &e.to_string()).await;
        }
        result
    }

    /// Takes a sequence number and tells every peer this collective failed before it started
    /// (a bad argument on this rank), so they fail at once instead of waiting.
    pub(super) async fn fail_early(&self, call: CollCall, reason: String) -> CollectiveError {
        let seq = self.comm.next_seq();
        self.fail_seq(seq, call, reason).await
    }

    /// Fails collective `seq` on this rank with `reason` and tells every peer.
    pub(crate) async fn fail_seq(&self, seq: u64, call: CollCall, reason: String) -> CollectiveError {
        let err = CollectiveError::InvalidArgument { rank: self.rank(), op: call.kind.name(), reason };
        broadcast_abort(self, seq, &err.to_string()).await;
        err
    }

    async fn run_steps<T: Element, C: WireCodec<T>>(
        &self,
        watch: &Watch<'_, '_>,
        schedule: &Schedule,
        data: &mut Data<'_, T>,
        input: &[T],
    ) -> Result<(), CollectiveError> {
        let (seq, call) = (watch.seq, watch.call);
        let (rank, op) = (self.rank(), call.kind.name());
        let header = call.header::<C::Wire>();
        let reduction = call.op.unwrap_or(ReduceOp::Sum);
        let limit = self.config().op_timeout;
        let internal = |what: &str| CollectiveError::Internal { rank, op, what: what.to_string() };
        let pool = &self.inner.pool;
        let mut scratch_loan = pool.lend(schedule.scratch_len * size_of::<T>());
        let scratch: &mut [T] = scratch_loan.slice_mut(schedule.scratch_len);
        // Sends still under way (or failed), checked once the steps are done.
        let mut sends: Vec<(usize, SendDone)> = Vec::new();
        for step in &schedule.steps {
            match *step {
                Step::Send { to, src } => {
                    let out_of_bounds = || internal("send span out of bounds");
                    let elems = match (src.slot, &*data) {
                        (Slot::Data, Data::Pieces(p)) => Parts::Many(p.read(src).ok_or_else(out_of_bounds)?),
                        _ => Parts::One([view(src, data.flat(), input, scratch).ok_or_else(out_of_bounds)?]),
                    };
                    // Converted elements go from a buffer the sender reads at once (in cache).
                    let mut encoded = (!C::AS_IS).then(|| pool.lend(src.len * size_of::<C::Wire>()));
                    let parts = match &mut encoded {
                        None => match elems {
                            Parts::Many(p) => Parts::Many(p.into_iter().map(bytemuck::cast_slice).collect()),
                            Parts::One([p]) => Parts::One([bytemuck::cast_slice(p)]),
                        },
                        Some(loan) => {
                            let wire: &mut [C::Wire] = loan.slice_mut(src.len);
                            let mut at = 0;
                            for p in elems.as_slice() {
                                C::encode(p, &mut wire[at..at + p.len()]);
                                at += p.len();
                            }
                            Parts::One([bytemuck::cast_slice(&*wire)])
                        }
                    };
                    let msg = PeerMsg::Coll { comm: self.comm.id, seq, header, part: call.part, len: src.len as u64 };
                    let link = self.link(to).ok_or(CollectiveError::Closed { rank, op })?;
                    let transport = |source| CollectiveError::Transport { rank, op, peer: to, source };
                    // A bulk channel that encrypts as it reads takes the payload without a copy.
                    let done = match link.send_borrowed(&msg, parts.as_slice()).await {
                        Some(done) => done.map_err(transport)?,
                        None => {
                            let payload = pooled_gather(pool, parts.as_slice());
                            SendDone::Later(link.send_queued(&msg, Some(payload)).await.map_err(transport)?)
                        }
                    };
                    if !matches!(done, SendDone::Now(Ok(()))) {
                        sends.push((to, done));
                    }
                }
                Step::Recv { from, dst, reduce } => {
                    let key =
                        Key { comm: self.comm.id, src: self.comm.members[from] as u32, tag: seq, part: call.part };
                    let out_of_bounds = || internal("receive span out of bounds");
                    let mut out = match (dst.slot, &mut *data) {
                        (Slot::Data, Data::Pieces(p)) => Parts::Many(p.write(dst).ok_or_else(out_of_bounds)?),
                        (_, data) => Parts::One([view_mut(dst, data.flat_mut(), scratch).ok_or_else(out_of_bounds)?]),
                    };
                    // A payload copied as it is may be read straight into its place.
                    let into = match &mut out {
                        Parts::One([out]) if !reduce && C::AS_IS => Some(bytemuck::cast_slice_mut::<T, u8>(out)),
                        _ => None,
                    };
                    let held = self.take_coll(key, from, dst.len * size_of::<C::Wire>(), op, watch, into).await?;
                    let theirs = held.check.ok_or_else(|| internal("collective message without a header"))?;
                    if theirs != header {
                        return Err(CollectiveError::Mismatch {
                            rank,
                            op,
                            peer: from,
                            what: disagreement(&header, &theirs, rank, from),
                        });
                    }
                    if held.dtype != C::Wire::DTYPE || held.count != dst.len as u64 {
                        return Err(CollectiveError::Mismatch {
                            rank,
                            op,
                            peer: from,
                            what: format!(
                                "rank {from} sent {} elements where rank {rank} expected {}",
                                held.count, dst.len
                            ),
                        });
                    }
                    let unreadable = |error| CollectiveError::Transport {
                        rank,
                        op,
                        peer: from,
                        source: TransportError::Payload { peer: format!("rank {from}"), error },
                    };
                    let by_block = |e| match e {
                        BlockError::Visit(source) => CollectiveError::Reduce { rank, op, source },
                        BlockError::Payload(error) => unreadable(error),
                    };
                    if reduce {
                        let mut acc = Accumulator { parts: out.as_mut_slice(), part: 0, at: 0 };
                        held.payload
                            .for_each_block::<C::Wire, _>(|block| {
                                acc.apply(block, |to, from| C::reduce_received(reduction, to, from))
                            })
                            .map_err(by_block)?;
                    } else if !C::AS_IS {
                        // Decoded a block at a time, straight from the opened record.
                        let mut to = Accumulator { parts: out.as_mut_slice(), part: 0, at: 0 };
                        held.payload
                            .for_each_block::<C::Wire, _>(|block| {
                                to.apply(block, |to, from| {
                                    C::decode(from, to);
                                    Ok(())
                                })
                            })
                            .map_err(by_block)?;
                    } else {
                        match &mut out {
                            Parts::One([out]) => held.payload.copy_to(bytemuck::cast_slice_mut(out)),
                            Parts::Many(outs) => {
                                let mut bytes: Vec<&mut [u8]> =
                                    outs.iter_mut().map(|o| bytemuck::cast_slice_mut::<T, u8>(o)).collect();
                                held.payload.copy_to_parts(&mut bytes)
                            }
                        }
                        .map_err(unreadable)?;
                    }
                }
                Step::Copy { src, dst } => {
                    let (from, to) =
                        local_pair(src, dst, data.flat_mut(), input, scratch).ok_or_else(|| internal("copy spans"))?;
                    to.copy_from_slice(from);
                }
                Step::Reduce { src, dst } => {
                    let (from, to) = local_pair(src, dst, data.flat_mut(), input, scratch)
                        .ok_or_else(|| internal("reduce spans"))?;
                    C::reduce_local(reduction, to, from).map_err(|source| CollectiveError::Reduce {
                        rank,
                        op,
                        source,
                    })?;
                }
            }
        }
        drop(scratch_loan);
        for (peer, done) in sends {
            let world_peer = self.comm.members[peer];
            let sent = match done {
                SendDone::Now(result) => Ok(Ok(result)),
                SendDone::Later(done) => self.wait_in(done, world_peer, watch).await,
            };
            match sent {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(source))) => {
                    return Err(CollectiveError::Transport { rank, op, peer, source });
                }
                Ok(Err(_)) => return Err(CollectiveError::Closed { rank, op }),
                Err(report) => {
                    return Err(CollectiveError::Timeout { rank, op, peer, after: limit, report });
                }
            }
        }
        Ok(())
    }

    /// Why the mailbox refused a receive of `op` from `from`, as the collective's error.
    pub(super) fn refused(&self, refusal: Refusal, op: &'static str, from: usize) -> CollectiveError {
        let rank = self.rank();
        match refusal {
            Refusal::Aborted(reason) => CollectiveError::Aborted { rank, op, reason },
            Refusal::SourceGone(reason) => CollectiveError::PeerGone { rank, op, peer: from, reason },
            Refusal::LinkFailed(reason) => CollectiveError::LinkFailed { rank, op, reason },
            Refusal::Closed => CollectiveError::Closed { rank, op },
            Refusal::Full { held, .. } => CollectiveError::Internal {
                rank,
                op,
                what: format!("{held} collective messages are held unread; a peer is running away"),
            },
        }
    }

    /// Waits for `fut`, a step of the collective `watch` describes that rank `peer` (of the
    /// world) must make possible: in its flight-recorder entry, until its deadline.
    async fn wait_in<F: Future>(&self, fut: F, peer: usize, watch: &Watch<'_, '_>) -> Result<F::Output, String> {
        let stalled = |waited| watch.stalled(peer, waited);
        match watch.trace {
            Some(trace) => self.wait_on_peer(fut, peer, trace, watch.deadline, stalled).await,
            None => self.wait_watched(fut, watch.deadline, stalled).await,
        }
    }

    pub(super) async fn take_coll(
        &self,
        key: Key,
        from: usize,
        bytes: usize,
        op: &'static str,
        watch: &Watch<'_, '_>,
        into: Option<&mut [u8]>,
    ) -> Result<crate::comm::matcher::Held, CollectiveError> {
        let rank = self.rank();
        let refused = |r: Refusal| self.refused(r, op, from);
        // A message that comes through another transport's threads is not worth a core.
        let link = self.inner.links.get(key.src as usize);
        let other_transport = link.is_some_and(|l| l.bulk_takes_on_thread(bytes));
        let spin = if other_transport || !watch.spin { None } else { Some(&self.inner.spin) };
        // The message itself comes straight back where the link's channel has it whole.
        let awaited = Awaited::Collective { comm: key.comm, seq: key.tag, part: key.part };
        let read_link = |awaiting: Option<Awaiting<'_>>| link.and_then(|l| l.bulk_deliver_ready(awaiting));
        let lent = spin.is_some() && into.is_some();
        if let Some(held) =
            crate::comm::exec::spin::spin_take(&self.inner.coll, key, spin, Some(awaited), into, read_link)
                .await
                .map_err(refused)?
        {
            return Ok(held);
        }
        if lent && let Some(link) = link {
            // Its payload, if it was arriving into `into`, goes on without it.
            link.bulk_receive_parks();
        }
        let pending = match self.inner.coll.take_or_wait_for(key, bytes as u64).map_err(refused)? {
            Ok(held) => return Ok(held),
            Err(pending) => pending,
        };
        let world_peer = key.src as usize;
        let waited = self.wait_in(pending.wait(), world_peer, watch).await;
        match waited {
            Ok(Ok(held)) => Ok(held),
            Ok(Err(r)) => Err(refused(r)),
            Err(report) => {
                Err(CollectiveError::Timeout { rank, op, peer: from, after: self.config().op_timeout, report })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(count: u64, fingerprint: u64) -> CollHeader {
        CollHeader { kind: 1, op: 0, dtype: 0, root: 0, count, fingerprint, segment: 0 }
    }

    #[test]
    fn a_host_call_against_the_nccl_agreement_is_named_as_such() {
        let (agreement, host) = (header(7, AGREEMENT), header(64, 0));
        for (ours, theirs, me, peer) in [(&agreement, &host, 0, 1), (&host, &agreement, 1, 0)] {
            let what = disagreement(ours, theirs, me, peer);
            assert!(what.contains("rank 0 passed device memory"), "{what}");
            assert!(what.contains("rank 1 passed host memory"), "{what}");
        }
        // Otherwise the fields, in the words of the user's call.
        assert_eq!(disagreement(&header(7, 0), &host, 0, 1), "rank 1 passed 64 elements, rank 0 passed 7");
    }
}
