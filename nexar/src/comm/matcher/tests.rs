//! Tests of the mailbox: matching by tag, the limits, aborts and gone sources.

use super::*;
use bytes::Bytes;
use nexar_types::DType;

use crate::transport::framed::Payload;

fn held(n: u8) -> Held {
    Held { dtype: DType::U8, count: 1, payload: Payload::from_bytes(Bytes::from(vec![n])), check: None, segments: None }
}

fn key(tag: u64) -> Key {
    Key { comm: 0, src: 1, tag, part: 0 }
}

fn first_byte(h: &Held) -> u8 {
    let mut b = [0u8];
    h.payload.copy_to(&mut b).unwrap();
    b[0]
}

#[tokio::test]
async fn held_messages_are_matched_by_tag_in_order() {
    let mb = Mailbox::new(8, 1 << 20);
    mb.deliver_held(key(2), held(20)).await;
    mb.deliver_held(key(1), held(10)).await;
    mb.deliver_held(key(2), held(21)).await;
    let take = |t| match mb.take_or_wait(key(t)) {
        Ok(Ok(h)) => first_byte(&h),
        _ => panic!("expected a held message"),
    };
    assert_eq!(take(1), 10);
    assert_eq!(take(2), 20);
    assert_eq!(take(2), 21);
    assert_eq!(mb.held(), (0, 0));
}

#[tokio::test]
async fn a_full_store_refuses_unmatched_receives_and_loses_nothing() {
    let mb = std::sync::Arc::new(Mailbox::new(2, 1 << 20));
    mb.deliver_held(key(1), held(1)).await;
    mb.deliver_held(key(2), held(2)).await;
    let mb2 = mb.clone();
    let blocked = tokio::spawn(async move { mb2.deliver_held(key(3), held(3)).await });
    tokio::task::yield_now().await;
    while mb.lock().overflow.is_empty() {
        tokio::task::yield_now().await;
    }
    assert!(matches!(mb.take_or_wait(key(9)), Err(Refusal::Full { held: 2, .. })));
    // The parked message is still reachable by its own tag.
    match mb.take_or_wait(key(3)) {
        Ok(Ok(h)) => assert_eq!(first_byte(&h), 3),
        _ => panic!("overflow message lost"),
    }
    blocked.await.unwrap();
    for t in [1, 2] {
        assert!(matches!(mb.take_or_wait(key(t)), Ok(Ok(_))));
    }
}

#[tokio::test]
async fn two_links_meeting_a_full_store_both_get_their_message_through() {
    let mb = std::sync::Arc::new(Mailbox::new(1, 1 << 20));
    mb.deliver_held(key(1), held(1)).await;
    let blocked: Vec<_> = [2u8, 3]
        .into_iter()
        .map(|t| {
            let mb = mb.clone();
            tokio::spawn(async move { mb.deliver_held(key(u64::from(t)), held(t)).await })
        })
        .collect();
    while mb.lock().overflow.is_empty() {
        tokio::task::yield_now().await;
    }
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // Taking what is held makes room, one message at a time; none is lost.
    let mut seen = Vec::new();
    for t in [1u64, 2, 3] {
        let h = loop {
            match mb.take_or_wait(key(t)) {
                Ok(Ok(h)) => break h,
                Ok(Err(pending)) => break pending.wait().await.unwrap(),
                Err(_) => tokio::task::yield_now().await,
            }
        };
        seen.push(first_byte(&h));
    }
    assert_eq!(seen, [1, 2, 3]);
    for b in blocked {
        b.await.unwrap();
    }
}

/// Sender 1 floods the store with messages nobody asked for: it fills its share and the
/// pool, and only its own link pauses. Sender 2 keeps its share, and a receive waiting on
/// sender 2 is not failed.
#[tokio::test]
async fn one_flooding_sender_pauses_only_its_own_link() {
    let mb = std::sync::Arc::new(Mailbox::with_senders(8, 1 << 20, 2));
    let from = |src: u32, tag: u64| Key { comm: 0, src, tag, part: 0 };
    let waiting = match mb.take_or_wait(from(2, 99)) {
        Ok(Err(p)) => p,
        _ => panic!("nothing held from rank 2 yet"),
    };
    // Share 8/2/2 = 2, pool 4: six messages fit, the seventh parks.
    for t in 0..6 {
        mb.deliver_held(from(1, t), held(t as u8)).await;
    }
    let flood = {
        let mb = mb.clone();
        tokio::spawn(async move { mb.deliver_held(from(1, 6), held(6)).await })
    };
    while mb.lock().overflow.is_empty() {
        tokio::task::yield_now().await;
    }
    assert!(matches!(mb.take_or_wait(from(1, 50)), Err(Refusal::Full { .. })), "rank 1's link is paused");
    // Rank 2 still delivers within its share, without waiting, and its receive is served.
    mb.deliver_held(from(2, 1), held(21)).await;
    mb.deliver_held(from(2, 99), held(99)).await;
    assert_eq!(first_byte(&waiting.wait().await.unwrap()), 99);
    match mb.take_or_wait(from(2, 1)) {
        Ok(Ok(h)) => assert_eq!(first_byte(&h), 21),
        _ => panic!("rank 2's message was not held"),
    }
    // Taking rank 1's messages lets its link go on; nothing is lost.
    for t in 0..7u64 {
        match mb.take_or_wait(from(1, t)) {
            Ok(Ok(h)) => assert_eq!(u64::from(first_byte(&h)), t),
            _ => panic!("rank 1's message {t} was lost"),
        }
    }
    flood.await.unwrap();
    assert_eq!(mb.held(), (0, 0));
}

#[tokio::test]
async fn an_abort_fails_waiters_drops_stale_messages_and_late_arrivals() {
    let mb = Mailbox::new(8, 1 << 20);
    mb.deliver_held(key(7), held(1)).await;
    let other = Key { comm: 0, src: 2, tag: 7, part: 0 };
    let pending = match mb.take_or_wait(other) {
        Ok(Err(p)) => p,
        _ => panic!("nothing held for rank 2 yet"),
    };
    mb.abort(0, 7, "rank 3 saw a count mismatch");
    assert_eq!(pending.wait().await.unwrap_err(), Refusal::Aborted("rank 3 saw a count mismatch".into()));
    assert_eq!(mb.held(), (0, 0));
    mb.deliver_held(key(7), held(2)).await;
    assert_eq!(mb.held(), (0, 0));
    assert!(matches!(mb.take_or_wait(key(7)), Err(Refusal::Aborted(_))));
    // Other tags are untouched.
    mb.deliver_held(key(8), held(3)).await;
    assert!(matches!(mb.take_or_wait(key(8)), Ok(Ok(_))));
}

#[tokio::test]
async fn a_gone_source_fails_its_receives_but_keeps_what_it_sent() {
    let mb = Mailbox::new(8, 1 << 20);
    mb.deliver_held(key(1), held(11)).await;
    let pending = match mb.take_or_wait(key(2)) {
        Ok(Err(p)) => p,
        _ => panic!("nothing held for tag 2"),
    };
    mb.source_gone(1, "connection lost");
    assert_eq!(pending.wait().await.unwrap_err(), Refusal::SourceGone("connection lost".into()));
    assert!(matches!(mb.take_or_wait(key(1)), Ok(Ok(_))), "what it sent before is delivered");
    assert!(matches!(mb.take_or_wait(key(1)), Err(Refusal::SourceGone(_))));
}

#[tokio::test]
async fn a_closed_rank_refuses_as_closed_whether_the_receive_spins_or_waits() {
    let mb = Mailbox::new(8, 1 << 20);
    mb.deliver_held(key(1), held(11)).await;
    mb.source_gone(1, "connection lost");
    mb.close();
    // A spinning receive (`try_take`) and a parked one (`take_or_wait`) get the same answer:
    // the rank's own shutdown, not the peer that went first.
    assert_eq!(mb.try_take(key(2)).unwrap_err(), Refusal::Closed);
    assert!(matches!(mb.take_or_wait(key(2)), Err(Refusal::Closed)));
}

#[tokio::test]
async fn a_cancelled_receive_gives_its_message_back() {
    let mb = Mailbox::new(8, 1 << 20);
    let pending = match mb.take_or_wait(key(5)) {
        Ok(Err(p)) => p,
        _ => panic!("nothing held yet"),
    };
    mb.deliver_held(key(5), held(55)).await;
    drop(pending);
    match mb.take_or_wait(key(5)) {
        Ok(Ok(h)) => assert_eq!(first_byte(&h), 55),
        _ => panic!("message lost with the cancelled receive"),
    }
}
