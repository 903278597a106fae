//! Failure detection, agreement and rebuilt communicators: heartbeats find a silent rank,
//! survivors that disagree about who failed converge, and every collective works on the
//! rebuilt communicator with its dense ranks.

use std::time::{Duration, Instant};

use nexar::prelude::*;
use nexar::{NetChaos, Silence};
use nexar::{P2pError, RecoveryError};

use crate::common;
use crate::common::{TEST_LIMIT, on_each};

/// Every collective on a rebuilt communicator gives the right answer.
async fn exercise(comm: NexarClient) {
    let (r, w) = (comm.rank(), comm.world_size());
    let mut v = vec![r as f32 + 1.0; 1001];
    comm.all_reduce(&mut v, Sum).await.unwrap();
    assert!(v.iter().all(|x| *x == (w * (w + 1) / 2) as f32), "allreduce on the rebuilt communicator");
    let mut b = vec![if r == w - 1 { 7u64 } else { 0 }; 33];
    comm.broadcast(&mut b, w - 1).await.unwrap();
    assert!(b.iter().all(|x| *x == 7));
    let mut all = vec![0u32; 2 * w];
    comm.all_gather(&[r as u32, 100 + r as u32], &mut all).await.unwrap();
    assert_eq!(all, (0..w).flat_map(|q| [q as u32, 100 + q as u32]).collect::<Vec<_>>());
    let mut mine = vec![0i64; 3];
    comm.reduce_scatter(&vec![1i64; 3 * w], &mut mine, Sum).await.unwrap();
    assert_eq!(mine, vec![w as i64; 3]);
    let mut s = [1u32];
    comm.scan(&mut s, Sum).await.unwrap();
    assert_eq!(s, [r as u32 + 1]);
    comm.barrier().await.unwrap();
    let next = (r + 1) % w;
    let prev = (r + w - 1) % w;
    comm.send(&[r as u16], next, 5).await.unwrap();
    assert_eq!(comm.recv_vec::<u16>(prev, 5).await.unwrap(), vec![prev as u16]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_that_disagree_about_a_failure_converge_and_rebuild() {
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(4).await.unwrap();
        // Only rank 3 thinks rank 1 is dead; ranks 0 and 2 have seen nothing wrong.
        ranks[3].report_failure(1, "too slow").unwrap();
        let results = on_each(&ranks, |c| async move {
            let skip = c.rank() == 1;
            let out = c.recover().await;
            if !skip && let Ok(new) = &out {
                exercise(new.clone()).await;
            }
            out.map(|n| (n.rank(), n.world_size(), n.world_rank()))
        })
        .await;
        assert_eq!(results[0].as_ref().unwrap(), &(0, 3, 0));
        assert_eq!(results[2].as_ref().unwrap(), &(1, 3, 2));
        assert_eq!(results[3].as_ref().unwrap(), &(2, 3, 3));
        let excluded = results[1].as_ref().unwrap_err();
        assert!(matches!(excluded, RecoveryError::Excluded { rank: 1, .. }), "{excluded}");
        assert!(excluded.to_string().contains("rank 3"), "the excluded rank learns who cut it: {excluded}");
    })
    .await
    .expect("test timed out");
}

/// Whoever coordinates the agreement, the rank one survivor cut is the one left out, and it
/// learns so without waiting out an operation timeout (set to an hour here, past the test's
/// limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rank_cut_is_left_out_when_it_or_its_accuser_coordinates() {
    common::logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().op_timeout(Duration::from_secs(3600)).build().unwrap();
        // (accuser, accused): rank 0, the coordinator, accused; rank 0 the accuser.
        for (accuser, accused) in [(2usize, 0usize), (0, 1)] {
            let ranks = NexarClient::bootstrap_local_with(4, cfg.clone()).await.unwrap();
            ranks[accuser].report_failure(accused, "stuck, says the application").unwrap();
            let results = on_each(&ranks, |c| async move {
                let out = c.recover().await;
                if let Ok(new) = &out {
                    exercise(new.clone()).await;
                }
                out.map(|n| n.world_rank())
            })
            .await;
            for (rank, result) in results.iter().enumerate() {
                if rank == accused {
                    let err = result.as_ref().unwrap_err();
                    assert!(matches!(err, RecoveryError::Excluded { .. }), "rank {rank}: {err}");
                    assert!(err.to_string().contains(&format!("rank {accuser}")), "names its accuser: {err}");
                } else {
                    assert_eq!(result.as_ref().unwrap(), &rank, "rank {rank} is in the rebuilt communicator");
                }
            }
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_rank_is_reported_and_the_rest_rebuild_with_dense_ranks() {
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(5).await.unwrap();
        let mut watch = ranks[4].failure_watch();
        let start = Instant::now();
        ranks[2].abort("simulated crash");
        let failure = watch.next().await.unwrap();
        assert_eq!(failure.rank, 2);
        assert!(start.elapsed() < Duration::from_secs(5), "reported after {:?}", start.elapsed());
        let survivors: Vec<_> = ranks.iter().filter(|c| c.rank() != 2).cloned().collect();
        let rebuilt = on_each(&survivors, |c| async move { c.recover().await.unwrap() }).await;
        assert_eq!(rebuilt.iter().map(|c| c.rank()).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert_eq!(rebuilt.iter().map(|c| c.world_rank()).collect::<Vec<_>>(), vec![0, 1, 3, 4]);
        on_each(&rebuilt, |c| async move { exercise(c).await }).await;
        // A second failure on the rebuilt communicator: rebuild again.
        rebuilt[0].abort("second crash");
        let again = on_each(&rebuilt[1..], |c| async move { c.recover().await.unwrap() }).await;
        assert_eq!(again.iter().map(|c| c.world_rank()).collect::<Vec<_>>(), vec![1, 3, 4]);
        on_each(&again, |c| async move { exercise(c).await }).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrinking_by_choice_excludes_the_named_rank() {
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(4).await.unwrap();
        let results = on_each(&ranks, |c| async move { c.rebuild_excluding(&[0]).await }).await;
        assert!(matches!(results[0], Err(RecoveryError::Excluded { rank: 0, .. })));
        let smaller: Vec<_> = results.into_iter().skip(1).map(Result::unwrap).collect();
        assert_eq!(
            smaller.iter().map(|c| (c.rank(), c.world_size())).collect::<Vec<_>>(),
            vec![(0, 3), (1, 3), (2, 3)]
        );
        on_each(&smaller, |c| async move { exercise(c).await }).await;
        // The old communicator still works for everyone, the excluded rank included.
        on_each(&ranks, |c| async move { exercise(c).await }).await;
        let bad = ranks[1].rebuild_excluding(&[9]).await.unwrap_err();
        assert!(bad.to_string().contains("rank 9 is outside"), "{bad}");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_below_the_minimum_world_size_fails() {
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().min_world_size(3).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
        ranks[1].abort("crash");
        let results = on_each(&[ranks[0].clone(), ranks[2].clone()], |c| async move { c.recover().await }).await;
        for r in results {
            let err = r.unwrap_err();
            assert!(matches!(err, RecoveryError::TooFew { survivors: 2, min: 3, .. }), "{err}");
            assert!(err.to_string().contains("NEXAR_MIN_WORLD_SIZE"));
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_automatic_policy_rebuilds_by_itself() {
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().recovery_policy(RecoveryPolicy::Automatic).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(4, cfg).await.unwrap();
        let mut watches: Vec<_> = ranks.iter().map(|c| c.failure_watch()).collect();
        ranks[1].abort("crash");
        let mut rebuilt = Vec::new();
        for (i, w) in watches.iter_mut().enumerate().filter(|(i, _)| *i != 1) {
            let comm = w.rebuilt().await.unwrap_or_else(|e| panic!("rank {i}: {e}"));
            assert_eq!(comm.world_size(), 3);
            rebuilt.push(comm);
        }
        on_each(&rebuilt, |c| async move { exercise(c).await }).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_abort_policy_stops_every_rank() {
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().recovery_policy(RecoveryPolicy::Abort).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
        ranks[2].abort("crash");
        let start = Instant::now();
        for c in &ranks[..2] {
            // Every later operation fails, even between the two survivors.
            loop {
                match c.recv_vec::<u8>(1 - c.rank(), 1).await {
                    Err(P2pError::Closed { .. }) => break,
                    other => assert!(start.elapsed() < Duration::from_secs(10), "still running: {other:?}"),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_rank_is_declared_dead_within_the_heartbeat_timeout() {
    tokio::time::timeout(TEST_LIMIT, async {
        let silence = Silence::default();
        let fast = NexarConfig::builder()
            .heartbeat_interval(Duration::from_millis(100))
            .heartbeat_timeout(Duration::from_millis(1000))
            .build()
            .unwrap();
        // Rank 2's host "loses power": its datagrams stop in both directions, no close frame.
        let mut cfgs = vec![fast; 3];
        cfgs[2].chaos = Some(NetChaos { silence: silence.clone(), ..NetChaos::default() });
        let ranks = NexarClient::bootstrap_local_each(cfgs).await.unwrap();
        let pending = {
            let a = ranks[0].clone();
            tokio::spawn(async move { a.recv_vec::<u8>(2, 1).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let start = Instant::now();
        silence.set(true);
        let err = pending.await.unwrap().unwrap_err();
        let took = start.elapsed();
        // Within the timeout (a rank of this same process gets no contended host's longer
        // suspicion period: it cannot be starved while this one runs).
        assert!(took < Duration::from_millis(1000 + 1000), "declared after {took:?}");
        assert!(matches!(err, P2pError::PeerGone { peer: 2, .. }), "{err}");
        // One sentence, in rank 0's own words: what it saw, whom it asked, when it last heard.
        let text = err.to_string();
        assert!(text.contains("heartbeat"), "{err}");
        assert!(text.contains("answered neither a ping or probes through rank 1"), "{err}");
        assert!(text.contains("this rank last heard from it"), "{err}");
        assert!(!text.contains("declared it dead ("), "no chain of hearsay: {err}");
        let survivors = on_each(&ranks[..2], |c| async move { c.recover().await.unwrap() }).await;
        on_each(&survivors, |c| async move { exercise(c).await }).await;
        // The silent rank, cut off, has lost the others too (its own heartbeat timeout).
        let cut_off = Instant::now();
        while ranks[2].failed_ranks() != vec![0, 1] {
            assert!(cut_off.elapsed() < Duration::from_secs(10), "rank 2 sees {:?}", ranks[2].failed_ranks());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        silence.set(false);
        assert!(ranks[2].send(&[1u8], 0, 1).await.is_err(), "the silent rank is cut off");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rank_is_replaced_by_a_new_worker_through_the_seed() {
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().world_size(3).listen_addr("127.0.0.1:0".parse().unwrap()).build().unwrap();
        let seed = nexar::SeedNode::bind("127.0.0.1:0".parse().unwrap(), cfg.clone()).await.unwrap();
        let (addr, token) = (seed.local_addr(), seed.token().to_string());
        let joins: Vec<_> = (0..3)
            .map(|_| {
                let (token, cfg) = (token.clone(), cfg.clone());
                tokio::spawn(async move { NexarClient::connect(addr, &token, cfg).await.unwrap() })
            })
            .collect();
        let mut ranks = Vec::new();
        for j in joins {
            ranks.push(j.await.unwrap());
        }
        ranks.sort_by_key(|c| c.rank());
        // Rank 1 dies; the others agree and go on with two.
        ranks[1].abort("node lost");
        let survivors =
            on_each(&[ranks[0].clone(), ranks[2].clone()], |c| async move { c.recover().await.unwrap() }).await;
        on_each(&survivors, |c| async move { exercise(c).await }).await;
        // A replacement worker joins the running cluster; the survivors take it in.
        let newcomer = tokio::spawn(async move {
            let me = NexarClient::connect(addr, &token, cfg).await.unwrap();
            assert_eq!(me.world_rank(), 3, "a new rank number; the dead one is not reused");
            me.admitted().await.unwrap()
        });
        let mut grown = on_each(&survivors, |c| async move { c.rebuild_adding(1).await.unwrap() }).await;
        grown.push(newcomer.await.unwrap());
        assert_eq!(grown.iter().map(|c| (c.rank(), c.world_rank())).collect::<Vec<_>>(), vec![(0, 0), (1, 2), (2, 3)]);
        on_each(&grown, |c| async move { exercise(c).await }).await;
        println!("replacement done: {:?}", grown.iter().map(|c| c.world_rank()).collect::<Vec<_>>());
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "current_thread")]
async fn a_rank_that_was_itself_stalled_does_not_declare_its_peers_dead() {
    tokio::time::timeout(TEST_LIMIT, async {
        let fast = NexarConfig::builder()
            .heartbeat_interval(Duration::from_millis(100))
            .heartbeat_timeout(Duration::from_millis(1000))
            .build()
            .unwrap();
        let ranks = NexarClient::bootstrap_local_with(3, fast).await.unwrap();
        // Every rank lives on this one thread: blocking it stalls them all, as a paused VM or
        // a swapped-out process would. Nobody was really silent.
        std::thread::sleep(Duration::from_millis(2500));
        tokio::time::sleep(Duration::from_millis(600)).await;
        for c in &ranks {
            assert!(c.failed_ranks().is_empty(), "rank {} blamed its peers for its own stall", c.rank());
        }
        on_each(&ranks, |c| async move { exercise(c).await }).await;
    })
    .await
    .expect("test timed out");
}
