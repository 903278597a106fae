//! Tag matching for point-to-point and collective messages: comm's store of unmatched
//! messages and pending receives, which the lanes deliver into (`transport::inbox::Inbox`).
//!
//! Messages arrive on the data lane in per-sender order. A `recv` for `(comm, src, tag)` takes
//! the oldest held message with that key, or waits for one. Messages nobody has asked for yet
//! are held, up to a configured count and byte size; beyond that the sender's link stops being
//! read (QUIC flow control pushes back on the sender) and `recv`s from that sender that cannot
//! be served from what is held fail with a clear error instead of waiting. No message is ever
//! dropped.
//!
//! The limits are shared fairly: half of each is reserved, in equal shares, for the senders,
//! and the other half is a pool any sender may use beyond its share. A sender that floods this
//! rank with messages nobody asked for fills its share and the pool, and then only its own link
//! pauses: every other sender still has its share. So does a sender whose one message is larger
//! than the limits (admitted because nobody used the pool, see `admission.rs`): it is charged
//! to that sender's share and the pool only.

mod admission;
mod entry;
mod inbox;

pub(crate) use admission::key_of;
pub(crate) use entry::{Held, Key, Segments};
use entry::{coll_entry, p2p_entry};

use std::collections::VecDeque;

use foldhash::HashMap;
use std::sync::Mutex;

use tokio::sync::{Notify, oneshot};

use crate::transport::link::Incoming;

/// Remembered aborted collectives per mailbox (their late messages are dropped on arrival).
const ABORTED_MEMORY: usize = 4096;

/// Why a `recv` could not be served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The held messages have reached the limit and none matches.
    Full { held: usize, held_bytes: u64 },
    /// The rank is shutting down.
    Closed,
    /// The collective with this `(comm, tag)` was aborted, for this reason.
    Aborted(String),
    /// The sender's connection is gone (it crashed, aborted or left); nothing more will come.
    SourceGone(String),
    /// A transport of this rank lost messages of this collective (a bulk channel failed):
    /// this rank fails it and tells the others.
    LinkFailed(String),
}

/// The refusal for a receive of an aborted collective.
fn refusal((reason, link_failed): &(String, bool)) -> Refusal {
    if *link_failed { Refusal::LinkFailed(reason.clone()) } else { Refusal::Aborted(reason.clone()) }
}

/// What [`Mailbox::try_deliver`] did with a message.
enum Delivered {
    /// Handed to a receive, held, or dropped (its collective was aborted).
    Done,
    /// Parked as the overflow message: the lane waits until it moves.
    Parked,
    /// Not taken: another message is parked; here it is back.
    Busy(Held),
}

/// A waiting receive: its id, the most payload bytes it takes (a larger message is not read
/// for it, see `Inbox::admit`), and where its message goes.
type Waiter = (u64, u64, oneshot::Sender<Result<Held, Refusal>>);

#[derive(Default)]
struct State {
    held: HashMap<Key, VecDeque<Held>>,
    count: usize,
    bytes: u64,
    /// Per sender: a message that arrived while the sender had no room, kept here (not dropped)
    /// until there is room or a `recv` asks for it. Only that sender's link waits meanwhile.
    /// (Messages normally wait unread instead, see `paused`; one lands here only when the
    /// receive it was admitted for went away before it arrived.)
    overflow: HashMap<u32, (Key, Held)>,
    /// Per sender: the key of a message announced on its link that waits, unread, for room or
    /// for a `recv` (see `Inbox::admit`).
    paused: HashMap<u32, (Key, u64)>,
    /// Messages and bytes held, per sender.
    per_src: HashMap<u32, (usize, u64)>,
    waiters: HashMap<Key, VecDeque<Waiter>>,
    next_waiter: u64,
    closed: bool,
    /// Why each remembered collective was aborted, and whether this rank's own link failed.
    aborted: HashMap<(u64, u64), (String, bool)>,
    aborted_order: VecDeque<(u64, u64)>,
    /// Senders whose connection is gone, with the reason.
    gone: HashMap<u32, String>,
}

impl State {
    fn count_in(&mut self, src: u32, len: u64) {
        self.count += 1;
        self.bytes += len;
        let share = self.per_src.entry(src).or_default();
        share.0 += 1;
        share.1 += len;
    }

    fn push_back(&mut self, key: Key, msg: Held) {
        self.count_in(key.src, msg.payload.len() as u64);
        self.held.entry(key).or_default().push_back(msg);
    }

    fn push_front(&mut self, key: Key, msg: Held) {
        self.count_in(key.src, msg.payload.len() as u64);
        self.held.entry(key).or_default().push_front(msg);
    }

    fn count_out(&mut self, src: u32, len: u64) {
        self.count -= 1;
        self.bytes -= len;
        if let Some(share) = self.per_src.get_mut(&src) {
            share.0 -= 1;
            share.1 -= len;
            if share.0 == 0 {
                self.per_src.remove(&src);
            }
        }
    }

    fn pop(&mut self, key: &Key) -> Option<Held> {
        let queue = self.held.get_mut(key)?;
        let msg = queue.pop_front()?;
        if queue.is_empty() {
            self.held.remove(key);
        }
        self.count_out(key.src, msg.payload.len() as u64);
        Some(msg)
    }

    /// Fails every receive waiting on `src`: its link is paused, so nothing it waits for that
    /// is not held can arrive (better told now than left to time out).
    fn refuse_waiters_of(&mut self, src: u32) {
        let (held, held_bytes) = (self.count, self.bytes);
        let keys: Vec<Key> = self.waiters.keys().copied().filter(|k| k.src == src).collect();
        for k in keys {
            for (_, _, tx) in self.waiters.remove(&k).unwrap_or_default() {
                let _ = tx.send(Err(Refusal::Full { held, held_bytes }));
            }
        }
    }
}

/// The store of unmatched messages and pending receives of one rank.
pub(crate) struct Mailbox {
    state: Mutex<State>,
    room: Notify,
    max_count: usize,
    max_bytes: u64,
    /// What each sender may always hold (half the limits, in equal shares).
    share_count: usize,
    share_bytes: u64,
    /// Which messages this store takes.
    takes: Takes,
}

/// The messages a store takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Takes {
    PointToPoint,
    Collectives,
}

impl Mailbox {
    /// A store for one sender's worth of fairness (tests).
    #[cfg(test)]
    pub fn new(max_count: usize, max_bytes: u64) -> Self {
        Self::with_senders(max_count, max_bytes, 1)
    }

    /// A store of point-to-point messages whose limits are shared fairly among `senders`
    /// senders (see the module docs).
    pub fn with_senders(max_count: usize, max_bytes: u64, senders: usize) -> Self {
        let senders = senders.max(1);
        Mailbox {
            state: Mutex::new(State::default()),
            room: Notify::new(),
            max_count,
            max_bytes,
            share_count: max_count / 2 / senders,
            share_bytes: max_bytes / 2 / senders as u64,
            takes: Takes::PointToPoint,
        }
    }

    /// A store of collective messages (keyed by `(comm, src, seq, part)`), its limits shared
    /// like [`with_senders`](Self::with_senders)'.
    pub fn for_collectives(max_count: usize, max_bytes: u64, senders: usize) -> Self {
        Mailbox { takes: Takes::Collectives, ..Self::with_senders(max_count, max_bytes, senders) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// Whether `src` may hold one more message of `len` bytes: within its own share, or in
    /// the pool (what the limits leave beyond every sender's share), and always within the
    /// limits. A sender that holds nothing takes any one message while nobody uses the pool,
    /// so every size the message limit allows gets through; one larger than the limits fills
    /// its sender's share and the pool, and costs the other senders nothing of theirs.
    fn has_room(&self, st: &State, src: u32, len: u64) -> bool {
        let (count, bytes) = st.per_src.get(&src).copied().unwrap_or_default();
        let (pool_max_count, pool_max_bytes) = self.pool();
        // What the senders hold beyond their shares (the pool's use), and what they hold in
        // all, each counted for no more than it may hold (its share and the pool): a message
        // larger than the limits weighs on its own sender's account only.
        let (mut pool_count, mut pool_bytes, mut held_count, mut held_bytes) = (0usize, 0u64, 0usize, 0u64);
        for &(c, b) in st.per_src.values() {
            pool_count += c.saturating_sub(self.share_count);
            pool_bytes += b.saturating_sub(self.share_bytes);
            held_count += c.min(self.share_count + pool_max_count);
            held_bytes += b.min(self.share_bytes + pool_max_bytes);
        }
        if held_count >= self.max_count {
            return false;
        }
        if count == 0 && pool_count == 0 && pool_bytes == 0 {
            return true;
        }
        if held_bytes.saturating_add(len) > self.max_bytes {
            return false;
        }
        if count < self.share_count && bytes + len <= self.share_bytes {
            return true;
        }
        // Beyond its share: the pool, with this message added to what the sender holds.
        let pool_count =
            pool_count - count.saturating_sub(self.share_count) + (count + 1).saturating_sub(self.share_count);
        let pool_bytes =
            pool_bytes - bytes.saturating_sub(self.share_bytes) + (bytes + len).saturating_sub(self.share_bytes);
        pool_count <= pool_max_count && pool_bytes <= pool_max_bytes
    }

    /// The pool: the half of the limits that is not reserved, as `(messages, bytes)`.
    fn pool(&self) -> (usize, u64) {
        (self.max_count - self.max_count / 2, self.max_bytes - self.max_bytes / 2)
    }

    /// Fails every waiting receive and every later one: the rank is shutting down.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        for (_, queue) in st.waiters.drain() {
            for (_, _, tx) in queue {
                let _ = tx.send(Err(Refusal::Closed));
            }
        }
        // Nobody will take the parked messages: let the links they hold up go.
        st.overflow.clear();
        self.room.notify_waiters();
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub(crate) async fn deliver_held(&self, key: Key, msg: Held) {
        let mut msg = msg;
        loop {
            // Made before the state is looked at, so a wake-up in between is not missed.
            let room = self.room.notified();
            match self.try_deliver(key, msg) {
                Delivered::Done => return,
                Delivered::Parked => break,
                // Another link's message is parked already: parking this one over it would
                // lose that message, so wait until it moves, then try again.
                Delivered::Busy(back) => {
                    msg = back;
                    room.await;
                }
            }
        }
        self.overflow_moved(key.src).await;
    }

    /// Waits until `src`'s parked message has moved (taken, held, or dropped).
    async fn overflow_moved(&self, src: u32) {
        loop {
            let notified = self.room.notified();
            if !self.lock().overflow.contains_key(&src) {
                return;
            }
            notified.await;
        }
    }

    /// Hands `msg` to a waiting receive, holds it, or parks it as its sender's overflow message.
    fn try_deliver(&self, key: Key, msg: Held) -> Delivered {
        let mut st = self.lock();
        self.deliver_locked(&mut st, key, msg)
    }

    /// Whether a message of `len` payload bytes for `key` is sure to be taken at once: dropped
    /// as late, or handed to a receive or held because its sender has room (a receive that
    /// waits for it may have been cancelled, so a waiter alone does not make sure).
    fn takes_now(&self, st: &State, key: &Key, len: u64) -> bool {
        st.closed || st.aborted.contains_key(&(key.comm, key.tag)) || self.has_room(st, key.src, len)
    }

    /// [`try_deliver`](Self::try_deliver) under the lock.
    fn deliver_locked(&self, st: &mut State, key: Key, mut msg: Held) -> Delivered {
        if st.closed || st.aborted.contains_key(&(key.comm, key.tag)) {
            return Delivered::Done;
        }
        if let Some(queue) = st.waiters.get_mut(&key) {
            while let Some((_, _, tx)) = queue.pop_front() {
                match tx.send(Ok(msg)) {
                    Ok(()) => {
                        if queue.is_empty() {
                            st.waiters.remove(&key);
                        }
                        return Delivered::Done;
                    }
                    // That receive was cancelled; try the next one.
                    Err(Ok(back)) => msg = back,
                    Err(Err(_)) => unreachable!("we only send Ok here"),
                }
            }
            st.waiters.remove(&key);
        }
        if self.has_room(st, key.src, msg.payload.len() as u64) {
            st.push_back(key, msg);
            return Delivered::Done;
        }
        if st.overflow.contains_key(&key.src) {
            return Delivered::Busy(msg);
        }
        let (count, bytes) = (st.count, st.bytes);
        let (src_count, src_bytes) = st.per_src.get(&key.src).copied().unwrap_or_default();
        tracing::warn!(
            src = key.src,
            held = count,
            held_bytes = bytes,
            from_src = src_count,
            from_src_bytes = src_bytes,
            "unmatched-message limit reached for this sender; pausing its link"
        );
        st.overflow.insert(key.src, (key, msg));
        // Every receive waiting on this sender is for a key that is not held and cannot arrive
        // while its link is paused: tell them now rather than let them time out.
        st.refuse_waiters_of(key.src);
        Delivered::Parked
    }

    /// The message a receive for `key` waits for, handed to it straight off its channel
    /// (see [`BulkChannel::deliver_ready`]): it goes to that receive without entering the
    /// store, so it takes no room there and costs no insertion or removal. Where it cannot go
    /// straight to the receive (an older message for `key` is held, an earlier receive of
    /// `key` waits for it, its collective was aborted, the rank is closing, or it is not for
    /// `key` after all) it is delivered as any message is, and `None` says to take from the
    /// store; a message this store does not take is dropped, as delivery drops it.
    ///
    /// [`BulkChannel::deliver_ready`]: crate::transport::bulk::BulkChannel::deliver_ready
    pub fn handed(&self, key: Key, incoming: Incoming) -> Option<Held> {
        let (handed, held) = match self.takes {
            Takes::PointToPoint => p2p_entry(incoming),
            Takes::Collectives => coll_entry(incoming),
        }?;
        let mut st = self.lock();
        let parked_older = st.overflow.get(&key.src).is_some_and(|(parked, _)| *parked == key);
        let older = parked_older || st.held.contains_key(&key);
        // Receives of one key are served in the order they were posted: one that waits
        // already comes first.
        let earlier_receive = st.waiters.contains_key(&key);
        if handed == key && !older && !earlier_receive && !st.closed && !st.aborted.contains_key(&(key.comm, key.tag)) {
            return Some(held);
        }
        if handed == key && older {
            // Behind the older ones, whatever the limits: the receive takes the oldest at once.
            if parked_older && let Some((parked, msg)) = st.overflow.remove(&key.src) {
                st.push_back(parked, msg);
                self.room.notify_waiters();
            }
            st.push_back(key, held);
            return None;
        }
        if let Delivered::Busy(back) = self.deliver_locked(&mut st, handed, held) {
            // Another message is parked already and this caller cannot wait: held over the
            // limits rather than lost.
            st.push_back(handed, back);
        }
        None
    }

    /// Whether the next message for `key` to arrive goes to a receive that spins for it
    /// without having registered a waiter: none is held (or parked) for `key`, and no
    /// registered receive waits for one.
    pub fn next_is_for_spinner(&self, key: Key) -> bool {
        let st = self.lock();
        let parked = st.overflow.get(&key.src).is_some_and(|(parked, _)| *parked == key);
        !parked && !st.held.contains_key(&key) && !st.waiters.contains_key(&key)
    }

    /// Takes the oldest message for `key` if one is there, without registering a waiter.
    pub fn try_take(&self, key: Key) -> Result<Option<Held>, Refusal> {
        let mut st = self.lock();
        if let Some(msg) = st.pop(&key) {
            self.made_room(&mut st);
            return Ok(Some(msg));
        }
        // As in `take_or_wait_for`: this rank shutting down says more than a peer being gone
        // (a spinning receive asks here first, and must fail as a parked one would).
        if st.closed {
            return Err(Refusal::Closed);
        }
        if let Some(aborted) = st.aborted.get(&(key.comm, key.tag)) {
            return Err(refusal(aborted));
        }
        if let Some(reason) = st.gone.get(&key.src) {
            return Err(Refusal::SourceGone(reason.clone()));
        }
        Ok(None)
    }

    /// Takes the oldest message for `key`, or registers a waiter for it.
    #[cfg(test)]
    pub fn take_or_wait(&self, key: Key) -> Result<Result<Held, PendingRecv<'_>>, Refusal> {
        self.take_or_wait_for(key, u64::MAX)
    }

    /// Like [`take_or_wait`](Self::take_or_wait), for a receive that takes at most `max_len`
    /// payload bytes: a larger message for `key` is read only if the limits have room for it.
    pub fn take_or_wait_for(&self, key: Key, max_len: u64) -> Result<Result<Held, PendingRecv<'_>>, Refusal> {
        let mut st = self.lock();
        if let Some(msg) = st.pop(&key) {
            self.made_room(&mut st);
            return Ok(Ok(msg));
        }
        if st.overflow.get(&key.src).is_some_and(|(k, _)| *k == key)
            && let Some((_, msg)) = st.overflow.remove(&key.src)
        {
            self.room.notify_waiters();
            return Ok(Ok(msg));
        }
        // This rank shutting down says more than any one peer being gone.
        if st.closed {
            return Err(Refusal::Closed);
        }
        if let Some(aborted) = st.aborted.get(&(key.comm, key.tag)) {
            return Err(refusal(aborted));
        }
        if let Some(reason) = st.gone.get(&key.src) {
            return Err(Refusal::SourceGone(reason.clone()));
        }
        // The sender waits unread on a message for another key: this receive could only wait
        // behind it, so it fails, unless room was made since and that message is about to be
        // read (its link has not run yet); then the receive waits, and is refused should the
        // sender pause again on another key.
        let blocked_behind = |&(paused, len): &(Key, u64)| paused != key && !self.has_room(&st, key.src, len);
        if st.overflow.contains_key(&key.src) || st.paused.get(&key.src).is_some_and(blocked_behind) {
            return Err(Refusal::Full { held: st.count, held_bytes: st.bytes });
        }
        // The message this receive asks for may be waiting unread on its link: wake it.
        if st.paused.get(&key.src).is_some_and(|(paused, _)| *paused == key) {
            self.room.notify_waiters();
        }
        let id = st.next_waiter;
        st.next_waiter += 1;
        let (tx, rx) = oneshot::channel();
        st.waiters.entry(key).or_default().push_back((id, max_len, tx));
        Ok(Err(PendingRecv { mailbox: self, key, id, rx: Some(rx) }))
    }

    /// After a message left the store: parked messages move in, and links waiting for room
    /// are woken.
    fn made_room(&self, st: &mut State) {
        self.refill(st);
        if !st.paused.is_empty() {
            self.room.notify_waiters();
        }
    }

    /// Moves parked messages into the store once there is room for them.
    fn refill(&self, st: &mut State) {
        let parked: Vec<u32> = st.overflow.keys().copied().collect();
        let mut moved = false;
        for src in parked {
            let fits = st.overflow.get(&src).is_some_and(|(_, msg)| self.has_room(st, src, msg.payload.len() as u64));
            if fits && let Some((key, msg)) = st.overflow.remove(&src) {
                st.push_back(key, msg);
                moved = true;
            }
        }
        if moved {
            self.room.notify_waiters();
        }
    }

    /// Marks everything with `(comm, tag)` (one collective) as aborted: its waiting receives
    /// fail with `reason`, its held messages are dropped, and so are its late arrivals.
    pub fn abort(&self, comm: u64, tag: u64, reason: &str) {
        self.abort_as(comm, tag, reason, false);
    }

    /// Like [`abort`](Self::abort), for a collective whose messages a failed link of this rank
    /// may have lost: receives fail with [`Refusal::LinkFailed`], so the executor tells the
    /// other ranks.
    pub fn fail_link(&self, comm: u64, tag: u64, reason: &str) {
        self.abort_as(comm, tag, reason, true);
    }

    fn abort_as(&self, comm: u64, tag: u64, reason: &str, link_failed: bool) {
        let mut st = self.lock();
        if st.aborted.contains_key(&(comm, tag)) {
            return;
        }
        let aborted = (reason.to_string(), link_failed);
        st.aborted.insert((comm, tag), aborted.clone());
        st.aborted_order.push_back((comm, tag));
        if st.aborted_order.len() > ABORTED_MEMORY
            && let Some(old) = st.aborted_order.pop_front()
        {
            st.aborted.remove(&old);
        }
        let matching = |k: &Key| k.comm == comm && k.tag == tag;
        let keys: Vec<Key> = st.waiters.keys().copied().filter(matching).collect();
        for k in keys {
            for (_, _, tx) in st.waiters.remove(&k).unwrap_or_default() {
                let _ = tx.send(Err(refusal(&aborted)));
            }
        }
        let keys: Vec<Key> = st.held.keys().copied().filter(matching).collect();
        for k in keys {
            while st.pop(&k).is_some() {}
        }
        let before = st.overflow.len();
        st.overflow.retain(|_, (k, _)| !matching(k));
        if st.overflow.len() != before || st.paused.values().any(|(k, _)| matching(k)) {
            self.room.notify_waiters();
        }
        self.made_room(&mut st);
    }

    /// Records that nothing more will come from `src`: receives waiting on it fail now, later
    /// ones fail at once, and messages it sent before are still delivered.
    pub fn source_gone(&self, src: u32, reason: &str) {
        let mut st = self.lock();
        st.gone.insert(src, reason.to_string());
        if st.paused.contains_key(&src) {
            self.room.notify_waiters();
        }
        let keys: Vec<Key> = st.waiters.keys().copied().filter(|k| k.src == src).collect();
        for k in keys {
            for (_, _, tx) in st.waiters.remove(&k).unwrap_or_default() {
                let _ = tx.send(Err(Refusal::SourceGone(reason.to_string())));
            }
        }
    }

    /// Returns a message that was taken but not consumed to the front of its queue.
    pub fn put_back(&self, key: Key, msg: Held) {
        self.lock().push_front(key, msg);
    }

    /// `(messages, bytes)` currently held.
    #[cfg(test)]
    pub fn held(&self) -> (usize, u64) {
        let st = self.lock();
        (st.count, st.bytes)
    }
}

/// A registered receive. Dropping it (a cancelled or timed-out `recv`) unregisters it, and a
/// message that was handed to it in the meantime goes back to the front of its queue.
pub(crate) struct PendingRecv<'a> {
    mailbox: &'a Mailbox,
    key: Key,
    id: u64,
    rx: Option<oneshot::Receiver<Result<Held, Refusal>>>,
}

impl PendingRecv<'_> {
    pub async fn wait(mut self) -> Result<Held, Refusal> {
        let rx = self.rx.as_mut().expect("present until completed");
        let result = rx.await.unwrap_or(Err(Refusal::Closed));
        self.rx = None;
        result
    }
}

impl Drop for PendingRecv<'_> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        let mut st = self.mailbox.lock();
        if let Some(queue) = st.waiters.get_mut(&self.key) {
            queue.retain(|(id, _, _)| *id != self.id);
            if queue.is_empty() {
                st.waiters.remove(&self.key);
            }
        }
        if let Ok(Ok(msg)) = rx.try_recv() {
            st.push_front(self.key, msg);
        }
    }
}

#[cfg(test)]
mod tests;
