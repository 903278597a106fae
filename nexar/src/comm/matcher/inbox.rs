//! The matcher as a lane's store: what transport asks of it (`transport::inbox::Inbox`),
//! answered at once where it can.

use super::{Delivered, Key, Mailbox, Takes, coll_entry, key_of, p2p_entry};
use crate::proto::message::PeerMsg;
use crate::transport::inbox::{Admission, Delivery, Inbox};
use crate::transport::link::Incoming;

impl Mailbox {
    /// The key of `msg` from `from` here, if this store takes it.
    fn key_here(&self, msg: &PeerMsg, from: u32) -> Option<Key> {
        match (self.takes, msg) {
            (Takes::PointToPoint, PeerMsg::P2p { .. } | PeerMsg::P2pSegment { .. })
            | (Takes::Collectives, PeerMsg::Coll { .. }) => key_of(msg, from),
            _ => None,
        }
    }
}

impl Inbox for Mailbox {
    fn admit(&self, msg: &PeerMsg, from: u32, len: u64) -> Option<Admission<'_>> {
        let key = self.key_here(msg, from)?;
        Some(match self.admit_or_wait(key, len) {
            Ok(admitted) => Admission::Now(admitted),
            Err(wait) => Admission::Wait(wait),
        })
    }

    fn deliver(&self, incoming: Incoming) -> Delivery<'_> {
        let entry = match self.takes {
            Takes::PointToPoint => p2p_entry(incoming),
            Takes::Collectives => coll_entry(incoming),
        };
        let Some((key, held)) = entry else { return Delivery::Done };
        match self.try_deliver(key, held) {
            Delivered::Done => Delivery::Done,
            Delivered::Parked => Delivery::Wait(Box::pin(self.overflow_moved(key.src))),
            Delivered::Busy(back) => Delivery::Wait(Box::pin(self.deliver_held(key, back))),
        }
    }

    fn deliver_now(&self, incoming: Incoming) -> Option<Incoming> {
        // Not this store's: ignored (taken), as `deliver` ignores it.
        let key = self.key_here(&incoming.msg, incoming.from)?;
        let mut st = self.lock();
        if !self.takes_now(&st, &key, incoming.payload.len() as u64) {
            return Some(incoming);
        }
        let entry = match self.takes {
            Takes::PointToPoint => p2p_entry(incoming),
            Takes::Collectives => coll_entry(incoming),
        };
        if let Some((key, held)) = entry {
            // Taken at once: `takes_now` said so under this same lock.
            let _ = self.deliver_locked(&mut st, key, held);
        }
        None
    }

    fn release(&self, from: u32, len: u64) {
        let mut st = self.lock();
        st.count_out(from, len);
        self.made_room(&mut st);
    }

    fn lost(&self, collectives: Vec<(u64, u64)>, reason: &str) {
        for (comm, seq) in collectives {
            self.fail_link(comm, seq, reason);
        }
    }

    fn lost_from(&self, from: u32, reason: &str) {
        if self.takes == Takes::PointToPoint {
            self.source_gone(from, reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use nexar_types::DType;

    use super::super::{Key, Refusal};
    use super::*;
    use crate::proto::message::CollHeader;
    use crate::transport::framed::Payload;

    fn coll(seq: u64) -> PeerMsg {
        let header =
            CollHeader { kind: 0, op: 0, dtype: DType::U8.to_wire(), root: 0, count: 4, fingerprint: 0, segment: 0 };
        PeerMsg::Coll { comm: 9, seq, header, part: 0, len: 4 }
    }

    fn incoming(msg: PeerMsg) -> Incoming {
        Incoming::new(1, msg, Payload::from_bytes(Bytes::from_static(&[1, 2, 3, 4])))
    }

    fn key(seq: u64) -> Key {
        Key { comm: 9, src: 1, tag: seq, part: 0 }
    }

    /// What a lane sees: a collective store admits and takes collective messages at once,
    /// leaves other messages alone, and gives back what an admission reserved.
    #[tokio::test]
    async fn a_lane_hands_messages_over_through_the_inbox() {
        let store = Mailbox::for_collectives(16, 1 << 20, 2);
        let inbox: &dyn Inbox = &store;
        let p2p = PeerMsg::P2p { comm: 9, tag: 1, dtype: DType::U8.to_wire(), count: 4 };
        assert!(inbox.admit(&p2p, 1, 4).is_none(), "a point-to-point message is not the collective store's");
        let Some(Admission::Now(admitted)) = inbox.admit(&coll(1), 1, 4) else {
            panic!("an empty store admits at once")
        };
        assert_eq!(admitted.reserved_bytes(), Some(4));
        assert_eq!(store.held(), (1, 4), "what is being read counts as held");
        drop(admitted);
        assert_eq!(store.held(), (0, 0));
        assert!(matches!(inbox.deliver(incoming(coll(1))), Delivery::Done));
        assert!(matches!(inbox.deliver(incoming(p2p)), Delivery::Done), "ignored, not held");
        assert_eq!(store.held(), (1, 4));
        let held = store.try_take(key(1)).unwrap().expect("the collective message is held");
        assert_eq!(held.payload.len(), 4);
    }

    /// `deliver_now` takes a message only when it is sure to be taken at once, and otherwise
    /// gives it back whole, parking nothing: a full store refuses it until a receive takes
    /// what it holds; a late message (its collective aborted) is dropped at once.
    #[tokio::test]
    async fn deliver_now_takes_only_what_it_can_take_at_once() {
        // Room for four 4-byte messages in all (two in the sender's share, two in the pool).
        let store = Mailbox::for_collectives(4, 16, 1);
        let inbox: &dyn Inbox = &store;
        for seq in 1..=4 {
            assert!(inbox.deliver_now(incoming(coll(seq))).is_none(), "message {seq}");
        }
        let back = inbox.deliver_now(incoming(coll(5))).expect("the store is full");
        assert!(matches!(back.msg, PeerMsg::Coll { seq: 5, .. }), "given back whole");
        assert_eq!(back.payload.len(), 4);
        assert_eq!(store.held(), (4, 16), "nothing parked");
        assert_eq!(store.try_take(key(1)).unwrap().map(|h| h.payload.len()), Some(4));
        assert!(inbox.deliver_now(back).is_none(), "taken once there is room");
        store.abort(9, 7, "gone");
        assert!(inbox.deliver_now(incoming(coll(7))).is_none(), "a late message is dropped");
        assert_eq!(store.held(), (4, 16));
        assert!(
            inbox.deliver_now(incoming(PeerMsg::P2p { comm: 9, tag: 1, dtype: 0, count: 4 })).is_none(),
            "not this store's: ignored"
        );
    }

    /// A message a channel hands straight to the receive that waits for it goes to that
    /// receive without ever being held; one handed for the wrong key is delivered as usual,
    /// and one this store does not take is dropped as delivery drops it. Behind an older
    /// message for its key it waits its turn, behind an earlier receive of its key it goes to
    /// that one, and an aborted collective's is dropped.
    #[tokio::test]
    async fn a_message_handed_to_its_receive_never_enters_the_store() {
        let store = Mailbox::for_collectives(16, 1 << 20, 2);
        let held = store.handed(key(1), incoming(coll(1))).expect("the awaited message");
        assert_eq!((held.count, held.payload.len()), (4, 4));
        assert!(held.check.is_some(), "what the sender called travels with it");
        assert_eq!(store.held(), (0, 0), "nothing held, nothing reserved");
        assert!(store.handed(key(1), incoming(coll(2))).is_none(), "another collective's message");
        assert_eq!(store.held(), (1, 4), "delivered into the store, not lost");
        assert!(store.handed(key(2), incoming(coll(2))).is_none(), "an older one is held");
        assert_eq!(store.held(), (2, 8), "held behind it");
        for _ in 0..2 {
            assert_eq!(store.try_take(key(2)).unwrap().map(|h| h.payload.len()), Some(4));
        }
        let p2p = PeerMsg::P2p { comm: 9, tag: 1, dtype: DType::U8.to_wire(), count: 4 };
        assert!(store.handed(key(1), incoming(p2p)).is_none());
        assert_eq!(store.held(), (0, 0), "not this store's: ignored");
        store.abort(9, 3, "gone");
        assert!(store.handed(key(3), incoming(coll(3))).is_none(), "aborted");
        assert_eq!(store.held(), (0, 0), "a late message is dropped");
        assert!(matches!(store.try_take(key(3)), Err(Refusal::Aborted(_))));
        // A point-to-point store: the same for a message sent whole.
        let p2p_store = Mailbox::with_senders(16, 1 << 20, 2);
        let p2p = PeerMsg::P2p { comm: 9, tag: 1, dtype: DType::U8.to_wire(), count: 4 };
        let held = p2p_store.handed(key(1), incoming(p2p.clone())).expect("the awaited message");
        assert_eq!(held.payload.len(), 4);
        assert_eq!(p2p_store.held(), (0, 0));
        assert!(p2p_store.handed(key(1), incoming(coll(1))).is_none(), "a collective is not this store's");
        assert_eq!(p2p_store.held(), (0, 0));
        // A receive of the same key posted earlier, and waiting, gets it first.
        let Err(earlier) = p2p_store.take_or_wait_for(key(1), 1 << 20).unwrap() else { panic!("nothing is held") };
        assert!(p2p_store.handed(key(1), incoming(p2p)).is_none(), "the earlier receive's");
        assert_eq!(earlier.wait().await.map(|h| h.payload.len()), Ok(4));
        assert_eq!(p2p_store.held(), (0, 0));
    }

    /// A failed channel's word on what it carried fails only those collectives: one that
    /// never used the channel goes on.
    #[tokio::test]
    async fn lost_fails_only_what_it_names() {
        let store = Mailbox::for_collectives(16, 1 << 20, 2);
        let inbox: &dyn Inbox = &store;
        inbox.lost(vec![(9, 2), (9, 4)], "the channel failed");
        for seq in [2, 4] {
            assert!(matches!(store.try_take(key(seq)), Err(Refusal::LinkFailed(r)) if r.contains("channel failed")));
        }
        assert!(matches!(store.try_take(key(3)), Ok(None)), "a collective nobody named goes on");
    }
}
