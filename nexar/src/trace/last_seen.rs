//! What each peer was last seen calling on each communicator, from its answers to the stall
//! inspector. A peer whose collective failed answers that it is in none, and a dead or silent
//! one answers nothing; the report made then (every rank of a stall times out at once, and the
//! last to ask hears the others after they failed) still names what each had called: its
//! operation, element type and count, root and sequence number, as it said at the warning's
//! inquiry (or any earlier one).

use std::collections::VecDeque;

use foldhash::HashMap;
use std::sync::Mutex;

use crate::proto::message::ActiveColl;
use crate::sync::lock;

/// `(peer, communicator)` pairs remembered; the oldest is forgotten first.
const REMEMBERED: usize = 1024;

/// Collectives remembered per pair: the newest of the peer's answer (it is a peer's word, so
/// what it costs is bounded here, whatever it sent).
const CALLS_PER_PEER: usize = 8;

/// What each peer was last seen calling, per communicator (see the module docs).
#[derive(Default)]
pub(crate) struct LastSeen {
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    calls: HashMap<(u32, u64), Vec<ActiveColl>>,
    order: VecDeque<(u32, u64)>,
}

impl LastSeen {
    /// Records that world rank `peer` said it is in `active` on `comm` (oldest first). An
    /// answer that names no collective changes nothing: what the peer was seen in before is
    /// what is worth keeping then.
    pub fn note(&self, peer: u32, comm: u64, active: &[ActiveColl]) {
        if active.is_empty() {
            return;
        }
        let newest = active[active.len().saturating_sub(CALLS_PER_PEER)..].to_vec();
        let mut seen = lock(&self.seen);
        if seen.calls.insert((peer, comm), newest).is_none() {
            seen.order.push_back((peer, comm));
            if seen.order.len() > REMEMBERED
                && let Some(old) = seen.order.pop_front()
            {
                seen.calls.remove(&old);
            }
        }
    }

    /// The collectives world rank `peer` was last seen in on `comm`, oldest first.
    pub fn calls(&self, peer: u32, comm: u64) -> Vec<ActiveColl> {
        lock(&self.seen).calls.get(&(peer, comm)).cloned().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(seq: u64) -> ActiveColl {
        ActiveColl { seq, kind: 1, dtype: 0, root: None, count: 4, waited_ms: 0, waiting_on: None }
    }

    #[test]
    fn the_last_answer_that_named_a_collective_is_kept_and_bounded() {
        let seen = LastSeen::default();
        seen.note(1, 0, &[call(3)]);
        seen.note(1, 0, &[]);
        assert_eq!(seen.calls(1, 0), [call(3)], "an empty answer forgets nothing");
        assert!(seen.calls(1, 7).is_empty() && seen.calls(2, 0).is_empty());
        let many: Vec<ActiveColl> = (0..100).map(call).collect();
        seen.note(1, 0, &many);
        assert_eq!(seen.calls(1, 0), many[100 - CALLS_PER_PEER..]);
        for comm in 0..2 * REMEMBERED as u64 {
            seen.note(2, comm, &[call(comm)]);
        }
        let kept = lock(&seen.seen).calls.len();
        assert!(kept <= REMEMBERED, "{kept} pairs kept");
        assert_eq!(seen.calls(2, 2 * REMEMBERED as u64 - 1), [call(2 * REMEMBERED as u64 - 1)]);
    }
}
