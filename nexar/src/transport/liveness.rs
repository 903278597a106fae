//! When each peer was last heard from: every message a router reads counts as a sign of life.
//!
//! Every delivered message stamps its sender, so the stamp must be cheap: it reads the kernel's
//! coarse monotonic clock (a few ns through the vDSO, where `Instant::now` costs ~30 ns on the
//! machines measured), whose resolution of a scheduler tick (1–4 ms) is far finer than the
//! seconds a failure timeout counts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustix::time::{ClockId, clock_gettime};

/// Milliseconds on the coarse monotonic clock.
fn coarse_ms() -> u64 {
    let t = clock_gettime(ClockId::MonotonicCoarse);
    (t.tv_sec.max(0) as u64).saturating_mul(1000).saturating_add(t.tv_nsec.max(0) as u64 / 1_000_000)
}

/// Per-peer time of the last message received, shared by the routers of a rank's links and
/// read by its health monitor.
#[derive(Debug)]
pub(crate) struct Liveness {
    /// [`coarse_ms`] when the liveness began.
    origin: u64,
    /// Milliseconds since `origin` of the last message from each peer (by world rank).
    last: Vec<AtomicU64>,
}

impl Liveness {
    /// Every peer counts as heard from now.
    pub fn new(world: usize) -> Self {
        Liveness { origin: coarse_ms(), last: (0..world).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Milliseconds since the liveness began: the clock [`last_heard`](Self::last_heard) reads.
    pub fn now_ms(&self) -> u64 {
        coarse_ms().saturating_sub(self.origin)
    }

    /// When `peer` was last heard from, on the [`now_ms`](Self::now_ms) clock (0: not since
    /// the liveness began).
    pub fn last_heard(&self, peer: usize) -> u64 {
        self.last.get(peer).map_or(0, |s| s.load(Ordering::Relaxed))
    }

    /// Records a sign of life from `peer` (ranks outside the world are ignored).
    pub fn heard(&self, peer: u32) {
        if let Some(slot) = self.last.get(peer as usize) {
            slot.fetch_max(self.now_ms(), Ordering::Relaxed);
        }
    }

    /// How long ago `peer` was last heard from.
    pub fn silent_for(&self, peer: usize) -> Duration {
        let last = self.last.get(peer).map_or(0, |s| s.load(Ordering::Relaxed));
        Duration::from_millis(self.now_ms().saturating_sub(last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hearing_a_peer_resets_its_silence() {
        let l = Liveness::new(2);
        std::thread::sleep(Duration::from_millis(30));
        // The coarse clock may lag by a tick (up to 4 ms at 250 Hz) at either end.
        assert!(l.silent_for(1) >= Duration::from_millis(20), "{:?}", l.silent_for(1));
        l.heard(1);
        assert!(l.silent_for(1) < Duration::from_millis(20), "{:?}", l.silent_for(1));
        l.heard(99); // out of range: ignored
    }
}
