//! Setup messages for transport back ends (`send_setup` / `recv_setup`), held until their
//! back end takes them, within bounds a flood from one rank or from many cannot pass.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use tokio::sync::Notify;

/// Setup messages held per sender; a further one replaces that sender's oldest (a peer cannot
/// make this rank hold more than `MAX_HELD_PER_PEER × MAX_SETUP_BODY` bytes, and messages
/// nobody took, say from an attempt that gave up, do not block later ones).
const MAX_HELD_PER_PEER: usize = 64;

/// Bytes of setup messages held from all senders together (a cluster of many ranks, each under
/// its own bound, must not add up to gigabytes).
const MAX_HELD_BYTES: usize = 16 << 20;

/// Bodies from one sender with one tag, oldest first, each with its arrival number.
type Held = HashMap<(u32, u64), VecDeque<(u64, Vec<u8>)>>;

/// Setup messages waiting for their `recv_setup`, by `(world rank, tag)`.
#[derive(Default)]
pub(crate) struct SetupInbox {
    held: Mutex<Held>,
    arrived: Notify,
    next: std::sync::atomic::AtomicU64,
}

impl SetupInbox {
    /// Holds a message from `from`. A sender at [`MAX_HELD_PER_PEER`] messages loses its
    /// oldest one; and while everything held would pass [`MAX_HELD_BYTES`], the sender holding
    /// the most bytes loses its oldest, so a flood from one rank (or from many) cannot grow
    /// this rank's memory without bound nor push out a quiet rank's message.
    pub fn put(&self, from: u32, tag: u64, body: Vec<u8>) {
        let mut held = crate::sync::lock(&self.held);
        let seq = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let from_peer: usize = held.iter().filter(|((f, _), _)| *f == from).map(|(_, q)| q.len()).sum();
        if from_peer >= MAX_HELD_PER_PEER {
            drop_oldest_of(&mut held, from);
        }
        let mut total: usize = held.values().flatten().map(|(_, b)| b.len()).sum::<usize>() + body.len();
        while total > MAX_HELD_BYTES {
            let mut bytes_of: HashMap<u32, usize> = HashMap::new();
            for ((f, _), q) in held.iter() {
                *bytes_of.entry(*f).or_default() += q.iter().map(|(_, b)| b.len()).sum::<usize>();
            }
            // The new message counts for its sender too.
            *bytes_of.entry(from).or_default() += body.len();
            let Some((&heaviest, _)) = bytes_of.iter().max_by_key(|(f, n)| (**n, **f)) else { break };
            match drop_oldest_of(&mut held, heaviest) {
                Some(freed) => total -= freed,
                // The heaviest sender is this message's own, holding nothing else: refuse it.
                None => {
                    tracing::warn!(from, tag, "dropped a setup message: the setup inbox is full");
                    return;
                }
            }
        }
        held.entry((from, tag)).or_default().push_back((seq, body));
        drop(held);
        self.arrived.notify_waiters();
    }

    /// The oldest message held from `from` under `tag`, if any.
    pub fn take(&self, from: u32, tag: u64) -> Option<Vec<u8>> {
        let mut held = crate::sync::lock(&self.held);
        let queue = held.get_mut(&(from, tag))?;
        let body = queue.pop_front().map(|(_, body)| body);
        if queue.is_empty() {
            held.remove(&(from, tag));
        }
        body
    }

    /// A future that resolves at the next [`put`](Self::put); enable it before a
    /// [`take`](Self::take) that finds nothing, so no message slips between the two.
    pub fn arrived(&self) -> tokio::sync::futures::Notified<'_> {
        self.arrived.notified()
    }
}

/// Drops the oldest message held from `from`; returns its length, or `None` if none is held.
fn drop_oldest_of(held: &mut Held, from: u32) -> Option<usize> {
    let (_, key) =
        held.iter().filter(|((f, _), _)| *f == from).filter_map(|(k, q)| q.front().map(|(s, _)| (*s, *k))).min()?;
    tracing::warn!(from, tag = key.1, "dropped the oldest unread setup message from this rank");
    let queue = held.get_mut(&key)?;
    let freed = queue.pop_front().map(|(_, body)| body.len());
    if queue.is_empty() {
        held.remove(&key);
    }
    freed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::MAX_SETUP_BODY;

    fn held_bytes(inbox: &SetupInbox) -> usize {
        crate::sync::lock(&inbox.held).values().flatten().map(|(_, b)| b.len()).sum()
    }

    #[test]
    fn a_flood_of_setup_messages_stays_within_the_bound_and_spares_a_quiet_rank() {
        let inbox = SetupInbox::default();
        inbox.put(999, 7, b"quiet".to_vec());
        // 600 senders, each under its own bound, would add up to ~2.4 GB unbounded.
        for from in 0..600u32 {
            for tag in 0..8 {
                inbox.put(from, tag, vec![from as u8; MAX_SETUP_BODY]);
            }
            assert!(held_bytes(&inbox) <= MAX_HELD_BYTES, "{} bytes held", held_bytes(&inbox));
        }
        assert_eq!(inbox.take(999, 7).as_deref(), Some(&b"quiet"[..]), "the quiet rank's message survived");
        // One sender alone still keeps at most its own share.
        for i in 0..2 * MAX_HELD_PER_PEER {
            inbox.put(5000, i as u64, vec![1; 16]);
        }
        let from_5000: usize =
            crate::sync::lock(&inbox.held).iter().filter(|((f, _), _)| *f == 5000).map(|(_, q)| q.len()).sum();
        assert_eq!(from_5000, MAX_HELD_PER_PEER);
        assert!(held_bytes(&inbox) <= MAX_HELD_BYTES);
    }
}
