//! The rank's failure monitor: heartbeats to the ranks that watch this one, and the checks of
//! the ranks this one watches (`cluster::detector`: the ring, the adaptive silence, the
//! evidence clock), each suspicion handed to the probes (`probe.rs`). The traffic per rank is
//! the same at 4 ranks as at 4,000: heartbeats to [`WATCHED`](crate::cluster::detector::WATCHED)
//! ranks per interval.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::cluster::detector::{Detector, DetectorSettings, PHI_THRESHOLD, watched, watchers};
use crate::comm::client::Inner;
use crate::comm::membership::probe::Cause;
use crate::proto::message::PeerMsg;
use crate::proto::topology::Topology;

/// The longest gap between two liveness checks.
const MAX_CHECK_PERIOD: Duration = Duration::from_millis(250);
/// A check this late is logged as a warning (later ones at debug level).
const STARVED_LOUDLY: Duration = Duration::from_secs(1);

impl Inner {
    /// The live world ranks (neither dead nor gone), sorted, with this rank among them: those
    /// of the initial world and those that joined later, whether or not this rank has a direct
    /// link to them (the ring a full mesh watches around).
    pub(in crate::comm) fn ring(&self) -> Vec<usize> {
        let joined = self.links.iter().map(|l| l.peer() as usize).filter(|&p| p >= self.initial_world);
        let mut live: Vec<usize> = (0..self.initial_world)
            .chain(joined)
            .filter(|&p| !self.health.is_dead(p) && !self.health.has_left(p))
            .collect();
        live.push(self.rank);
        live.sort_unstable();
        live.dedup();
        live
    }

    /// The peers this rank watches, and those it beats to (the ones watching it). On a full
    /// mesh, the ring rule of `cluster::detector`: three each way, whatever the world. On a
    /// sparse topology, every live linked neighbour both ways, over the direct links (the
    /// degree of the topology, bounded); watching ranks through relays would take a silent
    /// relay's silence for theirs.
    pub(in crate::comm) fn monitored(&self) -> (Vec<usize>, Vec<usize>) {
        let ring = self.ring();
        if self.cfg.topology == Topology::FullMesh {
            return (watched(self.rank, &ring), watchers(self.rank, &ring));
        }
        let linked: Vec<usize> = ring.into_iter().filter(|&p| p != self.rank && self.links.get(p).is_some()).collect();
        (linked.clone(), linked)
    }

    /// Sends a heartbeat to each of `peers` now: on its direct link (a full control lane is
    /// itself traffic the peer counts as life), or relayed where the topology gives none.
    fn beat_to(self: &Arc<Self>, peers: &[usize]) {
        for &p in peers {
            self.count_liveness();
            if let Some(link) = self.links.get(p) {
                let _ = link.try_send(&PeerMsg::Heartbeat);
                continue;
            }
            let weak = Arc::downgrade(self);
            tokio::spawn(async move {
                let Some(inner) = weak.upgrade() else { return };
                if let Some(route) = inner.route(p) {
                    let _ = route.send_queued(&PeerMsg::Heartbeat, None).await;
                }
            });
        }
    }

    /// Another rank suspects this one: it refutes by beating to every peer at once, whose
    /// probes then find it alive.
    pub(crate) fn refute(self: &Arc<Self>, from: usize) {
        // At most one round of refutation per interval, however many suspicions arrive.
        let now = self.health.liveness.now_ms();
        let gap = self.cfg.heartbeat_interval.as_millis() as u64;
        let last = self.refuted_at.load(std::sync::atomic::Ordering::Relaxed);
        if last != 0 && now < last + gap {
            return;
        }
        self.refuted_at.store(now.max(1), std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(rank = self.rank, from, "a peer suspects this rank; refuting with heartbeats to all");
        // Every linked peer, the ranks that watch this one, and the rank that said so (on a
        // sparse topology the last two may be reached only through others).
        let mut all: Vec<usize> = self.links.iter().map(|l| l.peer() as usize).collect();
        all.extend(self.monitored().1);
        all.push(from);
        all.sort_unstable();
        all.dedup();
        all.retain(|&p| p != self.rank);
        self.beat_to(&all);
    }
}

/// How often the monitor beats (when an interval has passed) and checks its watched peers.
pub(crate) fn check_period(interval: Duration, timeout: Duration) -> Duration {
    interval.min(MAX_CHECK_PERIOD).min(timeout / 4)
}

/// Sends heartbeats and checks the watched peers, until the rank is gone.
pub(crate) async fn monitor(inner: Weak<Inner>, interval: Duration, timeout: Duration) {
    let period = check_period(interval, timeout);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let Some(strong) = inner.upgrade() else { return };
    let settings = DetectorSettings { interval, timeout, probe_window: strong.probe_window(), period };
    let mut detector = Detector::new(settings);
    // Silence is counted from the moment the mesh is up, not from when this rank started (only
    // for linked peers: a stamp is a claim of having heard from them, which probes rely on).
    for link in strong.links.iter() {
        strong.health.liveness.heard(link.peer());
    }
    drop(strong);
    let mut last_beat: Option<Instant> = None;
    // Authenticated QUIC frames seen from each peer by the last check (see `frames_from`).
    let mut frames_seen: Vec<u64> = Vec::new();
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        if inner.health.is_shutting_down() {
            return;
        }
        let (mine, theirs) = inner.monitored();
        if last_beat.is_none_or(|t| t.elapsed() >= interval) {
            last_beat = Some(Instant::now());
            inner.beat_to(&theirs);
        }
        for &peer in &mine {
            // A heartbeat can wait behind a large message on a lossy connection (the
            // congestion window is the connection's); any frame the peer's QUIC stack sent
            // since the last check (an acknowledgement, stream data) shows it runs too.
            let Some(link) = inner.links.get(peer) else { continue };
            let frames = frames_from(link.connection());
            if frames_seen.len() <= peer {
                frames_seen.resize(peer + 1, 0);
            }
            if frames > std::mem::replace(&mut frames_seen[peer], frames) {
                inner.health.liveness.heard(peer as u32);
            }
        }
        let liveness = inner.health.liveness.clone();
        let check = detector.check(liveness.now_ms(), &mine, |p| liveness.last_heard(p));
        if let Some(late) = check.starved {
            // Its own silence was the longest: the peers may be judging it now.
            if late >= STARVED_LOUDLY {
                tracing::warn!(
                    rank = inner.rank,
                    ?late,
                    "this rank was starved; that time is not counted against its peers"
                );
            } else {
                tracing::debug!(
                    rank = inner.rank,
                    ?late,
                    "this rank's check ran late; the time is not counted against its peers"
                );
            }
            if late >= interval {
                inner.beat_to(&theirs);
            }
        }
        for suspicion in check.suspicions {
            let peer = suspicion.peer;
            let phi = detector.phi(peer, suspicion.silent);
            tracing::info!(rank = inner.rank, peer, silent = ?suspicion.silent, phi, threshold = PHI_THRESHOLD, "suspecting a silent peer; probing it");
            detector.cleared(peer);
            inner.investigate(peer, Cause::Silent { suspicion, phi });
        }
    }
}

/// Frames received on `conn` that prove the peer's QUIC stack is running: acknowledgements,
/// stream data and pings. quinn counts frames only once their packet decrypted, so a stranger
/// who knows the connection's id cannot fake them.
fn frames_from(conn: &quinn::Connection) -> u64 {
    let rx = conn.stats().frame_rx;
    rx.acks + rx.stream + rx.ping
}
