//! Checks of point-to-point messages over a link's bulk channel (shared memory with a rank of
//! the same host, the TCP lane with one of another), shared by the tests of each transport.

use std::time::Duration;

use nexar::prelude::*;
use nexar::{NexarClient, P2pError};

/// The `i`-th element of point-to-point message `m` from rank `from`.
pub fn p2p_value(from: usize, m: usize, i: usize) -> u32 {
    (from as u32 + 1).wrapping_mul(2_654_435_761).wrapping_add((m * 1_000_003 + i) as u32)
}

/// Sends rank `c`'s messages of every length in `lens` to `peer` and receives the peer's,
/// on two tags whose messages are received in another order than they were sent (every odd
/// message first, then the even ones): each arrives whole, every element checked, each tag's
/// messages in the order they were sent; then a receive into a buffer of its own type. Returns
/// the QUIC datagrams this rank sent to the peer meanwhile.
pub async fn exchange_in_order(c: &NexarClient, peer: usize, lens: &[usize]) -> u64 {
    let tag = |m: usize| 10 + (m % 2) as u64;
    let before = c.link_stats(peer).expect("a direct link").sent_packets;
    let sending = async {
        for (m, &len) in lens.iter().enumerate() {
            let data: Vec<u32> = (0..len).map(|i| p2p_value(c.rank(), m, i)).collect();
            c.send(&data[..], peer, tag(m)).await.unwrap();
        }
    };
    let receiving = async {
        let order = (0..lens.len()).filter(|m| m % 2 == 1).chain((0..lens.len()).filter(|m| m % 2 == 0));
        for m in order {
            let got: Vec<u32> = c.recv_vec(peer, tag(m)).await.unwrap();
            assert_eq!(got.len(), lens[m], "rank {} message {m}", c.rank());
            if let Some(i) = (0..got.len()).find(|&i| got[i] != p2p_value(peer, m, i)) {
                panic!("rank {} message {m}: element {i} is {}, not {}", c.rank(), got[i], p2p_value(peer, m, i));
            }
        }
    };
    tokio::join!(sending, receiving);
    let mut buf = vec![0u32; 70_000];
    let data: Vec<u32> = (0..70_000).map(|i| p2p_value(c.rank(), 99, i)).collect();
    let (sent, received) = tokio::join!(c.send(&data[..], peer, 5), c.recv(&mut buf[..], peer, 5));
    sent.unwrap();
    received.unwrap();
    assert!((0..buf.len()).all(|i| buf[i] == p2p_value(peer, 99, i)), "rank {}: the typed receive", c.rank());
    c.link_stats(peer).expect("a direct link").sent_packets - before
}

/// Breaks the `transport` link between ranks 0 and 1 after a message has crossed it: rank 1's
/// receives from rank 0 fail at once naming the link (some messages may be lost), what
/// arrived before is still received, rank 0's sends to rank 1 fail too, and the link's
/// collectives go on over QUIC. The ranks are shut down at the end.
pub async fn broken_link_fails_point_to_point(ranks: &[NexarClient], transport: &str) {
    let (r0, r1) = (ranks[0].clone(), ranks[1].clone());
    assert_eq!(r0.bulk_transport(1), Some(transport));
    let early: Vec<u32> = (0..50_000).map(|i| p2p_value(0, 1, i)).collect();
    r0.send(&early[..], 1, 1).await.unwrap();
    // The barrier's messages come after it on the same link: once both passed it, the early
    // message has arrived at rank 1.
    tokio::join!(async { r0.barrier().await.unwrap() }, async { r1.barrier().await.unwrap() });
    assert!(r0.inject_bulk_fault(1), "rank 0 has a {transport} link to rank 1");
    let mut late = [0u32; 8];
    match r1.recv(&mut late[..], 0, 2).await {
        Err(P2pError::PeerGone { peer: 0, reason, .. }) => {
            assert!(reason.contains(transport) && reason.contains("may be lost"), "{reason}");
        }
        other => panic!("a receive after the link broke: {other:?}"),
    }
    let got: Vec<u32> = r1.recv_vec(0, 1).await.unwrap();
    assert_eq!(got, early, "the message that arrived before the link broke");
    match r0.send(&[1u32; 8][..], 1, 2).await {
        Err(P2pError::Transport { peer: 1, .. }) => {}
        other => panic!("a send after the link broke: {other:?}"),
    }
    assert_ne!(r0.bulk_transport(1), Some(transport));
    let n = ranks.len() as i64;
    super::on_each(ranks, move |c| async move {
        let mut x = vec![1i64; 1 << 18];
        c.all_reduce(&mut x, Sum).await.unwrap();
        assert!(x.iter().all(|v| *v == n), "rank {}", c.rank());
        c.shutdown().await;
    })
    .await;
}

/// A generous operation timeout for the tests above, which wait on failures, not timeouts.
pub const LONG_OP_TIMEOUT: Duration = Duration::from_secs(120);
