//! When one rank starts to suspect a peer, with no I/O: which peers it watches, how long a
//! silence it accepts from each, and how much of a silence counts as evidence.
//!
//! - **Whom it watches.** Each rank watches its next [`WATCHED`] live ranks around the ring of
//!   ranks and sends heartbeats to the [`WATCHED`] before it (the ranks watching it), so the
//!   liveness traffic of a rank does not grow with the cluster (SWIM's bounded monitoring; the
//!   ring makes every rank watched by the same number of others).
//! - **How long a silence.** The gaps between signs of life from a peer are kept, and the
//!   silence accepted is where the φ-accrual detector (Hayashibara et al., as in Akka and
//!   Cassandra) reaches φ = [`PHI_THRESHOLD`]: the mean gap, one heartbeat interval of pause,
//!   and [`PHI_SIGMAS`] standard deviations. It is kept between half the heartbeat timeout
//!   and the heartbeat timeout less the probe window, so a peer that falls truly silent is
//!   declared within the configured timeout.
//! - **Evidence.** A silence counts only while this rank was itself running: each check
//!   credits the time since the last one up to [`CREDIT_PERIODS`] check periods. A rank whose
//!   own timers ran late (a starved process or host) does not take the time it was not
//!   running as the peers' silence.
//!
//! A suspicion is not a verdict: `comm` then probes the peer directly and through others
//! (`comm/membership/health.rs`).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// Ring successors each rank watches (and predecessors it sends heartbeats to).
pub(crate) const WATCHED: usize = 3;
/// Gaps kept per peer.
const WINDOW: usize = 64;
/// φ at which a silence becomes a suspicion (Akka's default; 10⁻⁸ odds that a live peer with
/// the gaps seen so far is this late).
pub(crate) const PHI_THRESHOLD: f64 = 8.0;
/// Standard deviations past the mean at which φ reaches [`PHI_THRESHOLD`], under the
/// logistic approximation of the normal tail that [`Detector::phi`] uses (Akka's).
const PHI_SIGMAS: f64 = 5.226;
/// A check credits at most this many check periods of silence.
const CREDIT_PERIODS: u32 = 2;

/// The settings a detector runs with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DetectorSettings {
    /// How often peers send heartbeats.
    pub interval: Duration,
    /// The longest silence from a peer before it is suspected whatever its history
    /// (`NEXAR_HEARTBEAT_TIMEOUT_MS`), probe window included.
    pub timeout: Duration,
    /// How long the probes of a suspect take at most.
    pub probe_window: Duration,
    /// How often the detector is asked to check.
    pub period: Duration,
}

impl DetectorSettings {
    /// The shortest silence ever suspected: half the timeout.
    fn floor(&self) -> Duration {
        self.timeout / 2
    }

    /// The longest: the timeout less the probe window (never below the floor).
    fn ceiling(&self) -> Duration {
        self.timeout.saturating_sub(self.probe_window).max(self.floor())
    }
}

/// What a detector knows of one peer.
#[derive(Clone, Debug, Default)]
struct Peer {
    /// Gaps between successive signs of life, in milliseconds.
    gaps: VecDeque<f64>,
    /// When it was last heard from (the liveness clock, ms), as of the last check.
    last_heard: Option<u64>,
    /// Silence that counts as evidence, in ms.
    evidence: u64,
    /// Whether a suspicion was raised since it was last heard from.
    suspected: bool,
}

/// How a peer's signs of life have been spaced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Rhythm {
    /// Mean gap.
    pub mean: Duration,
    /// Standard deviation of the gaps (at least a quarter of the heartbeat interval).
    pub deviation: Duration,
}

/// A peer whose silence passed what its rhythm allows.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Suspicion {
    /// The world rank suspected.
    pub peer: usize,
    /// The silence counted as evidence.
    pub silent: Duration,
    /// The silence its rhythm allowed.
    pub allowed: Duration,
    /// How its signs of life came until then.
    pub rhythm: Rhythm,
}

/// What one check found.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Check {
    /// This rank's own check ran this late past its period: it was starved, and that time was
    /// not counted against anyone.
    pub starved: Option<Duration>,
    /// Peers newly suspected.
    pub suspicions: Vec<Suspicion>,
}

/// One rank's detector over its watched peers.
#[derive(Debug)]
pub(crate) struct Detector {
    settings: DetectorSettings,
    /// Only the peers this rank has watched: its memory does not grow with the world.
    peers: HashMap<usize, Peer>,
    last_check: Option<u64>,
}

impl Detector {
    /// A detector with no peer heard from yet.
    pub fn new(settings: DetectorSettings) -> Self {
        Detector { settings, peers: HashMap::new(), last_check: None }
    }

    fn peer(&mut self, rank: usize) -> &mut Peer {
        self.peers.entry(rank).or_default()
    }

    /// How `rank`'s signs of life have been spaced so far.
    pub fn rhythm(&self, rank: usize) -> Rhythm {
        let floor = self.settings.interval.as_secs_f64() * 1000.0 / 4.0;
        let gaps = self.peers.get(&rank).map(|p| &p.gaps);
        let (mean, deviation) = match gaps {
            Some(g) if !g.is_empty() => {
                let n = g.len() as f64;
                let mean = g.iter().sum::<f64>() / n;
                let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
                (mean, var.sqrt().max(floor))
            }
            // Nothing seen yet: as if it beat on time.
            _ => (self.settings.interval.as_secs_f64() * 1000.0, floor),
        };
        Rhythm { mean: Duration::from_secs_f64(mean / 1000.0), deviation: Duration::from_secs_f64(deviation / 1000.0) }
    }

    /// The silence `rank` is allowed before it is suspected: where φ reaches
    /// [`PHI_THRESHOLD`], between half the timeout and the timeout less the probe window.
    pub fn allowed(&self, rank: usize) -> Duration {
        let r = self.rhythm(rank);
        let phi_at = r.mean + self.settings.interval + r.deviation.mul_f64(PHI_SIGMAS);
        phi_at.clamp(self.settings.floor(), self.settings.ceiling())
    }

    /// φ of a silence of `silent` from `rank` (for the log): -log10 of the odds that a live
    /// peer with its rhythm is this late, by the logistic approximation of the normal tail.
    pub fn phi(&self, rank: usize, silent: Duration) -> f64 {
        let r = self.rhythm(rank);
        let mean = (r.mean + self.settings.interval).as_secs_f64();
        let y = (silent.as_secs_f64() - mean) / r.deviation.as_secs_f64();
        let e = (-y * (1.5976 + 0.070566 * y * y)).exp();
        let tail = if silent.as_secs_f64() > mean { e / (1.0 + e) } else { 1.0 - 1.0 / (1.0 + e) };
        -tail.max(f64::MIN_POSITIVE).log10()
    }

    /// A check at `now` (ms on the liveness clock) of the `watched` peers, given when each was
    /// last heard from. Returns whether this rank was starved and the peers newly suspected.
    pub fn check(&mut self, now: u64, watched: &[usize], last_heard: impl Fn(usize) -> u64) -> Check {
        let period = self.settings.period.as_millis() as u64;
        let gap = self.last_check.map_or(0, |t| now.saturating_sub(t));
        self.last_check = Some(now);
        let credit = gap.min(period * u64::from(CREDIT_PERIODS));
        let starved = (gap > credit).then(|| Duration::from_millis(gap - period));
        let mut suspicions = Vec::new();
        for &rank in watched {
            let heard = last_heard(rank);
            let peer = self.peer(rank);
            match peer.last_heard {
                Some(before) if heard > before => {
                    peer.gaps.push_back((heard - before) as f64);
                    if peer.gaps.len() > WINDOW {
                        peer.gaps.pop_front();
                    }
                    peer.evidence = now.saturating_sub(heard).min(credit);
                    peer.suspected = false;
                }
                Some(_) => peer.evidence += credit,
                // First seen on this check: its silence starts now.
                None => peer.evidence = 0,
            }
            peer.last_heard = Some(heard);
            let (evidence, suspected) = (peer.evidence, peer.suspected);
            let allowed = self.allowed(rank);
            let silent = Duration::from_millis(evidence);
            if !suspected && silent >= allowed {
                self.peer(rank).suspected = true;
                suspicions.push(Suspicion { peer: rank, silent, allowed, rhythm: self.rhythm(rank) });
            }
        }
        Check { starved, suspicions }
    }

    /// `rank` was found alive after a suspicion (it answered a probe, or another rank heard
    /// from it): its silence starts again.
    pub fn cleared(&mut self, rank: usize) {
        let peer = self.peer(rank);
        peer.evidence = 0;
        peer.suspected = false;
    }
}

/// The ranks `me` watches: the next [`WATCHED`] of `live` (sorted world ranks, `me` among
/// them or not) around the ring. Everyone, when there are few.
pub(crate) fn watched(me: usize, live: &[usize]) -> Vec<usize> {
    around(me, live, true)
}

/// The ranks that watch `me`: the [`WATCHED`] before it around the ring; `me` sends them its
/// heartbeats.
pub(crate) fn watchers(me: usize, live: &[usize]) -> Vec<usize> {
    around(me, live, false)
}

fn around(me: usize, live: &[usize], forward: bool) -> Vec<usize> {
    let others: Vec<usize> = live.iter().copied().filter(|&r| r != me).collect();
    if others.len() <= WATCHED {
        return others;
    }
    // The first rank after `me` in ring order.
    let next = others.partition_point(|&r| r < me);
    let n = others.len();
    (0..WATCHED).map(|i| if forward { others[(next + i) % n] } else { others[(next + n - 1 - i) % n] }).collect()
}

#[cfg(test)]
#[path = "detector_tests.rs"]
mod tests;
