//! Small synchronisation helpers.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering the data if a panicking thread poisoned the lock: every structure
/// guarded this way is updated with single assignments, so it is never left half-changed, and a
/// poisoned lock must not turn into a panic in a rank that did nothing wrong.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts one operation against the task's cooperative budget (tokio's): a loop of operations
/// that each complete at once (a sender far ahead, every message already here) then hands the
/// thread to the runtime's other tasks every so often (tokio allows 128 ready operations a
/// turn), so the rank's heartbeats and lane readers still run and its peers do not declare it
/// dead. Called where an operation starts, before it takes or sends anything, so that an
/// operation dropped in this wait has done nothing.
pub(crate) async fn take_a_turn() {
    tokio::task::coop::consume_budget().await;
}
