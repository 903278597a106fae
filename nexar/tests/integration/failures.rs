//! A rank that dies (here: `abort`, which closes its connections without a goodbye) turns the
//! pending work of every other rank into prompt errors that name it; what it sent before is
//! still delivered, and the survivors keep talking to each other.

use std::time::{Duration, Instant};

use nexar::prelude::*;
use nexar::{CollectiveError, P2pError};

use crate::common::TEST_LIMIT;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_rank_fails_pending_collectives_and_receives_promptly() {
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(3).await.unwrap();
        let (a, b, dying) = (ranks[0].clone(), ranks[1].clone(), ranks[2].clone());
        dying.send(&[42u32], 0, 9).await.unwrap();
        // Give the message time to arrive before the connection goes away.
        let mut early = [0u32];
        a.recv(&mut early, 2, 9).await.unwrap();
        dying.send(&[43u32], 0, 10).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;

        let start = Instant::now();
        let survivors: Vec<_> = [a.clone(), b.clone()]
            .into_iter()
            .map(|c| tokio::spawn(async move { c.all_reduce(&mut vec![1.0f32; 1 << 16], Sum).await }))
            .collect();
        let pending_recv = tokio::spawn({
            let b = b.clone();
            async move { b.recv_vec::<u8>(2, 77).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        dying.abort("simulated crash");

        for s in survivors {
            let err = s.await.unwrap().expect_err("a collective with a dead member must fail");
            assert!(start.elapsed() < Duration::from_secs(5), "took {:?}: {err}", start.elapsed());
            assert!(
                matches!(&err, CollectiveError::PeerGone { peer: 2, .. } | CollectiveError::Aborted { .. }),
                "{err}"
            );
            assert!(err.to_string().contains("rank 2"), "{err}");
        }
        let err = pending_recv.await.unwrap().unwrap_err();
        assert!(
            matches!(&err, P2pError::PeerGone { peer: 2, reason, .. } if reason.contains("simulated crash")),
            "{err}"
        );
        // What the dead rank sent before it died is still delivered.
        let mut late = [0u32];
        a.recv(&mut late, 2, 10).await.unwrap();
        assert_eq!(late, [43]);
        // The survivors still talk to each other.
        a.send(&[1u8], 1, 5).await.unwrap();
        assert_eq!(b.recv_vec::<u8>(0, 5).await.unwrap(), vec![1]);
    })
    .await
    .expect("test timed out");
}

/// Liveness traffic does not grow with the cluster: each rank sends heartbeats to the three
/// ranks that watch it (its predecessors around the ring), not to every peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_beats_to_the_three_that_watch_it_not_to_every_peer() {
    tokio::time::timeout(TEST_LIMIT, async {
        let interval = Duration::from_millis(200);
        let cfg = NexarConfig::builder()
            .heartbeat_interval(interval)
            .heartbeat_timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let ranks = NexarClient::bootstrap_local_each(vec![cfg; 8]).await.unwrap();
        let before: Vec<u64> = ranks.iter().map(|r| r.liveness_sent()).collect();
        let start = Instant::now();
        tokio::time::sleep(Duration::from_secs(4)).await;
        let beats = (start.elapsed().as_secs_f64() / interval.as_secs_f64()).ceil() as u64 + 1;
        for (r, before) in ranks.iter().zip(before) {
            let sent = r.liveness_sent() - before;
            // Three watchers get a beat per interval; a full mesh would send seven.
            assert!(sent <= 3 * beats + 6, "rank {} sent {sent} liveness messages in {beats} intervals", r.rank());
            assert!(sent > 0, "rank {} sent no heartbeat at all", r.rank());
        }
        assert!(ranks.iter().all(|r| r.failed_ranks().is_empty()));
        let leaving: Vec<_> = ranks.into_iter().map(|r| tokio::spawn(async move { r.shutdown().await })).collect();
        for l in leaving {
            l.await.unwrap();
        }
    })
    .await
    .expect("test timed out");
}
