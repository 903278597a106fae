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
//! broadcast's time (measured in docs/PERFORMANCE.md's log, now in git history). Now a
//! rank sends its first confirmations as soon as the call's work is done here and returns.
//! Where all that is left of the round is to receive (two ranks, where moreover only the side
//! that received confirms), its next collective on the communicator receives them once its own
//! work is done; where the rank has more to send once
//! it has heard from others (more ranks), a task of its own makes the rest as the messages
//! arrive, so that no rank waits for another's next call, and the next call waits for the
//! task. Either way a rank is at most one collective ahead of the others, and the
//! confirmations in flight are bounded. A failure of the earlier call
//! elsewhere (another rank's abort, a rank gone) is kept, and the user's call that collected
//! it returns [`CollectiveError::EarlierFailed`] once its own work is done: one error per rank
//! for one failure, at the call or at the next. `barrier()` collects every confirmation, and
//! `shutdown()` collects them too and logs what failed.

use std::collections::VecDeque;
use std::time::Instant;

use nexar_types::DType;

use crate::comm::client::NexarClient;
use crate::comm::collective::CollectiveError;
use crate::comm::exec::{AbortOnDrop, CollCall, Watch, broadcast_abort, disagreement};
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
pub(in crate::comm) struct Confirmation {
    seq: u64,
    call: CollCall,
    /// The call's header, which its confirmations carry.
    header: CollHeader,
    dtype: DType,
    /// The round's steps not yet made.
    left: VecDeque<Round>,
}

/// The rest of a rooted collective's round, still open.
#[derive(Debug)]
pub(in crate::comm) enum Open {
    /// Only receives are left: the next call makes them.
    Here(Confirmation),
    /// Sends follow receives: a task makes them as the messages arrive.
    Task { seq: u64, earlier: &'static str, task: tokio::task::JoinHandle<Result<(), CollectiveError>> },
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
    open: tokio::sync::Mutex<VecDeque<Open>>,
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
    /// Rooted collective `seq`, whose work (`body`) is done here: sends this rank's first
    /// confirmations now, and returns the rest of the round (if any) for
    /// [`settle_confirmations`](Self::settle_confirmations) to keep open.
    ///
    /// Between two ranks the round is one message each way, and half of it says nothing: a
    /// rank whose part only sent checked nothing (the other checked the headers it sent), so
    /// it has nothing to confirm, and the other, whose part only received, has nothing to wait
    /// for. So there a broadcast's receiver tells the root, a reduce's root tells the sender,
    /// and not the other way. A rank whose part did nothing at all (no elements) still sends
    /// and waits: its confirmation is the only message that carries its call's header.
    pub(in crate::comm) async fn begin_confirmation(
        &self,
        seq: u64,
        call: CollCall,
        header: CollHeader,
        dtype: DType,
        body: &Schedule,
    ) -> Result<Option<Open>, CollectiveError> {
        let mut round = Schedule::new();
        append_dissemination(&mut round, self.rank(), self.world_size());
        let sent = body.steps.iter().any(|step| matches!(step, Step::Send { .. }));
        let received = body.steps.iter().any(|step| matches!(step, Step::Recv { .. }));
        let (only_sent, only_received) = (sent && !received, received && !sent);
        let says_something = |step: &Round| match step {
            _ if self.world_size() != 2 => true,
            Round::Send(_) => !only_sent,
            Round::Recv(_) => !only_received,
        };
        let left = round
            .steps
            .iter()
            .filter_map(|step| match *step {
                Step::Send { to, .. } => Some(Round::Send(to)),
                Step::Recv { from, .. } => Some(Round::Recv(from)),
                _ => None,
            })
            .filter(says_something)
            .collect();
        let mut confirmation = Confirmation { seq, call, header, dtype, left };
        self.advance(&mut confirmation, None).await?;
        if confirmation.left.is_empty() {
            return Ok(None);
        }
        if !confirmation.left.iter().any(|step| matches!(step, Round::Send(_))) {
            return Ok(Some(Open::Here(confirmation)));
        }
        let client = self.for_own_task();
        let task = tokio::spawn(async move {
            // Parked at once: a task of nexar's own must not hold a core.
            let watch = Watch { spin: false, ..client.confirmation_watch(&confirmation, None) };
            let done = client.advance(&mut confirmation, Some(&watch)).await;
            if let Err(e) = &done
                && e.is_local_origin()
            {
                broadcast_abort(&client, seq, &e.to_string()).await;
            }
            done
        });
        Ok(Some(Open::Task { seq, earlier: call.kind.name(), task }))
    }

    /// Collects the open rounds, oldest first, then keeps `own` (the calling collective's
    /// round) open for the next call. A round made here waits as a collective step waits (the
    /// deadline is `op_timeout`, the stall inspector reports, in the flight-recorder entry
    /// `trace` of the collecting call). A round that fails is kept for the user's call to
    /// report ([`reported`](Self::reported)), and the rest stay open.
    pub(in crate::comm) async fn settle_confirmations(&self, trace: Option<&OpTrace<'_>>, own: Option<Open>) {
        let mut open = self.comm.unconfirmed.open.lock().await;
        let older = open.len();
        open.extend(own);
        for _ in 0..older {
            let Some(round) = open.pop_front() else { break };
            let (seq, earlier, done) = match round {
                Open::Here(mut confirmation) => {
                    let (seq, op) = (confirmation.seq, confirmation.call.kind.name());
                    // Dropped while it waits, this rank would leave the others waiting.
                    let mut guard = AbortOnDrop { client: Some(self), seq, op };
                    let watch = self.confirmation_watch(&confirmation, trace);
                    let done = self.advance(&mut confirmation, Some(&watch)).await;
                    guard.client = None;
                    if let Err(e) = &done
                        && e.is_local_origin()
                    {
                        broadcast_abort(self, seq, &e.to_string()).await;
                    }
                    (seq, op, done)
                }
                // Dropped while it waits, the task goes on.
                Open::Task { seq, earlier, task } => {
                    let done = task.await.unwrap_or_else(|e| {
                        Err(CollectiveError::Internal {
                            rank: self.rank(),
                            op: earlier,
                            what: format!("confirmation task failed: {e}"),
                        })
                    });
                    (seq, earlier, done)
                }
            };
            if let Err(source) = done {
                tracing::debug!(rank = self.rank(), seq, op = earlier, error = %source, "confirmation failed");
                self.comm.unconfirmed.keep(Failed { earlier, seq, source });
                return;
            }
        }
    }

    /// How the waits of `confirmation`'s round are watched.
    fn confirmation_watch<'t, 'r>(&self, confirmation: &Confirmation, trace: Option<&'t OpTrace<'r>>) -> Watch<'t, 'r> {
        Watch {
            trace,
            comm: self.comm.id,
            seq: confirmation.seq,
            call: confirmation.call,
            dtype: confirmation.dtype,
            deadline: Instant::now() + self.config().op_timeout,
            spin: true,
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
    pub(in crate::comm) async fn settle_before_leaving(&self, limit: std::time::Duration) {
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
    /// one only those that need no waiting.
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
                        None => match self.inner.coll.try_take(key).map_err(|r| self.refused(r, op, from))? {
                            Some(held) => held,
                            None => return Ok(()),
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
