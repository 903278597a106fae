//! The stall inspector and the flight recorder's side of the communicator: a wait that lasts
//! `NEXAR_STALL_WARN_MS` asks the other members where they are and reports who is missing and
//! why; the same report ends the wait when it times out. Members answer the question from
//! their recorder, and the inquirer keeps what each was seen calling (`trace::LastSeen`), so a
//! report made after a member failed, or once it stopped answering, still names its call.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::comm::client::{Inner, NexarClient};
use crate::proto::message::{ActiveColl, PeerMsg};
use crate::trace::{Answer, OpTrace, Reply, StalledOp, TraceDump, TraceError, stall_report};

/// The longest the inspector waits for the members' answers.
const INQUIRY_LIMIT: Duration = Duration::from_secs(2);

impl Inner {
    /// Answers the stall inspector of world rank `from`: where this rank is on `comm`.
    pub(crate) async fn answer_position(&self, from: u32, nonce: u64, comm: u64) {
        let (active, progress) = self.trace.recorder.position(comm);
        let now_us = self.trace.recorder.elapsed_us();
        let active = active
            .iter()
            .map(|e| ActiveColl {
                seq: e.desc.seq,
                kind: e.desc.kind,
                dtype: e.desc.dtype.map_or(0, |d| d.to_wire()),
                root: e.desc.root,
                count: e.desc.count,
                waited_ms: e.waiting_on.map_or(0, |_| now_us.saturating_sub(e.waiting_since_us) / 1000),
                waiting_on: e.waiting_on,
            })
            .collect();
        let answer = PeerMsg::Position {
            nonce,
            comm,
            active,
            last_started: progress.last_started,
            last_completed: progress.last_completed,
        };
        if let Some(route) = self.route(from as usize)
            && let Err(e) = route.send(&answer, None).await
        {
            tracing::debug!(peer = from, error = %e, "could not answer the stall inspector");
        }
    }

    /// Asks world rank `peer` where it is on `comm`; `Unresponsive` if it says nothing in time.
    async fn ask_position(&self, peer: usize, comm: u64, within: Duration) -> Answer {
        if let Some(failure) = self.health.failure(peer) {
            return Answer::Dead(failure.reason);
        }
        let Some(route) = self.route(peer) else { return Answer::Unresponsive };
        let nonce: u64 = rand::random();
        let (tx, rx) = oneshot::channel();
        crate::sync::lock(&self.positions).insert(nonce, (peer as u32, tx));
        let asked = tokio::time::timeout(within, async {
            route.send(&PeerMsg::WhereAreYou { nonce, comm }, None).await.ok()?;
            rx.await.ok()
        })
        .await;
        crate::sync::lock(&self.positions).remove(&nonce);
        match asked {
            Ok(Some(answer)) => answer,
            _ => match self.health.failure(peer) {
                Some(failure) => Answer::Dead(failure.reason),
                None => Answer::Unresponsive,
            },
        }
    }
}

impl NexarClient {
    /// Asks every other member where it is, and writes the one-line report on `stalled`.
    pub(crate) async fn inspect_stall(&self, stalled: StalledOp) -> String {
        let within = INQUIRY_LIMIT.min(self.config().trace.stall_warn);
        let mut asked = tokio::task::JoinSet::new();
        for &peer in self.comm.members.iter().filter(|&&m| m != self.rank()) {
            let inner = self.inner.clone();
            let comm = self.comm.id;
            asked.spawn(async move {
                let answer = inner.ask_position(peer, comm, within).await;
                // Kept for a later report, when the peer may no longer say (its collective
                // failed, or it went silent or died).
                if let Answer::Position { active, .. } = &answer {
                    inner.trace.seen.note(peer as u32, comm, active);
                }
                let seen = inner.trace.seen.calls(peer as u32, comm);
                Reply { rank: peer, answer, seen }
            });
        }
        let mut replies = Vec::with_capacity(self.comm.members.len());
        while let Some(reply) = asked.join_next().await {
            if let Ok(reply) = reply {
                replies.push(reply);
            }
        }
        stall_report(&stalled, &replies)
    }

    /// Waits for `fut`, which world rank `peer` must bring about, as [`Self::wait_watched`]
    /// does; while the wait is parked, `trace` says it waits on `peer`. A future that is ready
    /// at once costs neither a record nor a timer.
    pub(crate) async fn wait_on_peer<F: Future>(
        &self,
        fut: F,
        peer: usize,
        trace: &OpTrace<'_>,
        deadline: Instant,
        stalled: impl Fn(Duration) -> StalledOp,
    ) -> Result<F::Output, String> {
        let mut fut = std::pin::pin!(fut);
        if let Some(out) = poll_once(fut.as_mut()).await {
            return Ok(out);
        }
        trace.waiting_on(peer);
        let out = self.wait_watched(fut, deadline, stalled).await;
        trace.not_waiting();
        out
    }

    /// Waits for `fut` until `deadline`. When it has waited the stall-warning time, the
    /// inspector reports (see the module docs) while the wait goes on; at the deadline the
    /// error is a fresh report. `stalled` describes the wait, given how long it has lasted.
    pub(crate) async fn wait_watched<F: Future>(
        &self,
        fut: F,
        deadline: Instant,
        stalled: impl Fn(Duration) -> StalledOp,
    ) -> Result<F::Output, String> {
        let began = Instant::now();
        let warn_at = began + self.config().trace.stall_warn;
        tokio::pin!(fut);
        if warn_at < deadline {
            if let Ok(out) = tokio::time::timeout_at(warn_at.into(), &mut fut).await {
                return Ok(out);
            }
            let inspection = self.inspect_stall(stalled(began.elapsed()));
            tokio::select! {
                out = &mut fut => return Ok(out),
                report = inspection => warn_stalled(self.rank(), &report),
            }
        }
        match tokio::time::timeout_at(deadline.into(), &mut fut).await {
            Ok(out) => Ok(out),
            Err(_) => Err(self.inspect_stall(stalled(began.elapsed())).await),
        }
    }

    /// Writes this rank's flight recorder (its last operations, see [`crate::trace`]) as JSON
    /// into `NEXAR_TRACE_DIR`, as `nexar-trace-<cluster>-rank<rank>.json`, and returns the
    /// file's path. `nexar trace DIR` reads a directory of them.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::trace::TraceError> {
    /// let path = comm.dump_trace()?;
    /// println!("flight recorder written to {}", path.display());
    /// # Ok(()) }
    /// ```
    pub fn dump_trace(&self) -> Result<PathBuf, TraceError> {
        self.inner.trace.dump("manual")
    }

    /// This rank's flight recorder as it stands, without writing it anywhere.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// let trace = comm.trace_snapshot();
    /// let failed = trace.entries.iter().filter(|e| e.state == "failed").count();
    /// # }
    /// ```
    pub fn trace_snapshot(&self) -> TraceDump {
        self.inner.trace.snapshot("snapshot")
    }
}

/// Logs a stall report; straight to stderr when the program installed no `tracing`
/// subscriber, so that a hung job explains itself even then.
fn warn_stalled(rank: usize, report: &str) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!(rank, "stalled: {report}");
    } else {
        eprintln!("nexar: rank {rank}: stalled: {report}");
    }
}

/// Polls `fut` once: its output if it is ready, `None` (with the waker registered) if not.
async fn poll_once<F: Future>(mut fut: Pin<&mut F>) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match fut.as_mut().poll(cx) {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        })
    })
    .await
}
