//! An idle cluster stays healthy: after a long silence (only heartbeats and QUIC keep-alives),
//! messages, RPC and collectives still work and nobody was declared dead. The silence lasts
//! `NEXAR_IDLE_TEST_SECS` (default 8 s, with heartbeats and the QUIC idle timeout shortened so
//! that it spans many of both); run it with 900 for the 15-minute check.

use std::time::Duration;

use nexar::prelude::*;

use crate::common;

#[nexar::rpc]
fn still_there(x: u64) -> u64 {
    x + 1
}

async fn round(ranks: &[NexarClient], tag: u64) {
    let tasks: Vec<_> = ranks
        .iter()
        .cloned()
        .map(|c| {
            tokio::spawn(async move {
                let (r, w) = (c.rank(), c.world_size());
                c.send(&[r as u64, tag], (r + 1) % w, tag).await.unwrap();
                let got = c.recv_vec::<u64>((r + w - 1) % w, tag).await.unwrap();
                assert_eq!(got, vec![((r + w - 1) % w) as u64, tag]);
                assert_eq!(still_there::call(&c, (r + 1) % w, tag).await.unwrap(), tag + 1);
                let mut v = vec![1.0f32; 4096];
                c.all_reduce(&mut v, Sum).await.unwrap();
                assert!(v.iter().all(|x| *x == w as f32));
                c.barrier().await.unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_cluster_still_works_afterwards() {
    let secs: u64 = std::env::var("NEXAR_IDLE_TEST_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let cfg = NexarConfig::builder()
        .heartbeat_interval(Duration::from_millis(100))
        .heartbeat_timeout(Duration::from_millis(1000))
        .idle_timeout(Duration::from_millis(2000))
        .build()
        .unwrap();
    let limit = common::TEST_LIMIT + Duration::from_secs(secs);
    tokio::time::timeout(limit, async {
        let ranks = NexarClient::bootstrap_local_with(4, cfg).await.unwrap();
        round(&ranks, 1).await;
        let watch = ranks[0].failure_watch();
        tokio::time::sleep(Duration::from_secs(secs)).await;
        round(&ranks, 2).await;
        for c in &ranks {
            assert!(c.failed_ranks().is_empty(), "rank {} saw failures: {:?}", c.rank(), watch.failures());
        }
        assert!(watch.failures().is_empty());
    })
    .await
    .expect("test timed out");
}
