//! Admission: whether a message announced on a link may be read off the wire yet.
//!
//! A message's header arrives before its payload, and says how long the payload is. The
//! payload is read only once the mailbox can take it: a receive waits for its key, or its
//! sender has room under the unmatched-message limits (its share, or the pool). Until then the
//! stream is not read, and QUIC's flow control holds the sender. What a peer has sent without
//! being asked therefore costs this rank no more memory than the limits allow, whether it is
//! held or still being read: admission reserves its bytes in the sender's account. (Before, a
//! message was read whole first and then parked, so each sender could make a rank hold one
//! message of up to `max_message_bytes` beyond the limits, per lane.)
//!
//! A message a receive waits for is read whatever the limits say, but only if it is no larger
//! than that receive takes, so what was asked for is bounded by what the receiver asked for. A
//! sender that holds nothing still gets any one message in while nobody uses the pool, so every
//! size the message limit allows gets through. One larger than the limits is charged to its
//! sender's share and the pool, never to the other senders' shares: they go on sending within
//! them, and only its sender's link pauses behind it. So the store holds at most the limits and
//! one message beyond them.

use std::time::Duration;

use super::{Key, Mailbox, State};
use crate::proto::message::PeerMsg;
use crate::transport::inbox::{Admitted, InboxWait};

/// How often a waiting link looks again, whatever it was woken by (a safety net: every change
/// that can admit a message also wakes the waiting links).
const RECHECK: Duration = Duration::from_millis(100);

/// The mailbox key of a message announced on a link by `from`: point-to-point messages by
/// `(comm, tag)`, collective ones by `(comm, seq, part)`. `None` for other messages.
pub(crate) fn key_of(msg: &PeerMsg, from: u32) -> Option<Key> {
    match *msg {
        PeerMsg::P2p { comm, tag, .. } | PeerMsg::P2pSegment { comm, tag, index: 0, .. } => {
            Some(Key { comm, src: from, tag, part: 0 })
        }
        // Later segments by message id, in parts no unsegmented message uses.
        PeerMsg::P2pSegment { comm, id, index, .. } => Some(Key { comm, src: from, tag: id, part: index }),
        PeerMsg::Coll { comm, seq, part, .. } => Some(Key { comm, src: from, tag: seq, part }),
        _ => None,
    }
}

/// Clears a sender's pause when the wait for its message ends, however it ends (admitted, or
/// the reading task dropped with its connection).
struct PauseGuard<'a> {
    mailbox: &'a Mailbox,
    key: Key,
}

impl Drop for PauseGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.mailbox.lock();
        if st.paused.get(&self.key.src).is_some_and(|(k, _)| *k == self.key) {
            st.paused.remove(&self.key.src);
        }
    }
}

impl Mailbox {
    /// Waits until the `len`-byte payload of a message for `key` may be read (see the module
    /// docs). While it waits, receives from the same sender for other keys fail at once, as
    /// they would for a paused link.
    /// (Lanes ask through `Inbox::admit`, which answers at once where it can.)
    #[cfg(test)]
    pub(crate) async fn admit_key(&self, key: Key, len: u64) -> Admitted<'_> {
        match self.admit_or_wait(key, len) {
            Ok(admitted) => admitted,
            Err(wait) => wait.await,
        }
    }

    /// Admits at once when it can; otherwise the sender is paused and this is `Err` with the
    /// wait, which clears the pause however it ends (even unpolled).
    pub(super) fn admit_or_wait(&self, key: Key, len: u64) -> Result<Admitted<'_>, InboxWait<'_, Admitted<'_>>> {
        match self.try_admit(key, len) {
            Some(admitted) => Ok(admitted),
            None => Err(Box::pin(self.admit_paused(PauseGuard { mailbox: self, key }, len))),
        }
    }

    async fn admit_paused(&self, pause: PauseGuard<'_>, len: u64) -> Admitted<'_> {
        let key = pause.key;
        let _pause = pause;
        loop {
            // Made before the state is looked at, so a wake-up in between is not missed.
            let woken = self.room.notified();
            if let Some(admitted) = self.try_admit(key, len) {
                return admitted;
            }
            let _ = tokio::time::timeout(RECHECK, woken).await;
        }
    }

    fn try_admit(&self, key: Key, len: u64) -> Option<Admitted<'_>> {
        let mut st = self.lock();
        // Delivered at once, or dropped: nothing to reserve.
        let unreserved = st.closed
            || st.aborted.contains_key(&(key.comm, key.tag))
            || st.gone.contains_key(&key.src)
            || st.waiters.get(&key).is_some_and(|queue| queue.iter().any(|(_, max, _)| len <= *max));
        if unreserved {
            return Some(Admitted::unreserved());
        }
        if self.has_room(&st, key.src, len) {
            st.count_in(key.src, len);
            return Some(Admitted::reserved(self, key.src, len));
        }
        if !st.paused.contains_key(&key.src) {
            pause(&mut st, key, len);
        }
        None
    }
}

/// Marks `key`'s sender as paused on its message of `len` bytes.
fn pause(st: &mut State, key: Key, len: u64) {
    let (src_count, src_bytes) = st.per_src.get(&key.src).copied().unwrap_or_default();
    tracing::warn!(
        src = key.src,
        held = st.count,
        held_bytes = st.bytes,
        from_src = src_count,
        from_src_bytes = src_bytes,
        waiting = len,
        "unmatched-message limit reached for this sender; its next message waits unread until a receive asks \
         for it or there is room"
    );
    st.paused.insert(key.src, (key, len));
    st.refuse_waiters_of(key.src);
}

#[cfg(test)]
mod tests {
    use super::super::{Held, Refusal};
    use super::*;
    use crate::transport::framed::Payload;
    use bytes::Bytes;
    use nexar_types::DType;

    fn key(src: u32, tag: u64) -> Key {
        Key { comm: 1, src, tag, part: 0 }
    }

    fn held(len: usize) -> Held {
        Held {
            dtype: DType::U8,
            count: len as u64,
            payload: Payload::from_bytes(Bytes::from(vec![7; len])),
            check: None,
            segments: None,
        }
    }

    /// A sender over its room waits unread, its other receives fail, and a receive for the
    /// waiting key admits it; room admits the next one.
    #[tokio::test]
    async fn a_message_without_room_waits_unread_until_it_is_asked_for() {
        // 2 senders: each may hold 100 bytes of its own, the pool another 200.
        let mailbox = Mailbox::with_senders(100, 800, 2);
        let first = mailbox.admit_key(key(1, 1), 300).await;
        drop(first);
        mailbox.deliver_held(key(1, 1), held(300)).await;
        assert_eq!(mailbox.held(), (1, 300));
        // 400 more from the same sender does not fit its share and the pool.
        let mut waiting = Box::pin(mailbox.admit_key(key(1, 2), 400));
        assert!(futures_poll_once(&mut waiting).await.is_none(), "admitted without room");
        // Another key from the paused sender fails at once, as on a paused link.
        assert!(matches!(mailbox.take_or_wait(key(1, 9)), Err(Refusal::Full { .. })));
        // Another sender still has its share.
        drop(mailbox.admit_key(key(2, 1), 100).await);
        // A receive for the waiting key lets it be read, reserving nothing.
        let pending = mailbox.take_or_wait(key(1, 2)).unwrap().unwrap_err();
        let admitted = tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("a receive admits it");
        assert_eq!(admitted.reserved_bytes(), None);
        drop(admitted);
        mailbox.deliver_held(key(1, 2), held(400)).await;
        assert_eq!(pending.wait().await.unwrap().payload.len(), 400);
    }

    /// What is being read counts as held: two streams cannot both take the last room, and the
    /// "any one message" of a sender that holds nothing admits only one oversized message at a
    /// time.
    #[tokio::test]
    async fn messages_being_read_count_against_the_limits() {
        let mailbox = Mailbox::with_senders(100, 1000, 1);
        let big = mailbox.admit_key(key(1, 1), 5000).await;
        assert_eq!(mailbox.held(), (1, 5000));
        let mut second = Box::pin(mailbox.admit_key(key(2, 1), 5000));
        assert!(futures_poll_once(&mut second).await.is_none(), "a second oversized message was admitted");
        drop(big);
        assert_eq!(mailbox.held(), (0, 0));
        let second = tokio::time::timeout(Duration::from_secs(5), second).await.expect("room admits it");
        assert_eq!(second.reserved_bytes(), Some(5000));
    }

    /// Room is made while a sender waits unread on one key, and a receive for another of its
    /// keys comes before the sender's link has run: the receive waits (the waiting message
    /// is about to be read), instead of failing as it would while the store is still full.
    /// Should the sender then pause again on a third key, the receive fails.
    #[tokio::test]
    async fn a_receive_made_after_room_is_made_waits_for_the_paused_link() {
        let mailbox = Mailbox::new(2, 1 << 20);
        for tag in [1, 2] {
            drop(mailbox.admit_key(key(1, tag), 10).await);
            mailbox.deliver_held(key(1, tag), held(10)).await;
        }
        let mut waiting = Box::pin(mailbox.admit_key(key(1, 3), 10));
        assert!(futures_poll_once(&mut waiting).await.is_none(), "admitted without room");
        assert!(matches!(mailbox.take_or_wait(key(1, 9)), Err(Refusal::Full { .. })), "the store is full");
        // Room: message 1 is taken. Before the link runs again, a receive for key 4.
        assert!(matches!(mailbox.take_or_wait(key(1, 1)), Ok(Ok(_))));
        let pending = match mailbox.take_or_wait(key(1, 4)) {
            Ok(Err(pending)) => pending,
            other => panic!("a receive after room was made should wait: {:?}", other.map(|r| r.is_ok())),
        };
        // The link reads message 3 (the store is full again), then pauses on message 5.
        drop(tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("room admits it"));
        mailbox.deliver_held(key(1, 3), held(10)).await;
        let mut fifth = Box::pin(mailbox.admit_key(key(1, 5), 10));
        assert!(futures_poll_once(&mut fifth).await.is_none());
        assert!(matches!(pending.wait().await, Err(Refusal::Full { .. })), "refused once the link pauses again");
    }

    /// A message larger than the limits, admitted while nobody used the pool and then read
    /// slowly (a member that announced 3 GiB and stalled), fills its sender's share and the
    /// pool only: another sender still gets its share's messages in unasked, and is paused only
    /// past its share; the oversized sender's next message waits.
    #[tokio::test]
    async fn an_oversized_message_costs_the_other_senders_nothing_of_their_shares() {
        // 2 senders: each may hold 2 messages and 250 bytes of its own, the pool 4 and 500.
        let mailbox = Mailbox::with_senders(8, 1000, 2);
        let oversized = mailbox.admit_key(key(1, 1), 3 << 30).await;
        assert_eq!(oversized.reserved_bytes(), Some(3 << 30));
        for tag in [50, 51] {
            let admitted = tokio::time::timeout(Duration::from_secs(5), mailbox.admit_key(key(2, tag), 100))
                .await
                .unwrap_or_else(|_| panic!("sender 2's message {tag} waits behind sender 1's oversized one"));
            drop(admitted);
            mailbox.deliver_held(key(2, tag), held(100)).await;
        }
        // A receive for sender 2's later message takes it; the earlier one is still held.
        assert!(matches!(mailbox.take_or_wait(key(2, 51)), Ok(Ok(_))));
        assert!(matches!(mailbox.take_or_wait(key(2, 50)), Ok(Ok(_))));
        // Past its share, sender 2 finds the pool taken: only then does it wait.
        for tag in [52, 53] {
            drop(mailbox.admit_key(key(2, tag), 100).await);
            mailbox.deliver_held(key(2, tag), held(100)).await;
        }
        let mut third = Box::pin(mailbox.admit_key(key(2, 54), 100));
        assert!(futures_poll_once(&mut third).await.is_none(), "sender 2 went past its share into a full pool");
        drop(third);
        // Sender 1's next message waits, and its other receives fail as on a paused link.
        let mut next = Box::pin(mailbox.admit_key(key(1, 2), 4));
        assert!(futures_poll_once(&mut next).await.is_none(), "sender 1 went past its share and the pool");
        assert!(matches!(mailbox.take_or_wait(key(1, 9)), Err(Refusal::Full { .. })));
        drop(next);
        drop(oversized);
        assert_eq!(mailbox.held(), (2, 200));
    }

    async fn futures_poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        tokio::time::timeout(Duration::from_millis(50), f).await.ok()
    }
}
