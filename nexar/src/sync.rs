//! Small synchronisation helpers.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering the data if a panicking thread poisoned the lock: every structure
/// guarded this way is updated with single assignments, so it is never left half-changed, and a
/// poisoned lock must not turn into a panic in a rank that did nothing wrong.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
