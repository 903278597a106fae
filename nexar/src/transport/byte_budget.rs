//! A budget of bytes that messages hold while this rank keeps them in memory: a message waits,
//! unread, until the budget has room for it, so the peer's flow control holds the sender rather
//! than this rank's memory growing.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget's unit: lengths are rounded up to it, so the semaphore's count stays small.
const UNIT: u64 = 64 << 10;

/// A shared budget of `limit` bytes.
#[derive(Clone, Debug)]
pub(crate) struct ByteBudget {
    units: Arc<Semaphore>,
    total: u32,
    limit: u64,
}

impl ByteBudget {
    /// A budget of `limit` bytes (at least one unit).
    pub fn new(limit: u64) -> ByteBudget {
        let total = limit.div_ceil(UNIT).clamp(1, u64::from(u32::MAX >> 3)) as u32;
        ByteBudget { units: Arc::new(Semaphore::new(total as usize)), total, limit }
    }

    /// The most bytes one message may take.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Waits until `len` bytes fit, and holds them until the permit is dropped (`None` only if
    /// the budget was closed, which nothing does).
    pub async fn take(&self, len: u64) -> Option<OwnedSemaphorePermit> {
        let units = len.div_ceil(UNIT).min(u64::from(self.total)) as u32;
        self.units.clone().acquire_many_owned(units).await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn messages_wait_for_room_and_one_of_the_limits_size_always_fits() {
        let budget = ByteBudget::new(1 << 20);
        let a = budget.take(600 << 10).await;
        let waiting = tokio::time::timeout(Duration::from_millis(50), budget.take(600 << 10)).await;
        assert!(waiting.is_err(), "two messages over the budget were held at once");
        drop(a);
        let whole = tokio::time::timeout(Duration::from_secs(5), budget.take(1 << 20)).await;
        assert!(whole.is_ok(), "a message of the limit's size must fit an empty budget");
    }
}
