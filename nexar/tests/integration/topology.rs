//! Sparse topologies: each rank connects to a few neighbours and everything else is relayed.
//! Every collective, send/recv and RPC must give the same results as on a full mesh, and a
//! relay that dies must be routed around.

use std::time::{Duration, Instant};

use nexar::prelude::*;
use nexar::{NetChaos, Silence, Topology};

use crate::common::{TEST_LIMIT, on_each, pattern, same_bytes};

#[nexar::rpc]
fn whoami(x: u32) -> (u32, u32) {
    (x, x * 2)
}

/// Every operation, checked, on `comm`.
async fn everything(comm: NexarClient) {
    let (r, w) = (comm.rank(), comm.world_size());
    for len in [1usize, 7919, 300_000] {
        let mut v: Vec<f32> = (0..len).map(|i| (i % 3 + r) as f32).collect();
        comm.all_reduce(&mut v, Sum).await.unwrap();
        assert!(v.iter().enumerate().all(|(i, x)| *x == (w * (i % 3) + w * (w - 1) / 2) as f32));
    }
    let root = w / 2;
    let mut b = if r == root { pattern::<u64>(5000, 3) } else { vec![0; 5000] };
    comm.broadcast(&mut b, root).await.unwrap();
    assert!(same_bytes(&b, &pattern::<u64>(5000, 3)));
    let mut red = vec![r as i64; 10];
    comm.reduce(&mut red, Max, 0).await.unwrap();
    if r == 0 {
        assert_eq!(red, vec![w as i64 - 1; 10]);
    }
    let mut all = vec![0u32; w];
    comm.all_gather(&[r as u32], &mut all).await.unwrap();
    assert_eq!(all, (0..w as u32).collect::<Vec<_>>());
    let mut mine = vec![0u32; 2];
    comm.reduce_scatter(&vec![1u32; 2 * w], &mut mine, Sum).await.unwrap();
    assert_eq!(mine, vec![w as u32; 2]);
    let send: Vec<u16> = (0..w).map(|q| (r * 100 + q) as u16).collect();
    let mut recv = vec![0u16; w];
    comm.all_to_all(&send, &mut recv).await.unwrap();
    assert_eq!(recv, (0..w).map(|q| (q * 100 + r) as u16).collect::<Vec<_>>());
    let mut gathered = vec![0u8; if r == 1 { w } else { 0 }];
    comm.gather(&[r as u8], &mut gathered, 1).await.unwrap();
    if r == 1 {
        assert_eq!(gathered, (0..w as u8).collect::<Vec<_>>());
    }
    let mut one = [0u8];
    let pieces: Vec<u8> = if r == 0 { (0..w as u8).map(|q| q + 10).collect() } else { vec![] };
    comm.scatter(&pieces, &mut one, 0).await.unwrap();
    assert_eq!(one, [r as u8 + 10]);
    let mut s = [1u64];
    comm.exclusive_scan(&mut s, Sum).await.unwrap();
    if r > 0 {
        assert_eq!(s, [r as u64]);
    }
    comm.barrier().await.unwrap();
    // Messages and calls to every other rank, neighbour or not.
    for q in (0..w).filter(|q| *q != r) {
        comm.send(&pattern::<u32>(100 + q, r as u64), q, 77).await.unwrap();
    }
    for q in (0..w).filter(|q| *q != r) {
        let got = comm.recv_vec::<u32>(q, 77).await.unwrap();
        assert!(same_bytes(&got, &pattern::<u32>(100 + r, q as u64)), "message from {q}");
        assert_eq!(whoami::call(&comm, q, r as u32).await.unwrap(), (r as u32, 2 * r as u32));
        comm.ping(q).await.unwrap();
    }
    comm.barrier().await.unwrap();
}

async fn check(topology: Topology, world: usize, degree: usize) {
    let cfg = NexarConfig::builder().topology(topology).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(world, cfg).await.unwrap();
    for c in &ranks {
        let peers = c.connected_peers();
        assert_eq!(peers, topology.neighbors(c.rank(), world), "{topology:?}");
        assert!(peers.len() <= degree, "{topology:?}: rank {} has {} links", c.rank(), peers.len());
    }
    on_each(&ranks, everything).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_works_on_a_ring() {
    tokio::time::timeout(TEST_LIMIT, check(Topology::KRegular(2), 6, 2)).await.expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_works_on_a_hypercube_and_a_4_regular_graph() {
    tokio::time::timeout(TEST_LIMIT, async {
        check(Topology::Hypercube, 8, 3).await;
        check(Topology::Hypercube, 5, 3).await;
        check(Topology::KRegular(4), 7, 4).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_is_rerouted_around_a_dead_relay() {
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().topology(Topology::KRegular(2)).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(6, cfg).await.unwrap();
        // On the ring 0-1-2-3-4-5-0, rank 0 reaches rank 2 through rank 1.
        ranks[0].send(&[1u8], 2, 5).await.unwrap();
        assert_eq!(ranks[2].recv_vec::<u8>(0, 5).await.unwrap(), vec![1]);
        let mut watch = ranks[3].failure_watch();
        ranks[1].abort("relay crashed");
        // Rank 3 is not a neighbour of rank 1: it learns through the others.
        assert_eq!(watch.next().await.unwrap().rank, 1);
        while !ranks[0].failed_ranks().contains(&1) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // Now the long way round: 0-5-4-3-2.
        ranks[0].send(&[2u8], 2, 5).await.unwrap();
        assert_eq!(ranks[2].recv_vec::<u8>(0, 5).await.unwrap(), vec![2]);
        assert_eq!(whoami::call(&ranks[2], 0, 9).await.unwrap(), (9, 18));
        let survivors: Vec<_> = ranks.iter().filter(|c| c.rank() != 1).cloned().collect();
        let rebuilt = on_each(&survivors, |c| async move { c.recover().await.unwrap() }).await;
        on_each(&rebuilt, everything).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_hypercube_a_silent_rank_is_found_by_the_ranks_that_watch_it_over_relays() {
    tokio::time::timeout(TEST_LIMIT, async {
        // On a 16-rank hypercube rank 0 links to 1, 2, 4 and 8. Watching around a ring of only
        // the linked ranks left it watched by nobody (each of its neighbours has others after
        // it), so its silence showed only when QUIC's idle timeout (30 s) closed its links.
        let cfg = NexarConfig::builder()
            .topology(Topology::Hypercube)
            .heartbeat_interval(Duration::from_millis(100))
            .heartbeat_timeout(Duration::from_millis(1000))
            .build()
            .unwrap();
        let silence = Silence::default();
        let mut cfgs = vec![cfg; 16];
        cfgs[0].chaos = Some(NetChaos { silence: silence.clone(), ..NetChaos::default() });
        let ranks = NexarClient::bootstrap_local_each(cfgs).await.unwrap();
        assert!(!ranks[15].connected_peers().contains(&0));
        // A while of heartbeats, relayed where the ranks have no link, with nobody suspected.
        on_each(&ranks, |c| async move {
            for _ in 0..10 {
                c.barrier().await.unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        for c in &ranks {
            assert!(c.failed_ranks().is_empty(), "rank {} lost {:?}", c.rank(), c.failed_ranks());
        }
        let mut watch = ranks[15].failure_watch();
        let start = Instant::now();
        silence.set(true);
        let failure = watch.next().await.unwrap();
        let took = start.elapsed();
        assert_eq!(failure.rank, 0, "{failure:?}");
        assert!(failure.reason.contains("answered neither a ping"), "{failure:?}");
        assert!(took < Duration::from_secs(10), "found after {took:?}, as by the idle timeout");
        // Every rank learns of it (and routes around it) before the survivors agree: what was
        // in flight through the silent rank is lost with it.
        for c in &ranks[1..] {
            while !c.failed_ranks().contains(&0) {
                assert!(start.elapsed() < Duration::from_secs(20), "rank {} never learnt of rank 0", c.rank());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let survivors: Vec<_> = ranks[1..].to_vec();
        let rebuilt = on_each(&survivors, |c| async move { c.recover().await.unwrap() }).await;
        on_each(&rebuilt, |c| async move { c.barrier().await.unwrap() }).await;
        silence.set(false);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_the_largest_allowed_size_is_relayed() {
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().topology(Topology::KRegular(2)).max_message_bytes(1 << 20).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(4, cfg).await.unwrap();
        // Rank 2 is not a neighbour of rank 0: the envelope is a little larger than the limit.
        let big = pattern::<u8>(1 << 20, 5);
        ranks[0].send(&big, 2, 1).await.unwrap();
        assert!(same_bytes(&ranks[2].recv_vec::<u8>(0, 1).await.unwrap(), &big));
        for c in &ranks {
            assert!(c.failed_ranks().is_empty(), "a relay was cut for carrying a legal message");
        }
    })
    .await
    .expect("test timed out");
}

/// A ring formed through a real seed: the public relay keys come from the seed's peer table,
/// and every relayed operation (messages, calls, collectives) works with its envelopes sealed
/// end to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_formed_through_a_seed_seals_what_it_relays() {
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().world_size(5).topology(Topology::KRegular(2)).build().unwrap();
        let seed = nexar::SeedNode::bind("127.0.0.1:0".parse().unwrap(), cfg.clone()).await.unwrap();
        let (addr, token) = (seed.local_addr(), seed.token().to_string());
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..5 {
            let (token, cfg) = (token.clone(), cfg.clone());
            workers.spawn(async move { NexarClient::connect(addr, &token, cfg).await.unwrap() });
        }
        let mut ranks = Vec::new();
        while let Some(rank) = workers.join_next().await {
            ranks.push(rank.unwrap());
        }
        ranks.sort_by_key(|c| c.rank());
        for c in &ranks {
            assert_eq!(c.connected_peers(), Topology::KRegular(2).neighbors(c.rank(), 5));
        }
        on_each(&ranks, everything).await;
    })
    .await
    .expect("test timed out");
}
