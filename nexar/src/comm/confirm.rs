//! The confirmation of the rooted collectives, run behind them.
//!
//! A broadcast, reduce, gather, scatter or scan can finish on a rank that heard from none of
//! the others (a broadcast's root only sends). So that a disagreement one rank finds reaches
//! every rank, such a call is confirmed by a dissemination round of empty messages, in which
//! each rank hears, through the others, from every other
//! ([`Collective::needs_confirmation`](crate::proto::algo::Collective::needs_confirmation)).
//!
//! That round used to end the call, so a root could not start its next call before its
//! receivers had finished this one, and the two sides worked in turn: half of a small
//! broadcast's time (docs/PERFORMANCE.md, "A rooted collective's confirmation round"). Now a
//! rank sends its first confirmations as soon as the call's work is done here and returns;
//! the rest of the round runs when its next collective on the communicator has done its own
//! work (and, without waiting, as that call starts). A rank is so at most one collective ahead
//! of the others, and the confirmations in flight are bounded. A failure of the earlier call
//! elsewhere (another rank's abort, a rank gone) is kept, and the user's call that collected
//! it returns [`CollectiveError::EarlierFailed`] once its own work is done: one error per rank
//! for one failure, at the call or at the next. `barrier()` collects every confirmation, and
//! `shutdown()` collects them too and logs what failed.

use std::collections::VecDeque;
use std::time::Instant;

use nexar_types::DType;

use super::client::NexarClient;
use super::collective::CollectiveError;
use super::exec::{AbortOnDrop, CollCall, Watch, broadcast_abort, disagreement};
use crate::comm::matcher::{Held, Key};
use crate::proto::algo::barrier::append_dissemination;
use crate::proto::message::{CollHeader, PeerMsg};
use crate::proto::schedule::{Schedule, Step};
use crate::trace::OpTrace;
use crate::transport::link::SendDone;
use crate::transport::pool::pooled_gather;

/// One step of a confirmation round, with the communicator rank it goes to or comes from.
#[derive(Clone, Copy, Debug)]
enum Round {
    Send(usize),
    Recv(usize),
}

/// A rooted collective that finished here and is not yet confirmed by every rank.
#[derive(Debug)]
pub(super) struct Confirmation {
    seq: u64,
    call: CollCall,
    /// The call's header, which its confirmations carry.
    header: CollHeader,
    dtype: DType,
    /// The round's steps not yet made.
    left: VecDeque<Round>,
    /// A failure found while the round was advanced without waiting, reported when it is
    /// collected.
    failed: Option<CollectiveError>,
}

/// A failure of an earlier call, kept until the user's next collective call reports it.
#[derive(Debug)]
struct Failed {
    earlier: &'static str,
    seq: u64,
    source: CollectiveError,
}

/// A communicator's rooted collectives that are not yet confirmed, oldest first, and a failure
/// of one that no call has reported yet.
#[derive(Default)]
pub(crate) struct Unconfirmed {
    /// Held across the waits of a round (an async lock): a call that collects waits for one
    /// that is collecting, and so returns only once everything before it is confirmed.
    open: tokio::sync::Mutex<VecDeque<Confirmation>>,
    failed: std::sync::Mutex<Option<Failed>>,
}

impl std::fmt::Debug for Unconfirmed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unconfirmed").finish_non_exhaustive()
    }
}

impl Unconfirmed {
    fn keep(&self, failed: Failed) {
        let mut slot = self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // The oldest failure says most (those after it are often its consequences).
        slot.get_or_insert(failed);
    }

    fn take_failed(&self) -> Option<Failed> {
        self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }
}

impl NexarClient {
    /// Rooted collective `seq`, whose work is done here: sends this rank's first
    /// confirmations now, and returns the rest of the round (if any) for
    /// [`settle_confirmations`](Self::settle_confirmations) to keep open.
    pub(super) async fn begin_confirmation(
        &self,
        seq: u64,
        call: CollCall,
        header: CollHeader,
        dtype: DType,
    ) -> Result<Option<Confirmation>, CollectiveError> {
        let mut round = Schedule::new();
        append_dissemination(&mut round, self.rank(), self.world_size());
        let left = round
            .steps
            .iter()
            .filter_map(|step| match *step {
                Step::Send { to, .. } => Some(Round::Send(to)),
                Step::Recv { from, .. } => Some(Round::Recv(from)),
                _ => None,
            })
            .collect();
        let mut confirmation = Confirmation { seq, call, header, dtype, left, failed: None };
        self.advance(&mut confirmation, None).await?;
        Ok((!confirmation.left.is_empty()).then_some(confirmation))
    }

    /// Makes the steps of the open rounds that need no waiting: sends, and receives whose
    /// message is here. Skipped while another call of this rank is collecting them.
    pub(super) async fn advance_confirmations(&self) {
        let Ok(mut open) = self.comm.unconfirmed.open.try_lock() else { return };
        for confirmation in open.iter_mut().filter(|c| c.failed.is_none()) {
            if let Err(e) = self.advance(confirmation, None).await {
                confirmation.failed = Some(e);
            }
        }
    }

    /// Collects the open rounds, oldest first, waiting as a collective step waits (the
    /// deadline is `op_timeout`, the stall inspector reports), then keeps `own` (the calling
    /// collective's round) open for the next call. A round that fails is kept for the user's
    /// call to report ([`reported`](Self::reported)), and the rest stay open. `trace` is the
    /// collecting call's flight-recorder entry.
    pub(super) async fn settle_confirmations(&self, trace: Option<&OpTrace<'_>>, own: Option<Confirmation>) {
        let mut open = self.comm.unconfirmed.open.lock().await;
        let older = open.len();
        open.extend(own);
        for _ in 0..older {
            let Some(mut confirmation) = open.pop_front() else { break };
            let (seq, call) = (confirmation.seq, confirmation.call);
            // Dropped while it waits, this rank would never send the rest of the round.
            let mut guard = AbortOnDrop { client: Some(self), seq, op: call.kind.name() };
            let watch = Watch {
                trace,
                comm: self.comm.id,
                seq,
                call,
                dtype: confirmation.dtype,
                deadline: Instant::now() + self.config().op_timeout,
            };
            let done = match confirmation.failed.take() {
                Some(e) => Err(e),
                None => self.advance(&mut confirmation, Some(&watch)).await,
            };
            guard.client = None;
            if let Err(source) = done {
                tracing::debug!(rank = self.rank(), seq, op = call.kind.name(), error = %source, "confirmation failed");
                if source.is_local_origin() {
                    broadcast_abort(self, seq, &source.to_string()).await;
                }
                self.comm.unconfirmed.keep(Failed { earlier: call.kind.name(), seq, source });
                return;
            }
        }
    }

    /// Collects every open round, outside any call (the end of a plan's run, shutdown).
    pub(crate) async fn confirm_all(&self) {
        self.settle_confirmations(None, None).await;
    }

    /// `result` of the user's call `op`, or, when it succeeded and an earlier rooted
    /// collective was found failed meanwhile, that failure
    /// ([`CollectiveError::EarlierFailed`]).
    pub(crate) fn reported<T>(
        &self,
        op: &'static str,
        result: Result<T, CollectiveError>,
    ) -> Result<T, CollectiveError> {
        let value = result?;
        match self.comm.unconfirmed.take_failed() {
            None => Ok(value),
            Some(Failed { earlier, seq, source }) => {
                Err(CollectiveError::EarlierFailed { rank: self.rank(), op, earlier, seq, source: Box::new(source) })
            }
        }
    }

    /// At shutdown: collects the open rounds (the peers do the same) and logs a failure no
    /// call has reported.
    pub(super) async fn settle_before_leaving(&self, limit: std::time::Duration) {
        if tokio::time::timeout(limit, self.confirm_all()).await.is_err() {
            tracing::warn!(
                rank = self.rank(),
                "shutdown: the last rooted collectives were not confirmed within {limit:?}"
            );
        }
        if let Some(Failed { earlier, seq, source }) = self.comm.unconfirmed.take_failed() {
            tracing::error!(
                rank = self.rank(),
                "shutdown: {earlier} (#{seq}), which this rank had finished, failed: {source}"
            );
        }
    }

    /// Makes `confirmation`'s next steps: all of them, waiting as `watch` says, or without
    /// `watch` only those that need no waiting.
    async fn advance(
        &self,
        confirmation: &mut Confirmation,
        watch: Option<&Watch<'_, '_>>,
    ) -> Result<(), CollectiveError> {
        while let Some(&step) = confirmation.left.front() {
            match step {
                Round::Send(to) => self.send_confirmation(confirmation, to).await?,
                Round::Recv(from) => {
                    let key = Key {
                        comm: self.comm.id,
                        src: self.comm.members[from] as u32,
                        tag: confirmation.seq,
                        part: confirmation.call.part,
                    };
                    let op = confirmation.call.kind.name();
                    let held = match watch {
                        Some(watch) => self.take_coll(key, from, 0, op, watch, None).await?,
                        None => match self.inner.coll.try_take(key) {
                            Ok(Some(held)) => held,
                            Ok(None) => return Ok(()),
                            Err(refusal) => return Err(self.refused(refusal, op, from)),
                        },
                    };
                    self.check_confirmation(confirmation, from, &held)?;
                }
            }
            confirmation.left.pop_front();
        }
        Ok(())
    }

    /// An empty message of collective `confirmation` to `to`, sent as the executor sends (so
    /// on the same channel as the call's data, behind it).
    async fn send_confirmation(&self, confirmation: &Confirmation, to: usize) -> Result<(), CollectiveError> {
        let (rank, op) = (self.rank(), confirmation.call.kind.name());
        let msg = PeerMsg::Coll {
            comm: self.comm.id,
            seq: confirmation.seq,
            header: confirmation.header,
            part: confirmation.call.part,
            len: 0,
        };
        let link = self.link(to).ok_or(CollectiveError::Closed { rank, op })?;
        let transport = |source| CollectiveError::Transport { rank, op, peer: to, source };
        let empty: [&[u8]; 1] = [&[]];
        // Not waited for: a confirmation that never arrives shows at the peer, which names
        // this rank.
        match link.send_borrowed(&msg, &empty).await {
            Some(done) => match done.map_err(transport)? {
                SendDone::Now(Err(source)) => Err(transport(source)),
                SendDone::Now(Ok(())) | SendDone::Later(_) => Ok(()),
            },
            None => {
                link.send_queued(&msg, Some(pooled_gather(&self.inner.pool, &empty))).await.map_err(transport)?;
                Ok(())
            }
        }
    }

    /// A confirmation from `from` must carry the call's header and nothing else.
    fn check_confirmation(&self, confirmation: &Confirmation, from: usize, held: &Held) -> Result<(), CollectiveError> {
        let (rank, op) = (self.rank(), confirmation.call.kind.name());
        let what = match held.check {
            None => "its confirmation came without a header".to_string(),
            Some(theirs) if theirs != confirmation.header => disagreement(&confirmation.header, &theirs, rank, from),
            Some(_) if held.count != 0 => {
                format!("rank {from} sent {} elements where rank {rank} expected its confirmation (none)", held.count)
            }
            Some(_) => return Ok(()),
        };
        Err(CollectiveError::Mismatch { rank, op, peer: from, what })
    }
}
