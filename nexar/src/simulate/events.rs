//! The models' clock: events in time order (ties in the order they were scheduled), times in
//! microseconds.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

/// Events of type `E`, popped earliest first.
pub(super) struct Queue<E> {
    heap: BinaryHeap<Reverse<(u64, u64, usize)>>,
    slots: Vec<Option<E>>,
    free: Vec<usize>,
    seq: u64,
    popped: u64,
}

impl<E> Queue<E> {
    pub fn new() -> Self {
        Queue { heap: BinaryHeap::new(), slots: Vec::new(), free: Vec::new(), seq: 0, popped: 0 }
    }

    /// Schedules `event` at `at` µs.
    pub fn push(&mut self, at: u64, event: E) {
        let slot = match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(event);
                i
            }
            None => {
                self.slots.push(Some(event));
                self.slots.len() - 1
            }
        };
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, slot)));
    }

    /// The earliest event and its time.
    pub fn pop(&mut self) -> Option<(u64, E)> {
        let Reverse((at, _, slot)) = self.heap.pop()?;
        self.free.push(slot);
        self.popped += 1;
        self.slots[slot].take().map(|e| (at, e))
    }

    /// Events handled so far.
    pub fn popped(&self) -> u64 {
        self.popped
    }
}

/// `d` in µs.
pub(super) fn micros(d: Duration) -> u64 {
    d.as_micros().min(u128::from(u64::MAX)) as u64
}

/// `us` µs as a duration.
pub(super) fn duration(us: u64) -> Duration {
    Duration::from_micros(us)
}

/// A sample of an exponential distribution with mean `mean_us` from a uniform `u` in (0, 1].
pub(super) fn exponential(mean_us: f64, u: f64) -> u64 {
    (-u.max(f64::MIN_POSITIVE).ln() * mean_us) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_out_in_time_order_and_ties_in_scheduling_order() {
        let mut q = Queue::new();
        q.push(5, "b");
        q.push(1, "a");
        q.push(5, "c");
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, vec![(1, "a"), (5, "b"), (5, "c")]);
        assert_eq!(q.popped(), 3);
    }
}
