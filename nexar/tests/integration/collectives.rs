//! Every collective over real QUIC at 2, 3, 4 and 5 ranks, against a sequential reference;
//! disagreements between ranks; long runs on one communicator; split communicators.

use std::time::{Duration, Instant};

use nexar::prelude::*;
use nexar::{CollectiveError, bf16};

use crate::common::{TEST_LIMIT, logs};

/// Runs `job` on every rank of a fresh `n`-rank cluster and returns the results by rank.
async fn on_ranks<F, Fut, R>(n: usize, job: F) -> Vec<R>
where
    F: Fn(NexarClient) -> Fut,
    Fut: std::future::Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    on_cluster(NexarClient::bootstrap_local(n).await.unwrap(), job).await
}

async fn on_cluster<F, Fut, R>(ranks: Vec<NexarClient>, job: F) -> Vec<R>
where
    F: Fn(NexarClient) -> Fut,
    Fut: std::future::Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let handles: Vec<_> = ranks.into_iter().map(|c| tokio::spawn(job(c))).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("rank task panicked"));
    }
    out
}

fn value(rank: usize, i: usize) -> i64 {
    ((rank * 131 + i * 17) % 1000) as i64 - 500
}

async fn every_collective_is_correct(n: usize) {
    let counts = [0usize, 1, n - 1, n + 1, 7919, 300_001];
    let results = on_ranks(n, move |c| async move {
        let (r, w) = (c.rank(), c.world_size());
        for &count in &counts {
            let mine: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
            let sum: Vec<i64> = (0..count).map(|i| (0..w).map(|q| value(q, i)).sum()).collect();
            let max: Vec<i64> = (0..count).map(|i| (0..w).map(|q| value(q, i)).max().unwrap()).collect();

            let mut buf = mine.clone();
            c.all_reduce(&mut buf, Sum).await.unwrap();
            assert_eq!(buf, sum, "all_reduce sum, count {count}");
            let mut buf = mine.clone();
            c.all_reduce(&mut buf, ReduceOp::Max).await.unwrap();
            assert_eq!(buf, max, "all_reduce max, count {count}");
            let mut f: Vec<f32> = mine.iter().map(|v| *v as f32).collect();
            c.all_reduce(&mut f, Sum).await.unwrap();
            assert!(f.iter().zip(&sum).all(|(a, b)| *a == *b as f32), "all_reduce f32, count {count}");
            let mut h: Vec<bf16> = (0..count).map(|i| bf16::from_f32((value(r, i) % 8) as f32)).collect();
            c.all_reduce(&mut h, Sum).await.unwrap();
            let want = |i: usize| (0..w).map(|q| (value(q, i) % 8) as f32).sum::<f32>();
            assert!(h.iter().enumerate().all(|(i, v)| v.to_f32() == want(i)), "all_reduce bf16, count {count}");

            let root = count % w;
            let mut b = if r == root { mine.clone() } else { vec![0; count] };
            c.broadcast(&mut b, root).await.unwrap();
            assert_eq!(b, (0..count).map(|i| value(root, i)).collect::<Vec<_>>(), "broadcast, count {count}");

            let mut red = mine.clone();
            c.reduce(&mut red, Sum, root).await.unwrap();
            assert_eq!(red, if r == root { sum.clone() } else { mine.clone() }, "reduce, count {count}");

            let mut gathered = vec![0i64; count * w];
            c.all_gather(&mine, &mut gathered).await.unwrap();
            let all: Vec<i64> = (0..w).flat_map(|q| (0..count).map(move |i| value(q, i))).collect();
            assert_eq!(gathered, all, "all_gather, count {count}");

            let mut block = vec![0i64; count];
            c.reduce_scatter(&all, &mut block, Sum).await.unwrap();
            let want: Vec<i64> = (0..count).map(|i| all[r * count + i] * w as i64).collect();
            assert_eq!(block, want, "reduce_scatter, count {count}");

            let mut swapped = vec![0i64; count * w];
            let outgoing: Vec<i64> = (0..count * w).map(|i| (r * 1_000_000 + i) as i64).collect();
            c.all_to_all(&outgoing, &mut swapped).await.unwrap();
            let want: Vec<i64> =
                (0..w).flat_map(|q| (0..count).map(move |i| (q * 1_000_000 + r * count + i) as i64)).collect();
            assert_eq!(swapped, want, "all_to_all, count {count}");

            let mut g = if r == root { vec![0i64; count * w] } else { vec![] };
            c.gather(&mine, &mut g, root).await.unwrap();
            if r == root {
                assert_eq!(g, all, "gather, count {count}");
            }

            let mut s = vec![0i64; count];
            let src = if r == root { all.clone() } else { vec![] };
            c.scatter(&src, &mut s, root).await.unwrap();
            assert_eq!(s, mine, "scatter, count {count}");

            let mut sc = mine.clone();
            c.scan(&mut sc, Sum).await.unwrap();
            let want: Vec<i64> = (0..count).map(|i| (0..=r).map(|q| value(q, i)).sum()).collect();
            assert_eq!(sc, want, "scan, count {count}");

            let mut ex = mine.clone();
            c.exclusive_scan(&mut ex, BitXor).await.unwrap();
            let want: Vec<i64> = if r == 0 {
                mine.clone()
            } else {
                (0..count).map(|i| (0..r).fold(0, |a, q| a ^ value(q, i))).collect()
            };
            assert_eq!(ex, want, "exclusive_scan, count {count}");

            c.barrier().await.unwrap();
        }
        c
    })
    .await;
    shutdown_all(results).await;
}

async fn shutdown_all(ranks: Vec<NexarClient>) {
    on_cluster(ranks, |c| async move { c.shutdown().await }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_at_2_and_3_ranks() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        every_collective_is_correct(2).await;
        every_collective_is_correct(3).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_at_4_and_5_ranks() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        every_collective_is_correct(4).await;
        every_collective_is_correct(5).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_allreduce_runs_the_pipelined_ring() {
    tokio::time::timeout(TEST_LIMIT, async {
        let n = 4 << 20; // 16 MiB of f32, above the ring threshold
        let out = on_ranks(3, move |c| async move {
            let mut buf = vec![(c.rank() + 1) as f32; n];
            c.all_reduce(&mut buf, Sum).await.unwrap();
            assert!(buf.iter().all(|v| *v == 6.0));
            let mut b = if c.rank() == 1 { vec![7u32; n] } else { vec![0u32; n] };
            c.broadcast(&mut b, 1).await.unwrap();
            assert!(b.iter().all(|v| *v == 7));
            c
        })
        .await;
        shutdown_all(out).await;
    })
    .await
    .expect("test timed out");
}

/// Runs one collective on every rank where rank `odd` calls it differently, and checks that
/// every rank gets one error for it within 2 s, naming the disagreement: at the call, or, on a
/// rank that had finished its part of a rooted collective (which returns then), at its next
/// call, which completes (its result is right) and reports the earlier failure. The call after
/// that works everywhere.
async fn disagreement(odd_rank: usize, what: &'static str) {
    let ranks = NexarClient::bootstrap_local(4).await.unwrap();
    let results = on_cluster(ranks, move |c| async move {
        let odd = c.rank() == odd_rank;
        let start = Instant::now();
        let first = match what {
            "count" => c.all_reduce(&mut vec![1i32; if odd { 9 } else { 10 }], Sum).await,
            "dtype" => {
                if odd {
                    c.all_reduce(&mut vec![1.0f32; 10], Sum).await
                } else {
                    c.all_reduce(&mut vec![1i32; 10], Sum).await
                }
            }
            "op" => c.all_reduce(&mut vec![1i32; 10], if odd { ReduceOp::Max } else { ReduceOp::Sum }).await,
            "root" => c.broadcast(&mut vec![1u8; 10], if odd { 1 } else { 0 }).await,
            "operation" => {
                if odd {
                    c.broadcast(&mut vec![1i32; 10], 0).await
                } else {
                    c.all_reduce(&mut vec![1i32; 10], Sum).await
                }
            }
            _ => unreachable!(),
        };
        let mut next = vec![c.rank() as u64; 5];
        let second = c.all_reduce(&mut next, Sum).await;
        let took = start.elapsed();
        assert_eq!(next, vec![6; 5], "rank {}: the next call completes everywhere", c.rank());
        let err = match (first, second) {
            (Err(e), Ok(())) => e,
            (Ok(()), Err(e @ CollectiveError::EarlierFailed { .. })) => {
                assert!(e.to_string().contains("all_reduce: completed, but the earlier"), "{e}");
                e
            }
            other => panic!("rank {}: one error for one disagreement, got {other:?}", c.rank()),
        };
        // The communicator still works for the next matched call.
        let mut after = vec![1u8; 3];
        c.all_reduce(&mut after, Sum).await.unwrap();
        assert_eq!(after, vec![4; 3]);
        (c, err, took)
    })
    .await;
    for (c, err, took) in &results {
        assert!(*took < Duration::from_secs(2), "rank {} took {took:?} to fail: {err}", c.rank());
        let cause = match err {
            CollectiveError::EarlierFailed { source, .. } => &**source,
            err => err,
        };
        assert!(
            matches!(cause, CollectiveError::Mismatch { .. } | CollectiveError::Aborted { .. }),
            "rank {}: {err}",
            c.rank()
        );
        assert!(err.to_string().contains("disagree"), "rank {}: {err}", c.rank());
    }
    let text = results.iter().map(|(_, e, _)| e.to_string()).collect::<Vec<_>>().join("\n");
    let needle = match what {
        "count" => "passed 9",
        "dtype" => "f32",
        "op" => "max",
        "root" => "root",
        _ => "called broadcast",
    };
    assert!(text.contains(needle), "{what}: {text}");
    if what == "root" {
        // The root had only sent: it returned, and learnt of the disagreement at its next call.
        assert!(
            matches!(results[0].1, CollectiveError::EarlierFailed { earlier: "broadcast", .. }),
            "{}",
            results[0].1
        );
    }
    shutdown_all(results.into_iter().map(|(c, _, _)| c).collect()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagreements_fail_every_rank_quickly_and_the_next_call_works() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        for (odd, what) in [(0, "count"), (3, "dtype"), (1, "op"), (2, "root"), (1, "operation")] {
            disagreement(odd, what).await;
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_local_arguments_fail_fast_everywhere() {
    tokio::time::timeout(TEST_LIMIT, async {
        let out = on_ranks(3, |c| async move {
            let start = Instant::now();
            // Rank 0 passes a receive buffer of the wrong size; everyone fails at once.
            let mut recv = vec![0u8; if c.rank() == 0 { 5 } else { 6 }];
            let err = c.all_gather(&[1u8, 2], &mut recv).await.unwrap_err();
            assert!(start.elapsed() < Duration::from_secs(2), "{err}");
            if c.rank() == 0 {
                assert!(matches!(err, CollectiveError::InvalidArgument { .. }), "{err}");
                assert!(err.to_string().contains("recv holds 5 elements, expected send (2) × world size (3)"), "{err}");
            } else {
                assert!(err.to_string().contains("rank 0 all_gather: recv holds 5"), "{err}");
            }
            let bad = c.broadcast(&mut [0u8; 3], 7).await.unwrap_err();
            assert!(bad.to_string().contains("root 7 does not exist"), "{bad}");
            let bitwise = c.all_reduce(&mut [1.0f64], ReduceOp::BitAnd).await.unwrap_err();
            assert!(bitwise.to_string().contains("bitand is not defined for f64"), "{bitwise}");
            c.barrier().await.unwrap();
            c
        })
        .await;
        shutdown_all(out).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_small_allreduces_at_4_ranks_lose_nothing() {
    tokio::time::timeout(TEST_LIMIT, async {
        let out = on_ranks(4, |c| async move {
            for i in 0..20_000u64 {
                let mut v = [i, c.rank() as u64];
                c.all_reduce(&mut v, Sum).await.unwrap();
                assert_eq!(v, [4 * i, 6], "allreduce {i}");
            }
            c
        })
        .await;
        shutdown_all(out).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seventy_thousand_collectives_and_an_old_cluster_barrier() {
    tokio::time::timeout(TEST_LIMIT * 2, async {
        let cfg = NexarConfig::builder().idle_timeout(Duration::from_millis(1500)).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
        // Several keep-alive intervals pass before the first barrier.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let out = on_cluster(ranks, |c| async move {
            c.barrier().await.unwrap();
            for i in 0..70_000u32 {
                if i % 2 == 0 {
                    c.barrier().await.unwrap();
                } else {
                    let mut v = [1u8];
                    c.all_reduce(&mut v, Sum).await.unwrap();
                    assert_eq!(v, [2]);
                }
            }
            c
        })
        .await;
        shutdown_all(out).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_communicators_are_isolated_and_run_alongside_the_parent() {
    tokio::time::timeout(TEST_LIMIT, async {
        let out = on_ranks(4, |c| async move {
            let r = c.rank();
            let half = c.split(Some((r % 2) as u32), (10 - r) as u32).await.unwrap().unwrap();
            assert_eq!(half.world_size(), 2);
            // Keys are descending ranks, so the higher world rank is rank 0 of its half.
            assert_eq!(half.rank(), if r >= 2 { 0 } else { 1 });
            let none = c.split(if r == 0 { None } else { Some(1) }, 0).await.unwrap();
            assert_eq!(none.is_none(), r == 0);
            // A child and a parent collective at the same time.
            let mut a = [r as u32];
            let mut b = [r as u32];
            let (x, y) = tokio::join!(half.all_reduce(&mut a, Sum), c.all_reduce(&mut b, Sum));
            x.unwrap();
            y.unwrap();
            assert_eq!(a, [if r % 2 == 0 { 2 } else { 4 }]);
            assert_eq!(b, [6]);
            half.barrier().await.unwrap();
            // Point-to-point on the child uses its own ranks.
            let peer = 1 - half.rank();
            half.send(&[r as u8], peer, 5).await.unwrap();
            let got: Vec<u8> = half.recv_vec(peer, 5).await.unwrap();
            assert_eq!(got, vec![(r ^ 2) as u8]);
            c
        })
        .await;
        shutdown_all(out).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_blocking_collectives_own_their_buffers() {
    tokio::time::timeout(TEST_LIMIT, async {
        let out = on_ranks(3, |c| async move {
            let first = c.all_reduce_start(Buf::from_vec(vec![1.0f32; 1000]), Sum);
            let second = c.broadcast_start(Buf::from_vec(vec![c.rank() as u16; 10]), 2);
            // Forgetting a handle is sound: the collective still completes with the peers.
            let forgotten = c.all_reduce_start(Buf::from_vec(vec![1i32; 4]), Sum);
            std::mem::forget(forgotten);
            // A bad root is refused on every rank, through the handle too.
            let bad = c.broadcast_start(Buf::from_vec(vec![0u8; 4]), 9).await.unwrap_err();
            assert!(bad.to_string().contains("root 9 does not exist"), "{bad}");
            assert_eq!(first.await.unwrap().as_slice(), &[3.0; 1000][..]);
            assert_eq!(second.await.unwrap().as_slice(), &[2; 10][..]);
            let mut after = [1u8];
            c.all_reduce(&mut after, Sum).await.unwrap();
            assert_eq!(after, [3]);
            c
        })
        .await;
        shutdown_all(out).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_has_a_non_blocking_form() {
    tokio::time::timeout(TEST_LIMIT, async {
        let out = on_ranks(4, |c| async move {
            let (r, w) = (c.rank(), c.world_size());
            // Started in one order, awaited in another: the start order is the call order.
            let gather = c.all_gather_start(Buf::from_vec(vec![r as u32; 2]), Buf::zeros(2 * w));
            let scatter_send = if r == 1 { Buf::from_vec((0..w as u64).collect()) } else { Buf::zeros(0) };
            let scatter = c.scatter_start(scatter_send, Buf::zeros(1), 1);
            let rs = c.reduce_scatter_start(Buf::from_vec(vec![1i64; 3 * w]), Buf::zeros(3), Sum);
            let a2a = c.all_to_all_start(Buf::from_vec((0..w).map(|q| (r * 10 + q) as u16).collect()), Buf::zeros(w));
            let g = c.gather_start(Buf::from_vec(vec![r as u8]), Buf::zeros(if r == 0 { w } else { 0 }), 0);
            let red = c.reduce_start(Buf::from_vec(vec![r as i32]), Max, 3);
            let scan = c.scan_start(Buf::from_vec(vec![1u32]), Sum);
            let xscan = c.exclusive_scan_start(Buf::from_vec(vec![2u32]), Sum);
            let bad = c.all_gather_start(Buf::from_vec(vec![0u8; 2]), Buf::zeros(3));
            assert_eq!(xscan.await.unwrap()[0], if r == 0 { 2 } else { 2 * r as u32 });
            assert_eq!(scan.await.unwrap()[0], r as u32 + 1);
            let red = red.await.unwrap();
            if r == 3 {
                assert_eq!(red[0], 3);
            }
            let (_, g) = g.await.unwrap();
            if r == 0 {
                assert_eq!(g.as_slice(), (0..w as u8).collect::<Vec<_>>().as_slice());
            }
            let (_, a2a) = a2a.await.unwrap();
            assert_eq!(a2a.as_slice(), (0..w).map(|q| (q * 10 + r) as u16).collect::<Vec<_>>().as_slice());
            let (_, rs) = rs.await.unwrap();
            assert_eq!(rs.as_slice(), &[w as i64; 3][..]);
            let (_, mine) = scatter.await.unwrap();
            assert_eq!(mine[0], r as u64);
            let (sent, all) = gather.await.unwrap();
            assert_eq!(sent.as_slice(), &[r as u32; 2][..]);
            assert_eq!(all.as_slice(), (0..w as u32).flat_map(|q| [q, q]).collect::<Vec<_>>().as_slice());
            let err = bad.await.unwrap_err();
            assert!(err.to_string().contains("recv holds 3 elements"), "{err}");
            c
        })
        .await;
        shutdown_all(out).await;
    })
    .await
    .expect("test timed out");
}
