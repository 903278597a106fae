//! The rooted collectives' confirmation, run behind them: a root returns once its part is
//! done, runs at most one collective ahead of the others, and learns of a failure elsewhere at
//! its next call or at `barrier()`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nexar::prelude::*;
use nexar::{CollectiveError, ReduceOp};

use crate::common::{TEST_LIMIT, logs, on_each};

/// Rooted collectives of every kind, with the root moving, checked against the values every
/// rank can compute.
async fn rooted_round(c: &NexarClient, i: usize) {
    let (r, w) = (c.rank(), c.world_size());
    let root = i % w;
    let mut b = if r == root { vec![i as u64; 33] } else { vec![0; 33] };
    c.broadcast(&mut b, root).await.unwrap();
    assert!(b.iter().all(|v| *v == i as u64), "broadcast {i}");
    let mut red = vec![(r + i) as i64; 17];
    c.reduce(&mut red, Sum, root).await.unwrap();
    if r == root {
        let want: i64 = (0..w).map(|q| (q + i) as i64).sum();
        assert!(red.iter().all(|v| *v == want), "reduce {i}");
    }
    let mut all = if r == root { vec![0u32; 2 * w] } else { vec![] };
    c.gather(&[r as u32, i as u32], &mut all, root).await.unwrap();
    if r == root {
        let want: Vec<u32> = (0..w).flat_map(|q| [q as u32, i as u32]).collect();
        assert_eq!(all, want, "gather {i}");
    }
    let work: Vec<u16> = if r == root { (0..3 * w as u16).collect() } else { vec![] };
    let mut mine = [0u16; 3];
    c.scatter(&work, &mut mine, root).await.unwrap();
    assert_eq!(mine, [3 * r as u16, 3 * r as u16 + 1, 3 * r as u16 + 2], "scatter {i}");
    let mut prefix = [1u32];
    c.scan(&mut prefix, Sum).await.unwrap();
    assert_eq!(prefix, [r as u32 + 1], "scan {i}");
}

/// The root's broadcast returns while no other rank has called it yet (they wait for it to
/// return); its second broadcast cannot return before the others have received the first.
/// Then rounds of every rooted collective with the root moving, as background handles too,
/// and a barrier that collects the last confirmations. At two ranks (the next call receives
/// the confirmations) and at three (a task runs the rest of each round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_returns_once_it_has_sent_and_runs_at_most_one_call_ahead() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        for n in [2, 3] {
            one_call_ahead(n).await;
        }
    })
    .await
    .expect("test timed out");
}

async fn one_call_ahead(n: usize) {
    let ranks = NexarClient::bootstrap_local(n).await.unwrap();
    let (first_done, first_seen) = tokio::sync::watch::channel(false);
    let others_called = Arc::new(AtomicBool::new(false));
    on_each(&ranks, move |c| {
        let (first_done, mut first_seen) = (first_done.clone(), first_seen.clone());
        let others_called = others_called.clone();
        async move {
            if c.rank() == 0 {
                c.broadcast(&mut vec![7u32; 1000], 0).await.unwrap();
                assert!(!others_called.load(Ordering::SeqCst));
                first_done.send(true).unwrap();
                c.broadcast(&mut vec![9u32; 1000], 0).await.unwrap();
                assert!(
                    others_called.load(Ordering::SeqCst),
                    "the root's second broadcast returned before any other rank had received the first"
                );
            } else {
                first_seen.wait_for(|done| *done).await.unwrap();
                others_called.store(true, Ordering::SeqCst);
                for want in [7u32, 9] {
                    let mut b = vec![0u32; 1000];
                    c.broadcast(&mut b, 0).await.unwrap();
                    assert!(b.iter().all(|v| *v == want));
                }
            }
            for i in 0..60 {
                rooted_round(&c, i).await;
            }
            // Background handles: started in order, awaited in reverse.
            let w = c.world_size();
            let b = c.broadcast_start(Buf::from_vec(vec![c.rank() as u8; 8]), w - 1);
            let red = c.reduce_start(Buf::from_vec(vec![1i32; 8]), Sum, 1);
            let red = red.await.unwrap();
            assert!(c.rank() != 1 || red.as_slice().iter().all(|v| *v == w as i32));
            assert!(b.await.unwrap().as_slice().iter().all(|v| *v as usize == w - 1));
            c.barrier().await.unwrap();
        }
    })
    .await;
    on_each(&ranks, |c| async move { c.shutdown().await }).await;
}

/// Rank 2 passes a broadcast one element more than the others: it fails there at once. The
/// root had only sent and returned; it, and rank 1 if it had finished, learn of it at their
/// next call: a barrier that completes and reports the earlier broadcast's failure, naming
/// rank 2 and the counts. Then the same with a reduce whose result the root had, reported by
/// the next rooted call, a scatter. One error per rank for each disagreement; the calls after
/// work everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_the_root_did_not_see_is_reported_by_its_next_call() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(3).await.unwrap();
        on_each(&ranks, |c| async move {
            let odd = c.rank() == 2;
            let first = c.broadcast(&mut vec![1u8; if odd { 5 } else { 4 }], 0).await;
            let second = c.barrier().await;
            let err = match (first, second) {
                (Err(e), Ok(())) => e,
                (Ok(()), Err(e)) => e,
                other => panic!("rank {}: one error for one disagreement, got {other:?}", c.rank()),
            };
            if c.rank() == 0 {
                let CollectiveError::EarlierFailed { op, earlier, source, .. } = &err else {
                    panic!("the root's broadcast returned, so its barrier reports it: {err}")
                };
                assert_eq!((*op, *earlier), ("barrier", "broadcast"));
                let why = source.to_string();
                assert!(why.contains("rank 2") && why.contains("passed 5") && why.contains("passed 4"), "{why}");
            }
            assert!(err.to_string().contains("disagree"), "rank {}: {err}", c.rank());

            // A reduce to rank 0 with a reduction rank 1 disagrees on.
            let op = if c.rank() == 1 { ReduceOp::Max } else { ReduceOp::Sum };
            let first = c.reduce(&mut [1i32; 4], op, 0).await;
            let work: Vec<u32> = if c.rank() == 2 { (0..6).collect() } else { vec![] };
            let mut mine = [0u32; 2];
            let second = c.scatter(&work, &mut mine, 2).await;
            assert_eq!(mine, [2 * c.rank() as u32, 2 * c.rank() as u32 + 1], "the scatter completed everywhere");
            match (first, second) {
                (Err(_), Ok(())) => {}
                (Ok(()), Err(CollectiveError::EarlierFailed { op: "scatter", earlier: "reduce", source, .. })) => {
                    assert!(source.to_string().contains("max"), "{source}");
                }
                other => panic!("rank {}: one error for one disagreement, got {other:?}", c.rank()),
            }

            let mut after = [c.rank() as u64];
            c.all_reduce(&mut after, Sum).await.unwrap();
            assert_eq!(after, [3]);
            c.barrier().await.unwrap();
        })
        .await;
        on_each(&ranks, |c| async move { c.shutdown().await }).await;
    })
    .await
    .expect("test timed out");
}

/// Two ranks, where a rank whose part only sends sends no confirmation (the receiver checked
/// its headers): disagreements in which one side passes no elements are still found by
/// both, each once, as disagreements, not left to time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_find_a_disagreement_over_an_empty_part() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(2).await.unwrap();
        for case in ["broadcast", "gather", "reduce"] {
            let errors = on_each(&ranks, move |c| async move {
                let empty = c.rank() == 0;
                let len = if empty { 0 } else { 4 };
                let first = match case {
                    "broadcast" => c.broadcast(&mut vec![1u32; len], 0).await,
                    "gather" => c.gather(&vec![1u32; len], &mut [][..], 0).await,
                    _ => c.reduce(&mut vec![1u32; len], Sum, 1).await,
                };
                let second = c.barrier().await;
                match (first, second) {
                    (Err(e), Ok(())) | (Ok(()), Err(e)) => e,
                    other => panic!("{case}, rank {}: one error for one disagreement, got {other:?}", c.rank()),
                }
            })
            .await;
            for (rank, err) in errors.iter().enumerate() {
                let cause = match err {
                    CollectiveError::EarlierFailed { source, .. } => &**source,
                    err => err,
                };
                assert!(
                    matches!(cause, CollectiveError::Mismatch { .. } | CollectiveError::Aborted { .. }),
                    "{case}, rank {rank}: {err}"
                );
                assert!(err.to_string().contains("passed 0") || err.to_string().contains("0 elements"), "{err}");
            }
            on_each(&ranks, |c| async move { c.barrier().await.unwrap() }).await;
        }
        on_each(&ranks, |c| async move { c.shutdown().await }).await;
    })
    .await
    .expect("test timed out");
}
