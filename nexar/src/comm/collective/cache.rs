//! Schedules kept for calls that repeat.

use std::sync::Arc;

use crate::proto::algo::{Algorithm, Collective};
use crate::proto::schedule::Schedule;

/// Everything a schedule is generated from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScheduleKey {
    pub(super) kind: Collective,
    pub(super) algorithm: Algorithm,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) count: usize,
    pub(super) elem: usize,
    /// Whether the communicator knew its members' hosts (schedules made before may differ).
    pub(super) hosts_known: bool,
}

/// Schedules kept for calls that repeat (a plan's collectives, run every iteration), so they
/// are generated once. Bounded: when full, it starts over.
#[derive(Debug, Default)]
pub(crate) struct ScheduleCache {
    kept: std::sync::Mutex<Vec<(ScheduleKey, Arc<Schedule>)>>,
}

/// Schedules a [`ScheduleCache`] keeps at most.
const CACHED_SCHEDULES: usize = 64;
/// The most steps of a schedule worth keeping: a longer one moves enough data that planning
/// it again costs nothing in comparison, and keeping it would cost memory.
pub(crate) const CACHED_STEPS: usize = 4096;

impl ScheduleCache {
    /// An empty cache (usable in a `static`).
    pub(crate) const fn new() -> Self {
        ScheduleCache { kept: std::sync::Mutex::new(Vec::new()) }
    }

    pub(super) fn get(&self, key: &ScheduleKey) -> Option<Arc<Schedule>> {
        crate::sync::lock(&self.kept).iter().find(|(k, _)| k == key).map(|(_, s)| s.clone())
    }

    pub(super) fn keep(&self, key: ScheduleKey, schedule: Arc<Schedule>) {
        let mut kept = crate::sync::lock(&self.kept);
        if kept.len() >= CACHED_SCHEDULES {
            kept.clear();
        }
        kept.push((key, schedule));
    }
}

#[cfg(test)]
#[path = "cache_tests.rs"]
mod tests;
