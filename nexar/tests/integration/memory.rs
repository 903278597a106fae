//! Resident memory stays flat across 50,000 small collectives (in a process of its own, so no
//! other test allocates in the same process while it measures).

use std::time::Duration;

use nexar::prelude::*;

use crate::common;

async fn run(ranks: Vec<NexarClient>, iters: u64) -> Vec<NexarClient> {
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                let w = c.world_size() as u64;
                for i in 0..iters {
                    let mut v = [i, 1];
                    c.all_reduce(&mut v, Sum).await.unwrap();
                    assert_eq!(v, [w * i, w], "allreduce {i}");
                    if i % 10 == 0 {
                        c.barrier().await.unwrap();
                    }
                }
                c
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[test]
fn resident_memory_grows_less_than_16_mib_over_50_000_collectives() {
    common::alone(
        module_path!(),
        "resident_memory_grows_less_than_16_mib_over_50_000_collectives",
        resident_memory_grows_less_than_16_mib_over_50_000_collectives_body,
    );
}

async fn resident_memory_grows_less_than_16_mib_over_50_000_collectives_body() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let ranks = NexarClient::bootstrap_local(2).await.unwrap();
        let ranks = run(ranks, 5_000).await; // warm up pools and allocator
        let before = common::resident_bytes();
        let ranks = run(ranks, 50_000).await;
        let growth = common::resident_bytes().saturating_sub(before);
        assert!(growth < 16 << 20, "resident memory grew by {} KiB", growth >> 10);
        println!("resident memory growth over 50,000 allreduces and 5,000 barriers: {} KiB", growth >> 10);
        let tasks: Vec<_> = ranks.into_iter().map(|c| tokio::spawn(async move { c.shutdown().await })).collect();
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await
    .expect("test timed out");
}
