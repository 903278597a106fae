//! One rank's view of which peers are alive: the verdicts (dead, left, excluded), the peers
//! being checked after another rank's report, and the majority rule by which the peers that
//! cut this rank exclude it. No I/O: `comm` feeds it what the links show and carries out what
//! it decides (failing receives, cutting links, gossip), so each rule is tested here without a
//! cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tokio::sync::watch;

use crate::transport::liveness::Liveness;

/// Longest failure reason kept and passed on (reasons nest as they are gossiped).
pub(crate) const MAX_REASON: usize = 1024;

/// `reason`, cut to at most [`MAX_REASON`] bytes on a character boundary.
pub(crate) fn bounded(mut reason: String) -> String {
    if reason.len() > MAX_REASON {
        let mut cut = MAX_REASON;
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
        reason.push('…');
    }
    reason
}

/// A peer this rank considers dead.
///
/// ```no_run
/// # async fn run(comm: nexar::NexarClient) {
/// let mut failures = comm.failure_watch();
/// if let Some(f) = failures.next().await {
///     eprintln!("rank {} failed: {}", f.rank, f.reason);
/// }
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerFailure {
    /// The failed rank, numbered in the whole cluster (see
    /// [`world_rank`](crate::NexarClient::world_rank)).
    pub rank: usize,
    /// How this rank learned of it, in words.
    pub reason: String,
    /// When this rank declared it dead.
    pub detected_at: Instant,
}

#[derive(Default)]
struct Verdicts {
    dead: BTreeMap<usize, PeerFailure>,
    /// Peers that said goodbye: their silence is not a failure.
    left: BTreeSet<usize>,
    /// Peers another rank reported dead that this rank is checking for itself.
    checking: BTreeSet<usize>,
    /// Set when the other ranks declared this one dead: the reason.
    excluded: Option<String>,
    /// Peers that cut their link to this rank, declaring it dead, and what they said.
    declared_me_dead: BTreeMap<usize, String>,
    /// Dead peers this rank counts as gone only because they cut it first: their death is the
    /// other side of their verdict on this rank, not something this rank saw.
    gone_for_cutting: BTreeSet<usize>,
}

/// How many of this rank's peers have cut it, of how many that count (see [`Health::cut_by`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CutVotes {
    /// Peers that cut their link to this rank, declaring it dead.
    pub votes: usize,
    /// Peers that have a say: those still held alive, and those that cut this rank.
    pub peers: usize,
}

impl CutVotes {
    /// Most of the peers that count cut this rank: it was excluded.
    pub fn excludes(self) -> bool {
        self.votes * 2 > self.peers
    }
}

/// One rank's view of which peers are alive, and who hears of each new verdict.
pub(crate) struct Health {
    /// When each peer was last heard from.
    pub liveness: Arc<Liveness>,
    verdicts: Mutex<Verdicts>,
    /// Every failure so far, for the watchers (a `FailureWatch`, automatic recovery).
    events: watch::Sender<Vec<PeerFailure>>,
    shutting_down: AtomicBool,
}

impl Health {
    /// Nobody dead, nobody left, this rank not excluded.
    pub fn new(liveness: Arc<Liveness>) -> Self {
        Health {
            liveness,
            verdicts: Mutex::new(Verdicts::default()),
            events: watch::channel(Vec::new()).0,
            shutting_down: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Verdicts> {
        crate::sync::lock(&self.verdicts)
    }

    /// Whether `peer` (a world rank) has been declared dead.
    pub fn is_dead(&self, peer: usize) -> bool {
        self.lock().dead.contains_key(&peer)
    }

    /// How `peer` (a world rank) was declared dead, if it was.
    pub fn failure(&self, peer: usize) -> Option<PeerFailure> {
        self.lock().dead.get(&peer).cloned()
    }

    /// Every world rank declared dead so far.
    pub fn dead(&self) -> Vec<usize> {
        self.lock().dead.keys().copied().collect()
    }

    /// Records `failure`; false (and nothing changes) when its rank was declared dead already.
    /// The watchers hear of it through [`publish`](Self::publish), once the rank has acted on
    /// it.
    pub fn declare_dead(&self, failure: PeerFailure) -> bool {
        let mut v = self.lock();
        if v.dead.contains_key(&failure.rank) {
            return false;
        }
        if v.declared_me_dead.contains_key(&failure.rank) {
            v.gone_for_cutting.insert(failure.rank);
        }
        v.dead.insert(failure.rank, failure);
        true
    }

    /// Whether this rank counts `peer` (a world rank) as dead only because `peer` cut it,
    /// declaring this rank dead first ([`cut_by`](Self::cut_by) before
    /// [`declare_dead`](Self::declare_dead)). The failure agreement weighs such a death as the
    /// peer's word against this rank, not as this rank's own sight of a failure.
    pub fn gone_for_cutting(&self, peer: usize) -> bool {
        self.lock().gone_for_cutting.contains(&peer)
    }

    /// Tells the watchers of `failure` (recorded by [`declare_dead`](Self::declare_dead)).
    pub fn publish(&self, failure: PeerFailure) {
        self.events.send_modify(|all| all.push(failure));
    }

    /// Wakes the watchers with no new failure (this rank was excluded).
    pub fn wake(&self) {
        self.events.send_modify(|_| {});
    }

    /// Why this rank was excluded by the others, if it was.
    pub fn excluded(&self) -> Option<String> {
        self.lock().excluded.clone()
    }

    /// Records that the other ranks excluded this one for `why`; true the first time (only the
    /// first reason is kept). The watchers wake through [`wake`](Self::wake).
    pub fn exclude(&self, why: &str) -> bool {
        let mut v = self.lock();
        let first = v.excluded.is_none();
        if first {
            v.excluded = Some(why.to_string());
        }
        first
    }

    /// `peer` cut its link to this rank for `why`: counts its vote among `linked` (the peers
    /// this rank has a direct link to). The peers that count are those this rank still holds
    /// alive and those that cut it (which it may since have counted as gone); ranks long dead
    /// have no say, so a rank stalled among few survivors still learns that it was left.
    pub fn cut_by(&self, peer: usize, why: &str, linked: impl IntoIterator<Item = usize>) -> CutVotes {
        let mut v = self.lock();
        v.declared_me_dead.insert(peer, why.to_string());
        let peers =
            linked.into_iter().filter(|p| !v.dead.contains_key(p) || v.declared_me_dead.contains_key(p)).count();
        CutVotes { votes: v.declared_me_dead.len(), peers }
    }

    /// What the peers that cut this rank, declaring it dead, said (each names itself).
    pub fn declared_me_dead(&self) -> Vec<String> {
        self.lock().declared_me_dead.values().cloned().collect()
    }

    /// Starts checking `peer` after another rank's report; false when a check is running.
    pub fn start_check(&self, peer: usize) -> bool {
        self.lock().checking.insert(peer)
    }

    /// The check of `peer` ended, whatever it found.
    pub fn end_check(&self, peer: usize) {
        self.lock().checking.remove(&peer);
    }

    /// From now on, silence and closed connections are the orderly end of the cluster.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// Whether this rank is shutting down (or aborted).
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// `peer` said goodbye: its silence from now on is not a failure.
    pub fn said_goodbye(&self, peer: usize) {
        self.lock().left.insert(peer);
    }

    /// Whether `peer` said goodbye.
    pub fn has_left(&self, peer: usize) -> bool {
        self.lock().left.contains(&peer)
    }

    /// Whether a link to `peer` that ends now ends in order: this rank shuts down, or the
    /// peer said goodbye.
    pub fn ends_in_order(&self, peer: usize) -> bool {
        self.is_shutting_down() || self.has_left(peer)
    }

    /// A watch on every failure so far; it also wakes when this rank is excluded.
    pub fn subscribe(&self) -> watch::Receiver<Vec<PeerFailure>> {
        self.events.subscribe()
    }
}

#[cfg(test)]
#[path = "health_tests.rs"]
mod tests;
