//! Spin-then-park: a receive that finds nothing polls for a bounded time before it registers a
//! waiter and lets its thread sleep.

use std::time::{Duration, Instant};

use crate::transport::mailbox::{Held, Key, Mailbox, Refusal};

/// Polls `mailbox` for `key` for up to `limit`, yielding between polls so this runtime keeps
/// driving its I/O (the message we wait for arrives through it). `Ok(None)` when nothing came.
///
/// Waking a parked thread costs tens of microseconds on these machines, more than a small
/// message's flight; the bound keeps a long wait from burning a core.
pub(super) async fn spin_take(mailbox: &Mailbox, key: Key, limit: Duration) -> Result<Option<Held>, Refusal> {
    if limit.is_zero() {
        return Ok(None);
    }
    let until = Instant::now() + limit;
    loop {
        if let Some(held) = mailbox.try_take(key)? {
            return Ok(Some(held));
        }
        if Instant::now() >= until {
            return Ok(None);
        }
        tokio::task::yield_now().await;
    }
}
