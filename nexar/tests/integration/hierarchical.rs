//! The two-level allreduce over real links: ranks of this machine placed on fake hosts with
//! `NexarConfig::host_id` (`NEXAR_HOST_ID`), shared memory within a host and the network
//! between hosts. Every rank learns the same layout, large allreduces run two-level, integers
//! come out bitwise equal to the flat ring's and floats within rounding of the exact sum,
//! broadcasts (through a leader per host) deliver the root's bytes from every root, and
//! reduces (within each host to its leader, then among the leaders) leave the sum at every
//! root in turn and every other buffer as it was, all-gathers (across hosts per local index,
//! then within each host) deliver every block, and reduce-scatters (within each host, then
//! across) leave each rank its block's sum.

use nexar::{Algorithm, NexarClient, NexarConfig, Sum};

use crate::common;
use crate::common::{TEST_LIMIT, on_each};

/// Ranks whose hosts are `hosts[rank]`, the allreduce algorithm pinned where `pinned` says.
async fn on_hosts(hosts: &[&str], pinned: Option<Algorithm>) -> Vec<NexarClient> {
    let configs = hosts
        .iter()
        .map(|h| {
            let mut cfg = NexarConfig::builder().host_id(*h).build().unwrap();
            cfg.allreduce_algorithm = pinned;
            cfg
        })
        .collect();
    NexarClient::bootstrap_local_each(configs).await.unwrap()
}

fn int(r: usize, i: usize) -> u64 {
    (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

fn float(r: usize, i: usize) -> f32 {
    ((r * 7919 + i * 104_729) % 10_007) as f32 / 10_007.0 - 0.5
}

/// Broadcasts from every root in turn of `len` bytes: every rank ends with the root's bytes.
async fn broadcasts_arrive(ranks: &[NexarClient], len: usize) {
    let w = ranks.len();
    on_each(ranks, move |c| async move {
        for root in 0..w {
            let fill = |r: usize| (0..len).map(|i| (i * 31 + r * 7) as u8).collect::<Vec<u8>>();
            let mut buf = fill(c.rank());
            tokio::time::timeout(TEST_LIMIT, c.broadcast(&mut buf[..], root)).await.unwrap().unwrap();
            assert!(buf == fill(root), "rank {}: the broadcast from {root} differs", c.rank());
        }
    })
    .await;
}

/// Reduces to every root in turn of `len` integers: the root ends with the wrapping sum, every
/// other rank with its buffer as it was (the two-level reduce keeps host partials in scratch).
async fn reduces_arrive(ranks: &[NexarClient], len: usize) {
    let w = ranks.len();
    on_each(ranks, move |c| async move {
        for root in 0..w {
            let mut buf: Vec<u64> = (0..len).map(|i| int(c.rank(), i)).collect();
            tokio::time::timeout(TEST_LIMIT, c.reduce(&mut buf[..], Sum, root)).await.unwrap().unwrap();
            let want = |i: usize| match c.rank() == root {
                true => (0..w).fold(0u64, |a, q| a.wrapping_add(int(q, i))),
                false => int(c.rank(), i),
            };
            assert!(buf.iter().enumerate().all(|(i, v)| *v == want(i)), "rank {}: the reduce to {root}", c.rank());
        }
    })
    .await;
}

/// An all-gather of `len` integers per rank: every rank ends with every block in rank order.
async fn gathers_arrive(ranks: &[NexarClient], len: usize) {
    let w = ranks.len();
    on_each(ranks, move |c| async move {
        let mine: Vec<u64> = (0..len).map(|i| int(c.rank(), i)).collect();
        let mut all = vec![0u64; len * w];
        tokio::time::timeout(TEST_LIMIT, c.all_gather(&mine[..], &mut all[..])).await.unwrap().unwrap();
        let want: Vec<u64> = (0..w).flat_map(|q| (0..len).map(move |i| int(q, i))).collect();
        assert!(all == want, "rank {}: the all-gather differs", c.rank());
    })
    .await;
}

/// A reduce-scatter of `len` integers per rank: every rank ends with its block's wrapping sum.
async fn scatters_arrive(ranks: &[NexarClient], len: usize) {
    let w = ranks.len();
    on_each(ranks, move |c| async move {
        let all: Vec<u64> = (0..len * w).map(|i| int(c.rank(), i)).collect();
        let mut mine = vec![0u64; len];
        tokio::time::timeout(TEST_LIMIT, c.reduce_scatter(&all[..], &mut mine[..], Sum)).await.unwrap().unwrap();
        let want = |i: usize| (0..w).fold(0u64, |a, q| a.wrapping_add(int(q, c.rank() * len + i)));
        assert!(mine.iter().enumerate().all(|(i, v)| *v == want(i)), "rank {}: the reduce-scatter differs", c.rank());
    })
    .await;
}

/// An all-to-all of `len` integers per block: every rank ends with block `r` of each rank's
/// send buffer, in rank order, whichever algorithm the block size picks.
async fn exchanges_arrive(ranks: &[NexarClient], len: usize) {
    let w = ranks.len();
    on_each(ranks, move |c| async move {
        let r = c.rank();
        let send: Vec<u64> = (0..len * w).map(|i| int(r, i)).collect();
        let mut recv = vec![0u64; len * w];
        tokio::time::timeout(TEST_LIMIT, c.all_to_all(&send[..], &mut recv[..])).await.unwrap().unwrap();
        let want: Vec<u64> = (0..w).flat_map(|q| (r * len..(r + 1) * len).map(move |i| int(q, i))).collect();
        assert!(recv == want, "rank {r}: the all-to-all of {len} per block differs");
    })
    .await;
}

/// Every rank leaves, all at once (like `MPI_Finalize`, each waits for the others' goodbyes).
async fn shutdown(ranks: &[NexarClient]) {
    on_each(ranks, |c| async move { c.shutdown().await }).await;
}

/// Every rank's integer and float allreduce of `len` elements.
async fn sums(ranks: &[NexarClient], len: usize) -> Vec<(Vec<u64>, Vec<f32>)> {
    on_each(ranks, move |c| async move {
        let r = c.rank();
        let mut ints: Vec<u64> = (0..len).map(|i| int(r, i)).collect();
        let mut floats: Vec<f32> = (0..len).map(|i| float(r, i)).collect();
        tokio::time::timeout(TEST_LIMIT, c.all_reduce(&mut ints[..], Sum)).await.unwrap().unwrap();
        tokio::time::timeout(TEST_LIMIT, c.all_reduce(&mut floats[..], Sum)).await.unwrap().unwrap();
        (ints, floats)
    })
    .await
}

async fn two_level_matches_flat(hosts: &[&str]) {
    let w = hosts.len();
    let len = 1 << 19; // 4 MiB of u64: the ring's size, so two-level where the hosts allow
    let ranks = on_hosts(hosts, None).await;
    for c in &ranks {
        let layout = c.host_layout().expect("the layout is learnt when the cluster forms");
        assert_eq!(layout.hosts(), 2, "rank {}", c.rank());
        assert_eq!(c.allreduce_algorithm(len * 8), "hierarchical", "rank {}", c.rank());
        assert_eq!(c.allreduce_algorithm(4096), "recursive_doubling");
        assert_eq!(c.host_layout().unwrap().members(0).len(), 2);
        for p in (0..w).filter(|p| *p != c.rank()) {
            let same = hosts[p] == hosts[c.rank()];
            assert_eq!(c.bulk_transport(p) == Some("shm"), same, "rank {} to {p}", c.rank());
        }
    }
    let two_level = sums(&ranks, len).await;
    broadcasts_arrive(&ranks, 3 << 20).await;
    broadcasts_arrive(&ranks, 1000).await;
    reduces_arrive(&ranks, 3 << 17).await;
    reduces_arrive(&ranks, 7).await;
    gathers_arrive(&ranks, 3 << 17).await;
    gathers_arrive(&ranks, 5).await;
    scatters_arrive(&ranks, 3 << 17).await;
    scatters_arrive(&ranks, 5).await;
    for c in &ranks {
        assert_eq!(c.all_to_all_algorithm(4096), "hierarchical", "rank {}", c.rank());
        assert_eq!(c.all_to_all_algorithm(1 << 20), "pairwise", "rank {}", c.rank());
    }
    exchanges_arrive(&ranks, 3).await;
    exchanges_arrive(&ranks, 512).await;
    exchanges_arrive(&ranks, 1 << 17).await;
    shutdown(&ranks).await;
    let flat_ranks = on_hosts(hosts, Some(Algorithm::PipelinedRing { segment_bytes: 1 << 20 })).await;
    assert_eq!(flat_ranks[0].allreduce_algorithm(len * 8), "pipelined_ring");
    let flat = sums(&flat_ranks, len).await;
    shutdown(&flat_ranks).await;
    for (r, ((ints, floats), (flat_ints, _))) in two_level.iter().zip(&flat).enumerate() {
        assert!(ints == flat_ints, "{hosts:?}: rank {r}'s integers differ from the flat ring's");
        assert!(floats.iter().zip(&two_level[0].1).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r} differs");
        for (i, got) in floats.iter().enumerate() {
            let exact: f64 = (0..w).map(|q| float(q, i) as f64).sum();
            assert!((*got as f64 - exact).abs() <= 1e-5 * w as f64, "{hosts:?} element {i}: {got} vs {exact}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_on_two_fake_hosts_allreduce_in_two_levels() {
    common::logs();
    two_level_matches_flat(&["a", "a", "b", "b"]).await;
    // Round-robin placement: the flat ring would cross hosts at every hop.
    two_level_matches_flat(&["a", "b", "a", "b"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_of_different_sizes_stay_flat_and_correct() {
    let ranks = on_hosts(&["a", "a", "b"], Some(Algorithm::Hierarchical { segment_bytes: 1 << 20 })).await;
    // Pinned, but the hosts hold 2 and 1 ranks: the size table's flat choice.
    assert_eq!(ranks[0].allreduce_algorithm(64 << 20), "pipelined_ring");
    let got = sums(&ranks, 1 << 20).await;
    // Two-level broadcasts and reduces need no equal hosts.
    broadcasts_arrive(&ranks, 3 << 20).await;
    reduces_arrive(&ranks, 100_003).await;
    // The all-to-all too stays flat where the hosts differ in size.
    assert_eq!(ranks[0].all_to_all_algorithm(4096), "pairwise");
    exchanges_arrive(&ranks, 512).await;
    for (r, (ints, _)) in got.iter().enumerate() {
        assert!(
            ints.iter().enumerate().all(|(i, v)| *v == (0..3).fold(0u64, |a, q| a.wrapping_add(int(q, i)))),
            "rank {r}"
        );
    }
}
