//! When each peer was last heard from: every message a router reads counts as a sign of life.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Per-peer time of the last message received, shared by the routers of a rank's links and
/// read by its health monitor.
#[derive(Debug)]
pub(crate) struct Liveness {
    origin: Instant,
    /// Milliseconds since `origin` of the last message from each peer (by world rank).
    last: Vec<AtomicU64>,
}

impl Liveness {
    /// Every peer counts as heard from now.
    pub fn new(world: usize) -> Self {
        Liveness { origin: Instant::now(), last: (0..world).map(|_| AtomicU64::new(0)).collect() }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
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
        assert!(l.silent_for(1) >= Duration::from_millis(30));
        l.heard(1);
        assert!(l.silent_for(1) < Duration::from_millis(30));
        l.heard(99); // out of range: ignored
    }
}
