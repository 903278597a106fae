//! A bad network: every rank's datagrams are lost at 1 % and 5 %, and reordered. Collectives,
//! tagged messages and RPC must still complete with exactly the right data: nothing lost,
//! nothing corrupted, nothing duplicated.

use std::time::Duration;

use nexar::NetChaos;
use nexar::prelude::*;

use crate::common;
use crate::common::{TEST_LIMIT, on_each, pattern, same_bytes};

#[nexar::rpc]
fn checksum(data: Vec<u8>) -> u64 {
    data.iter().map(|b| u64::from(*b)).sum()
}

fn lossy(loss: f64) -> NexarConfig {
    NexarConfig::builder()
        .chaos(NetChaos { loss, reorder: 0.02, delay: Duration::from_millis(1), ..NetChaos::default() })
        // Loss slows things down; with the default heartbeat timeout it must not be mistaken
        // for death (checked at the end).
        .build()
        .unwrap()
}

async fn run_everything_on(ranks: Vec<NexarClient>, loss: f64) {
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                let (r, w) = (c.rank(), c.world_size());
                for (round, len) in [1usize, 1000, 65_537, 1 << 20].into_iter().enumerate() {
                    let mut v: Vec<f32> = (0..len).map(|i| (i % 7 + r) as f32).collect();
                    c.all_reduce(&mut v, Sum).await.unwrap();
                    let want = |i: usize| (w * (i % 7) + w * (w - 1) / 2) as f32;
                    assert!(v.iter().enumerate().all(|(i, x)| *x == want(i)), "allreduce {len} round {round}");
                    let mut b = if r == 1 { pattern::<u64>(len, 9) } else { vec![0u64; len] };
                    c.broadcast(&mut b, 1).await.unwrap();
                    assert!(same_bytes(&b, &pattern::<u64>(len, 9)), "broadcast {len}");
                }
                let mut recv = vec![0u32; 4 * w];
                let send: Vec<u32> = (0..4 * w).map(|i| (r * 1000 + i) as u32).collect();
                c.all_to_all(&send, &mut recv).await.unwrap();
                for q in 0..w {
                    for k in 0..4 {
                        assert_eq!(recv[q * 4 + k], (q * 1000 + r * 4 + k) as u32);
                    }
                }
                // 300 tagged messages to the next rank, every one checked, in order per tag.
                let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
                let sender = {
                    let c = c.clone();
                    tokio::spawn(async move {
                        for i in 0..300u64 {
                            c.send(&pattern::<u8>(1 + (i as usize * 97) % 5000, i + 1000 * r as u64), next, i % 3)
                                .await
                                .unwrap();
                        }
                    })
                };
                for i in 0..300u64 {
                    let got = c.recv_vec::<u8>(prev, i % 3).await.unwrap();
                    assert!(same_bytes(&got, &pattern::<u8>(1 + (i as usize * 97) % 5000, i + 1000 * prev as u64)));
                }
                sender.await.unwrap();
                let data = pattern::<u8>(100_000, r as u64);
                let want: u64 = data.iter().map(|b| u64::from(*b)).sum();
                assert_eq!(checksum::call(&c, next, data).await.unwrap(), want);
                c.barrier().await.unwrap();
                c
            })
        })
        .collect();
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }
    let (mut sent, mut lost) = (0, 0);
    for c in &done {
        assert!(c.failed_ranks().is_empty(), "loss was mistaken for a failure");
        for peer in 0..c.world_size() {
            if let Some(s) = c.link_stats(peer) {
                sent += s.sent_packets;
                lost += s.lost_packets;
            }
        }
    }
    // The network really was that bad (QUIC counts the datagrams it had to send again).
    assert!(lost as f64 >= sent as f64 * loss / 3.0, "only {lost} of {sent} datagrams lost");
    // Leave together: a rank dropped without `shutdown` looks like a failure to the others.
    let closing: Vec<_> = done.into_iter().map(|c| tokio::spawn(async move { c.shutdown().await })).collect();
    for c in closing {
        c.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_completes_correctly_at_one_percent_loss() {
    common::logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local_with(4, lossy(0.01)).await.unwrap();
        run_everything_on(ranks, 0.01).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_completes_correctly_at_five_percent_loss() {
    common::logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local_with(3, lossy(0.05)).await.unwrap();
        run_everything_on(ranks, 0.05).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_goes_silent_on_a_lossy_network_is_found_and_the_rest_recover() {
    common::logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let silence = nexar::Silence::default();
        let mut cfgs: Vec<NexarConfig> = (0..4)
            .map(|_| {
                lossy(0.02)
                    .into_builder()
                    // Generous for a loaded 2-core CI machine (1.5 s once took two live ranks for
                    // dead there); the silent rank is still found well within the test's limit.
                    .heartbeat_interval(Duration::from_millis(300))
                    .heartbeat_timeout(Duration::from_millis(3000))
                    .build()
                    .unwrap()
            })
            .collect();
        if let Some(chaos) = cfgs[3].chaos.as_mut() {
            chaos.silence = silence.clone();
        }
        let ranks = NexarClient::bootstrap_local_each(cfgs).await.unwrap();
        silence.set(true);
        let survivors = on_each(&ranks[..3], |c| async move {
            let mut v = vec![1.0f32; 100_000];
            let err = c.all_reduce(&mut v, Sum).await.expect_err("rank 3 is gone");
            assert!(err.to_string().contains("rank 3"), "{err}");
            c.recover().await.unwrap()
        })
        .await;
        on_each(&survivors, |c| async move {
            let mut v = vec![c.rank() as f64; 50_000];
            c.all_reduce(&mut v, Sum).await.unwrap();
            assert!(v.iter().all(|x| *x == 3.0));
            c.barrier().await.unwrap();
        })
        .await;
    })
    .await
    .expect("test timed out");
}
