//! The liveness model: every rank runs the real [`Detector`] over the ranks it watches on the
//! ring, beats to the ranks that watch it, and probes a suspect as `comm/membership/probe.rs`
//! does (a ping for half the window, then [`INDIRECT`] helpers that ping it for a quarter; a
//! round with too few replies repeated with twice the window; a suspect nobody reached told,
//! with until it has been silent for the heartbeat timeout to refute), with the same
//! constants. A declared death is reported to every rank, which probes the rank itself.
//!
//! Messages take a base latency plus an exponential delay. A rank can stall (a process that
//! is not scheduled): everything it would do meanwhile waits until the stall ends, so its
//! checks run late and its beats stop, as on a starved host. A killed rank does nothing more.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::events::{Queue, duration, exponential, micros};
use crate::cluster::detector::{Detector, DetectorSettings, watched, watchers};
use crate::comm::membership::{INDIRECT, MAX_PROBING, MAX_STARVED_ROUNDS, PROBE_WINDOW, check_period, probe_window};

/// What [`simulate_liveness`] runs.
///
/// ```
/// use nexar::simulate::LivenessScenario;
/// let s = LivenessScenario::new(1024);
/// assert_eq!(s.heartbeat_timeout, std::time::Duration::from_secs(5)); // nexar's defaults
/// ```
#[derive(Clone, Debug)]
pub struct LivenessScenario {
    /// Rank processes.
    pub ranks: usize,
    /// `NEXAR_HEARTBEAT_INTERVAL_MS` (default 1 s).
    pub heartbeat_interval: Duration,
    /// `NEXAR_HEARTBEAT_TIMEOUT_MS` (default 5 s).
    pub heartbeat_timeout: Duration,
    /// Simulated time.
    pub run_for: Duration,
    /// One-way delay of every message.
    pub latency: Duration,
    /// Mean of the exponential delay added to each message (queueing, scheduling).
    pub jitter: Duration,
    /// Stalls per rank per minute (each rank's start a Poisson process).
    pub stalls_per_minute: f64,
    /// Stall lengths are uniform between zero and this.
    pub longest_stall: Duration,
    /// A rank killed (it stops at once, as after `kill -9`) and when.
    pub kill: Option<(usize, Duration)>,
    /// The random seed: the same scenario and seed give the same outcome.
    pub seed: u64,
}

impl LivenessScenario {
    /// `ranks` ranks with nexar's default heartbeat settings for 60 s, 100 µs ± 500 µs
    /// messages, no stall and no kill.
    pub fn new(ranks: usize) -> Self {
        LivenessScenario {
            ranks,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            run_for: Duration::from_secs(60),
            latency: Duration::from_micros(100),
            jitter: Duration::from_micros(500),
            stalls_per_minute: 0.0,
            longest_stall: Duration::ZERO,
            kill: None,
            seed: 1,
        }
    }
}

/// What [`simulate_liveness`] found.
///
/// ```
/// use nexar::simulate::{LivenessScenario, simulate_liveness};
/// let mut s = LivenessScenario::new(16);
/// s.run_for = std::time::Duration::from_secs(10);
/// let out = simulate_liveness(&s);
/// assert!(out.messages_per_rank_per_s < 5.0);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LivenessOutcome {
    /// Liveness messages (heartbeats, pings and their answers, probes, reports, refutations)
    /// per rank per second, before any kill.
    pub messages_per_rank_per_s: f64,
    /// The same after the kill, until the end (failure reports and probes included).
    pub messages_per_rank_per_s_after_kill: Option<f64>,
    /// Silences the detectors suspected.
    pub suspicions: u64,
    /// Declarations of a rank that was not killed.
    pub false_deaths: u64,
    /// From the kill to the first rank declaring it dead.
    pub first_detection: Option<Duration>,
    /// From the kill until every other rank had declared it dead (`None`: some never did).
    pub all_detected: Option<Duration>,
    /// Events the model handled.
    pub events: u64,
}

#[derive(Clone, Copy, Debug)]
enum Msg {
    Heartbeat,
    Ping { nonce: u64 },
    Pong { nonce: u64 },
    ProbeFor { nonce: u64, target: usize, within: u64 },
    ProbeResult { nonce: u64, alive: bool },
    Suspect { rank: usize },
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Tick(usize),
    Deliver {
        to: usize,
        from: usize,
        msg: Msg,
    },
    /// A deadline of rank `rank`'s probe of `target`, for its round `round`.
    RoundDeadline {
        rank: usize,
        target: usize,
        round: u64,
    },
    /// A helper's ping for a `ProbeFor` ran out.
    HelperDeadline {
        rank: usize,
        nonce: u64,
    },
    Stall(usize),
    Kill(usize),
}

/// Where a probe of one suspect stands.
#[derive(Clone, Debug)]
enum Phase {
    Ping { nonce: u64 },
    Indirect { asked: Vec<usize>, answered: Vec<usize>, nonces: Vec<u64> },
    Refute { heard_at: u64 },
}

#[derive(Clone, Debug)]
struct Probe {
    /// Raised by another rank's report, not by this rank's own detector: a death found so is
    /// not reported on (the reporter told everyone).
    reported: bool,
    began: u64,
    round_began: u64,
    window: u64,
    starved: u32,
    heard_before: u64,
    round: u64,
    phase: Phase,
}

/// A helper's ping on behalf of another rank.
#[derive(Clone, Copy, Debug)]
struct HelperPing {
    asker: usize,
    asker_nonce: u64,
    target: usize,
}

struct Rank {
    detector: Detector,
    /// When each peer was last heard from (µs); absent: at the start.
    heard: HashMap<usize, u64>,
    dead: HashSet<usize>,
    watched: Vec<usize>,
    watchers: Vec<usize>,
    last_beat: Option<u64>,
    stalled_until: u64,
    killed: bool,
    refuted_at: Option<u64>,
    probes: HashMap<usize, Probe>,
    helping: HashMap<u64, HelperPing>,
}

struct Model<'a> {
    s: &'a LivenessScenario,
    ranks: Vec<Rank>,
    queue: Queue<Ev>,
    rng: StdRng,
    interval: u64,
    timeout: u64,
    period: u64,
    window: u64,
    nonce: u64,
    round: u64,
    sent_before_kill: u64,
    sent_after_kill: u64,
    suspicions: u64,
    false_deaths: u64,
    killed: Option<(usize, u64)>,
    declared: Vec<u64>,
}

/// Runs `s` and reports what the ranks' detectors and probes did.
///
/// ```
/// use std::time::Duration;
/// use nexar::simulate::{LivenessScenario, simulate_liveness};
/// let mut s = LivenessScenario::new(32);
/// s.run_for = Duration::from_secs(15);
/// s.kill = Some((3, Duration::from_secs(5)));
/// let out = simulate_liveness(&s);
/// assert!(out.all_detected.is_some());
/// ```
pub fn simulate_liveness(s: &LivenessScenario) -> LivenessOutcome {
    let mut m = Model::new(s);
    let end = micros(s.run_for);
    while let Some((now, ev)) = m.queue.pop() {
        if now > end {
            break;
        }
        m.handle(now, ev);
    }
    m.outcome(end)
}

impl<'a> Model<'a> {
    fn new(s: &'a LivenessScenario) -> Self {
        let (interval, timeout) = (s.heartbeat_interval, s.heartbeat_timeout);
        let period = check_period(interval, timeout);
        let settings = DetectorSettings { interval, timeout, probe_window: probe_window(timeout), period };
        let all: Vec<usize> = (0..s.ranks).collect();
        let mut rng = StdRng::seed_from_u64(s.seed);
        let mut queue = Queue::new();
        let ranks = (0..s.ranks)
            .map(|r| Rank {
                detector: Detector::new(settings),
                heard: HashMap::new(),
                dead: HashSet::new(),
                watched: watched(r, &all),
                watchers: watchers(r, &all),
                last_beat: None,
                stalled_until: 0,
                killed: false,
                refuted_at: None,
                probes: HashMap::new(),
                helping: HashMap::new(),
            })
            .collect();
        for r in 0..s.ranks {
            queue.push(rng.random_range(0..micros(period).max(1)), Ev::Tick(r));
        }
        let mut m = Model {
            s,
            ranks,
            queue,
            rng,
            interval: micros(interval),
            timeout: micros(timeout),
            period: micros(period),
            window: micros(probe_window(timeout)),
            nonce: 0,
            round: 0,
            sent_before_kill: 0,
            sent_after_kill: 0,
            suspicions: 0,
            false_deaths: 0,
            killed: None,
            declared: Vec::new(),
        };
        if s.stalls_per_minute > 0.0 {
            for r in 0..s.ranks {
                let at = m.next_stall_gap();
                m.queue.push(at, Ev::Stall(r));
            }
        }
        if let Some((rank, at)) = s.kill {
            m.queue.push(micros(at), Ev::Kill(rank));
        }
        m
    }

    fn next_stall_gap(&mut self) -> u64 {
        let u: f64 = self.rng.random_range(f64::MIN_POSITIVE..1.0);
        exponential(60e6 / self.s.stalls_per_minute, u)
    }

    fn handle(&mut self, now: u64, ev: Ev) {
        let owner = match ev {
            Ev::Tick(r) | Ev::Stall(r) | Ev::Kill(r) => r,
            Ev::Deliver { to, .. } => to,
            Ev::RoundDeadline { rank, .. } | Ev::HelperDeadline { rank, .. } => rank,
        };
        if owner >= self.ranks.len() || self.ranks[owner].killed {
            return;
        }
        // A stalled rank does nothing until its stall ends; then it catches up.
        if !matches!(ev, Ev::Stall(_) | Ev::Kill(_)) && now < self.ranks[owner].stalled_until {
            let until = self.ranks[owner].stalled_until;
            self.queue.push(until, ev);
            return;
        }
        match ev {
            Ev::Tick(r) => self.tick(now, r),
            Ev::Deliver { to, from, msg } => self.deliver(now, to, from, msg),
            Ev::RoundDeadline { rank, target, round } => self.round_deadline(now, rank, target, round),
            Ev::HelperDeadline { rank, nonce } => {
                if let Some(h) = self.ranks[rank].helping.remove(&nonce) {
                    self.send(now, rank, h.asker, Msg::ProbeResult { nonce: h.asker_nonce, alive: false });
                }
            }
            Ev::Stall(r) => {
                let longest = micros(self.s.longest_stall);
                let len = if longest == 0 { 0 } else { self.rng.random_range(0..longest) };
                let until = (now + len).max(self.ranks[r].stalled_until);
                self.ranks[r].stalled_until = until;
                let gap = self.next_stall_gap();
                self.queue.push(until + gap, Ev::Stall(r));
            }
            Ev::Kill(r) => {
                self.ranks[r].killed = true;
                self.killed = Some((r, now));
            }
        }
    }

    fn send(&mut self, now: u64, from: usize, to: usize, msg: Msg) {
        if self.killed.is_some() {
            self.sent_after_kill += 1;
        } else {
            self.sent_before_kill += 1;
        }
        let u: f64 = self.rng.random_range(f64::MIN_POSITIVE..1.0);
        let delay = micros(self.s.latency) + exponential(micros(self.s.jitter) as f64, u);
        self.queue.push(now + delay.max(1), Ev::Deliver { to, from, msg });
    }

    fn heard(&self, rank: usize, peer: usize) -> u64 {
        self.ranks[rank].heard.get(&peer).copied().unwrap_or(0)
    }

    fn silent_for(&self, now: u64, rank: usize, peer: usize) -> u64 {
        now.saturating_sub(self.heard(rank, peer))
    }

    /// The monitor's tick: a beat when an interval has passed, then a check.
    fn tick(&mut self, now: u64, r: usize) {
        self.queue.push(now + self.period, Ev::Tick(r));
        if self.ranks[r].last_beat.is_none_or(|t| now >= t + self.interval) {
            self.ranks[r].last_beat = Some(now);
            self.beat(now, r);
        }
        let heard: HashMap<usize, u64> = self.ranks[r].watched.iter().map(|&p| (p, self.heard(r, p) / 1000)).collect();
        let watched = self.ranks[r].watched.clone();
        let check = self.ranks[r].detector.check(now / 1000, &watched, |p| heard[&p]);
        if check.starved.is_some_and(|late| micros(late) >= self.interval) {
            self.beat(now, r);
        }
        for suspicion in check.suspicions {
            self.suspicions += 1;
            self.ranks[r].detector.cleared(suspicion.peer);
            self.investigate(now, r, suspicion.peer, false);
        }
    }

    fn beat(&mut self, now: u64, r: usize) {
        for p in self.ranks[r].watchers.clone() {
            self.send(now, r, p, Msg::Heartbeat);
        }
    }

    fn deliver(&mut self, now: u64, to: usize, from: usize, msg: Msg) {
        self.ranks[to].heard.insert(from, now);
        // Any sign of life refutes a suspicion in its last phase.
        if let Some(Probe { phase: Phase::Refute { heard_at }, .. }) = self.ranks[to].probes.get(&from)
            && now > *heard_at
        {
            self.ranks[to].probes.remove(&from);
        }
        match msg {
            Msg::Heartbeat => {}
            Msg::Ping { nonce } => self.send(now, to, from, Msg::Pong { nonce }),
            Msg::Pong { nonce } => self.pong(now, to, from, nonce),
            Msg::ProbeFor { nonce, target, within } => self.answer_probe(now, to, from, nonce, target, within),
            Msg::ProbeResult { nonce, alive } => self.probe_result(now, to, from, nonce, alive),
            Msg::Suspect { rank } if rank == to => self.refute(now, to),
            Msg::Suspect { rank } => self.investigate(now, to, rank, true),
        }
    }

    fn refute(&mut self, now: u64, r: usize) {
        if self.ranks[r].refuted_at.is_some_and(|t| now < t + self.interval) {
            return;
        }
        self.ranks[r].refuted_at = Some(now);
        for p in 0..self.ranks.len() {
            if p != r && !self.ranks[r].dead.contains(&p) {
                self.send(now, r, p, Msg::Heartbeat);
            }
        }
    }

    fn outcome(&self, end: u64) -> LivenessOutcome {
        let n = self.ranks.len().max(1) as f64;
        let before = self.killed.map_or(end, |(_, at)| at).max(1);
        let first_detection = self.killed.and_then(|(_, at)| self.declared.iter().min().map(|t| duration(t - at)));
        let all_detected = self.killed.and_then(|(_, at)| {
            let everyone = self.declared.len() + 1 >= self.ranks.len();
            if everyone { self.declared.iter().max().map(|t| duration(t - at)) } else { None }
        });
        LivenessOutcome {
            messages_per_rank_per_s: self.sent_before_kill as f64 / n / (before as f64 / 1e6),
            messages_per_rank_per_s_after_kill: self
                .killed
                .map(|(_, at)| self.sent_after_kill as f64 / n / ((end.saturating_sub(at)).max(1) as f64 / 1e6)),
            suspicions: self.suspicions,
            false_deaths: self.false_deaths,
            first_detection,
            all_detected,
            events: self.queue.popped(),
        }
    }
}

#[path = "liveness_probes.rs"]
mod probes;
#[cfg(test)]
#[path = "liveness_tests.rs"]
mod tests;
