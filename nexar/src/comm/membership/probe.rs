//! Probing a suspect before it is declared dead, as SWIM does: a ping of this rank's own,
//! then probes through up to [`INDIRECT`] other ranks, each of which answers whether it heard
//! from the suspect lately or had an answer to its own ping. The suspect is declared dead only
//! on evidence: no answer to the ping, and ranks that did answer this rank say they could not
//! reach it either. A round in which none of the ranks asked replied says more about the host
//! or the network (or this rank) than about the suspect: it is repeated with twice the window,
//! until the rounds have taken the heartbeat timeout. The verdict says what was found in one
//! sentence, in this rank's own words: what raised the suspicion, whom it asked, and when it
//! last heard from the suspect. Another rank's report is a reason to probe, never evidence.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rand::seq::IndexedRandom;

use crate::cluster::detector::Suspicion;
use crate::comm::client::Inner;
use crate::proto::message::PeerMsg;
use crate::trace::list_ranks;

/// Ranks asked to probe a suspect for this rank.
pub(crate) const INDIRECT: usize = 3;
/// Rounds a starved rank probes a suspect before it gives up without a verdict.
pub(crate) const MAX_STARVED_ROUNDS: u32 = 8;
/// CPU pressure ("some avg10", percent) above which this host's CPUs count as contended.
const CONTENDED_PRESSURE: f64 = 50.0;
/// How often a suspect's refutation is looked for.
const REFUTATION_POLL: Duration = Duration::from_millis(50);
/// Indirect probes a rank runs for others at once; more are not answered (a member cannot make
/// a rank spend without bound on its behalf).
pub(crate) const MAX_PROBING: usize = 64;
/// How long the first round of probes of a suspect takes at most: half for the direct ping,
/// half for the probes through others (at most half the heartbeat timeout). The ranks asked
/// ping for a quarter of it, so that their answers arrive within the round.
pub(crate) const PROBE_WINDOW: Duration = Duration::from_secs(1);

/// How long the first round of probes takes at most with a heartbeat timeout of `timeout`.
pub(crate) fn probe_window(timeout: Duration) -> Duration {
    PROBE_WINDOW.min(timeout / 2)
}

/// One answer to a `ProbeFor` this rank sent.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ProbeAnswer {
    /// The rank that probed.
    pub from: usize,
    /// Whether the suspect showed it a sign of life.
    pub alive: bool,
    /// How long before its answer it last heard from the suspect.
    pub heard_ms: u64,
}

/// Why a peer came under suspicion.
#[derive(Clone, Debug)]
pub(crate) enum Cause {
    /// This rank's detector found it silent for longer than its rhythm allows.
    Silent { suspicion: Suspicion, phi: f64 },
    /// Another rank reported it unresponsive.
    Reported { by: usize },
}

impl Cause {
    fn describe(&self) -> String {
        match self {
            Cause::Silent { suspicion: s, phi } => format!(
                "no heartbeat or other message for {:.1} s (they came every {:.1} s ± {:.1} s, so φ {:.1} passed at {:.1} s)",
                s.silent.as_secs_f64(),
                s.rhythm.mean.as_secs_f64(),
                s.rhythm.deviation.as_secs_f64(),
                phi,
                s.allowed.as_secs_f64(),
            ),
            Cause::Reported { by } => format!("rank {by} reported it unresponsive"),
        }
    }
}

/// What probing a suspect found.
enum Probed {
    /// It is alive: how this rank knows.
    Alive(String),
    /// No evidence either way: this rank was starved while probing (its round ran this long),
    /// or ranks were asked and none of them replied.
    Inconclusive(Duration),
    /// Nobody could reach it: the ranks asked, and those of them that did not answer.
    Unreachable { asked: Vec<usize>, silent: Vec<usize> },
}

impl Inner {
    /// How long probing a suspect takes at most.
    pub(crate) fn probe_window(&self) -> Duration {
        probe_window(self.cfg.heartbeat_timeout)
    }

    /// Probes world rank `rank`, suspected for `cause`, and declares it dead if nobody can
    /// reach it. One probe per suspect at a time.
    pub(crate) fn investigate(self: &Arc<Self>, rank: usize, cause: Cause) {
        if rank == self.rank || rank >= self.links.capacity() || self.health.is_dead(rank) || self.health.has_left(rank)
        {
            return;
        }
        if !self.health.start_check(rank) {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let Some(inner) = weak.upgrade() else { return };
            if let Some(pid) = inner.exited_on_this_host(rank) {
                inner.health.end_check(rank);
                let reason = format!("{}, and its process {pid} on this host has exited", cause.describe());
                inner.peer_failed(rank, reason, true, true);
                return;
            }
            let began = Instant::now();
            let mut window = inner.probe_window();
            let mut starved = 0;
            let probed = loop {
                let probed = inner.probe(rank, window).await;
                let spent = began.elapsed();
                match probed {
                    // This rank was starved during the round: its silence is no evidence, and
                    // it judges nobody until it runs on time again (collectives still end at
                    // their own timeout).
                    Probed::Inconclusive(took) if took > 2 * window => {
                        starved += 1;
                        if starved >= MAX_STARVED_ROUNDS {
                            // No verdict; the detector suspects it again if it stays silent.
                            break Probed::Inconclusive(took);
                        }
                        tracing::info!(
                            rank,
                            ?took,
                            ?window,
                            "this rank was starved while probing a suspect; probing again"
                        );
                    }
                    Probed::Inconclusive(took) if spent + 2 * window <= inner.cfg.heartbeat_timeout => {
                        tracing::info!(
                            rank,
                            ?took,
                            ?window,
                            "no evidence on a suspect; probing again with a longer window"
                        );
                        window *= 2;
                    }
                    // Out of rounds with no reply at all: no evidence, so no verdict (the
                    // detector suspects it again if it stays silent), unless this rank hears
                    // from none of the ranks it asked either: then it is the one cut off, and
                    // nobody is reachable from here.
                    Probed::Inconclusive(took) => {
                        break inner.cut_off_from_helpers(rank).unwrap_or(Probed::Inconclusive(took));
                    }
                    Probed::Unreachable { asked, silent } => {
                        break inner.await_refutation(rank).await.unwrap_or(Probed::Unreachable { asked, silent });
                    }
                    other => break other,
                }
                if inner.health.is_dead(rank) || inner.health.is_shutting_down() {
                    break Probed::Alive("declared dead meanwhile".into());
                }
            };
            inner.health.end_check(rank);
            let window = began.elapsed();
            match probed {
                Probed::Alive(how) => {
                    // Not stamped as heard: what others heard is their evidence, and a stamp
                    // here would pass it on as this rank's own (the detector restarted the
                    // suspect's silence when it raised the suspicion).
                    tracing::info!(rank, cause = %cause.describe(), %how, "a suspect answered: still alive");
                }
                Probed::Inconclusive(took) => {
                    tracing::warn!(rank, ?took, "this rank was starved while probing a suspect; no verdict");
                }
                Probed::Unreachable { asked, silent } => {
                    let last = inner.health.liveness.silent_for(rank);
                    let through = match (asked.is_empty(), silent.is_empty()) {
                        (true, _) => String::new(),
                        (false, true) => format!(" or probes through {}", list_ranks(&asked)),
                        (false, false) => {
                            format!(" or probes through {} ({} did not reply)", list_ranks(&asked), list_ranks(&silent))
                        }
                    };
                    let reason = format!(
                        "{}, and it answered neither a ping{through} in {:.1} s; this rank last heard from it {:.1} s ago",
                        cause.describe(),
                        window.as_secs_f64(),
                        last.as_secs_f64()
                    );
                    // A death this rank found itself is reported to every linked rank. One it
                    // probed on another's report is not reported again where that rank's report
                    // reached everyone (a full mesh), so a death costs O(N) messages, not one
                    // from every rank to every rank; on a sparse topology it is passed on to
                    // the neighbours, a flood of O(N × degree).
                    let report = matches!(cause, Cause::Silent { .. }) || !inner.links_to_everyone();
                    inner.peer_failed(rank, reason, true, report);
                }
            }
        });
    }

    /// The probes found no way to reach `rank`: it is told (it refutes a suspicion it hears of
    /// with heartbeats to everyone), and has until this rank has not heard from it for the
    /// heartbeat timeout, and at least half a probe window, to show a sign of life (Lifeguard's
    /// suspicion period: a starved rank gets the whole timeout, a dead one is declared within
    /// it). `Some(Alive)` if it did.
    async fn await_refutation(&self, rank: usize) -> Option<Probed> {
        let heard = self.health.liveness.last_heard(rank);
        if let Some(route) = self.route(rank) {
            let _ = route
                .send_queued(&PeerMsg::Suspect { rank: rank as u32, reason: "no answer to probes".into() }, None)
                .await;
            self.count_liveness();
        }
        let left = self.cfg.heartbeat_timeout.saturating_sub(self.health.liveness.silent_for(rank));
        let mut until = Instant::now() + left.max(self.probe_window() / 2);
        // A rank of this host, while its CPUs are contended: its silence may be the host's
        // (64 ranks on two cores go seconds unscheduled), so it gets twice the timeout more.
        let contended = crate::affinity::cpu_pressure().is_some_and(|p| p >= CONTENDED_PRESSURE);
        // A rank of this very process (an in-process cluster) runs whenever this one does: the
        // host's contention cannot be what keeps it silent.
        let same_process = self.host_pids.get().and_then(|p| p.get(rank)).is_some_and(|&pid| pid == std::process::id());
        if contended && self.shares_host_with(rank) && !same_process && self.exited_on_this_host(rank).is_none() {
            tracing::info!(rank, "a suspect on this host while its CPUs are contended: a longer suspicion period");
            until += 2 * self.cfg.heartbeat_timeout;
        }
        while Instant::now() < until {
            if self.health.liveness.last_heard(rank) > heard {
                return Some(Probed::Alive("it refuted the suspicion".into()));
            }
            if self.health.is_dead(rank) || self.health.is_shutting_down() || self.exited_on_this_host(rank).is_some() {
                return None;
            }
            tokio::time::sleep(REFUTATION_POLL.min(until.saturating_duration_since(Instant::now()))).await;
        }
        None
    }

    /// The process id of world rank `rank` if it ran on this kernel and has exited: evidence of
    /// its death that no probe needs.
    fn exited_on_this_host(&self, rank: usize) -> Option<u32> {
        let pid = *self.host_pids.get()?.get(rank)?;
        (pid != 0 && !crate::affinity::process_running(pid)).then_some(pid)
    }

    /// `Unreachable` when this rank has heard for over half the heartbeat timeout from none of
    /// the ranks it watches, which beat to it (it is cut off from them as from the suspect);
    /// `None` otherwise. Other ranks send it no heartbeats, so their silence says nothing.
    fn cut_off_from_helpers(&self, rank: usize) -> Option<Probed> {
        let asked = self.probe_helpers(rank);
        let quiet = self.cfg.heartbeat_timeout / 2;
        let beating: Vec<usize> = self.monitored().0.into_iter().filter(|&p| p != rank).collect();
        let cut_off = !beating.is_empty() && beating.iter().all(|&p| self.health.liveness.silent_for(p) > quiet);
        cut_off.then(|| Probed::Unreachable { silent: asked.clone(), asked })
    }

    /// Whether this rank has a direct link to every live rank (a full mesh).
    fn links_to_everyone(&self) -> bool {
        self.ring().into_iter().all(|p| p == self.rank || self.links.get(p).is_some())
    }

    /// Whether world rank `rank` runs on this rank's host (as the cluster learnt at formation).
    fn shares_host_with(&self, rank: usize) -> bool {
        let keys = self.host_keys.get();
        keys.and_then(|k| Some(k.get(rank)? == k.get(self.rank)?)).unwrap_or(false)
    }

    /// One round: a ping of its own, then probes through others, within `window`.
    async fn probe(&self, rank: usize, window: Duration) -> Probed {
        let started = Instant::now();
        let heard_before = self.health.liveness.last_heard(rank);
        if self.peer_answers(rank, window / 2).await {
            return Probed::Alive("it answered a ping".into());
        }
        let asked = self.probe_helpers(rank);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut nonces = Vec::with_capacity(asked.len());
        for &helper in &asked {
            let nonce: u64 = rand::random();
            crate::sync::lock(&self.probes).insert(nonce, (helper as u32, tx.clone()));
            nonces.push(nonce);
            if let Some(link) = self.links.get(helper) {
                self.count_liveness();
                let _ = link.try_send(&PeerMsg::ProbeFor {
                    nonce,
                    target: rank as u32,
                    within_ms: (window / 4).as_millis() as u64,
                });
            }
        }
        drop(tx);
        let mut answered = Vec::new();
        let mut alive = None;
        let deadline = tokio::time::Instant::now() + window / 2;
        while answered.len() < asked.len() && alive.is_none() {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(a)) => {
                    answered.push(a.from);
                    if a.alive {
                        alive = Some(a);
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        {
            let mut probes = crate::sync::lock(&self.probes);
            for n in &nonces {
                probes.remove(n);
            }
        }
        if let Some(a) = alive {
            return Probed::Alive(format!("rank {} heard from it {} ms before it answered", a.from, a.heard_ms));
        }
        if self.health.liveness.last_heard(rank) > heard_before {
            return Probed::Alive("it was heard from while it was probed".into());
        }
        let took = started.elapsed();
        // Evidence is most of the ranks asked saying they could not reach it either (one
        // rank's failed ping on a busy host is not).
        let most_answered = answered.len() * 2 > asked.len();
        if took > 2 * window || (!asked.is_empty() && !most_answered) {
            return Probed::Inconclusive(took);
        }
        let silent = asked.iter().copied().filter(|h| !answered.contains(h)).collect();
        Probed::Unreachable { asked, silent }
    }

    /// Up to [`INDIRECT`] live ranks with a direct link here, other than `rank`, at random.
    fn probe_helpers(&self, rank: usize) -> Vec<usize> {
        let live: Vec<usize> = self
            .links
            .iter()
            .map(|l| l.peer() as usize)
            .filter(|&p| p != rank && !self.health.is_dead(p) && !self.health.has_left(p))
            .collect();
        let mut helpers: Vec<usize> = live.choose_multiple(&mut rand::rng(), INDIRECT).copied().collect();
        helpers.sort_unstable();
        helpers
    }

    /// Rank `from` asks this rank to probe `target` for it (`ProbeFor`), with a ping of at most
    /// `within` (never longer than a probe window).
    pub(crate) fn answer_probe(self: &Arc<Self>, from: usize, nonce: u64, target: usize, within: Duration) {
        if self.probing.fetch_add(1, Ordering::AcqRel) >= MAX_PROBING {
            self.probing.fetch_sub(1, Ordering::AcqRel);
            tracing::debug!(from, target, "too many probes for others at once; not answered");
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let Some(inner) = weak.upgrade() else { return };
            let fresh = 2 * inner.cfg.heartbeat_interval;
            let alive = if target == inner.rank {
                true
            } else if target >= inner.links.capacity() || inner.health.is_dead(target) {
                false
            } else {
                // Heard from lately, by this rank itself (a rank never heard from is not).
                let heard = inner.health.liveness.last_heard(target) != 0;
                heard && inner.health.liveness.silent_for(target) < fresh
                    || inner.peer_answers(target, within.min(PROBE_WINDOW)).await
            };
            let heard_ms =
                if target == inner.rank { 0 } else { inner.health.liveness.silent_for(target).as_millis() as u64 };
            if let Some(route) = inner.route(from) {
                let answer = PeerMsg::ProbeResult { nonce, target: target as u32, alive, heard_ms };
                inner.count_liveness();
                if let Err(e) = route.send(&answer, None).await {
                    tracing::debug!(from, error = %e, "could not answer a probe");
                }
            }
            inner.probing.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Rank `from` answers a `ProbeFor` this rank sent; only the rank asked can answer.
    pub(crate) fn probe_answered(&self, from: usize, nonce: u64, alive: bool, heard_ms: u64) {
        let probes = crate::sync::lock(&self.probes);
        if let Some((asked, tx)) = probes.get(&nonce)
            && *asked as usize == from
        {
            let _ = tx.send(ProbeAnswer { from, alive, heard_ms });
        }
    }

    /// Counts one liveness message sent (heartbeat, ping, probe or its answer, suspicion).
    pub(crate) fn count_liveness(&self) {
        self.liveness_sent.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether world rank `peer` answers a ping within `within`.
    pub(crate) async fn peer_answers(&self, peer: usize, within: Duration) -> bool {
        let Some(route) = self.route(peer) else { return false };
        let nonce: u64 = rand::random();
        let (tx, rx) = tokio::sync::oneshot::channel();
        crate::sync::lock(&self.pings).insert(nonce, tx);
        self.count_liveness();
        let answered = tokio::time::timeout(within, async {
            route.send(&PeerMsg::Ping { nonce }, None).await.is_ok() && rx.await.is_ok()
        })
        .await
        .unwrap_or(false);
        crate::sync::lock(&self.pings).remove(&nonce);
        answered
    }
}
