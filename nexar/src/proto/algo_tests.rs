//! Every algorithm against a sequential reference, in the simulator: world sizes 1–16, counts
//! 0, 1, w−1, w, w+1, a prime and 3,000,001, for f32 Sum and Max, i64 BitXor, f16 and bf16 Sum.

use nexar_types::{DType, Element, ReduceOp, bf16, f16, reduce_slice};

use super::algo::{Algorithm, Collective, generate};
use super::sim::{SimRank, simulate};

const PRIME: usize = 7919;
const LARGE: usize = 3_000_001;

/// Every (operation, algorithm) pair the generators implement, for a root of `root`.
fn pairs(root: usize) -> Vec<(Collective, Algorithm)> {
    use Algorithm::*;
    vec![
        (Collective::AllReduce, Ring),
        (Collective::AllReduce, PipelinedRing { segment_bytes: 4096 }),
        (Collective::AllReduce, HalvingDoubling),
        (Collective::AllReduce, RecursiveDoubling),
        (Collective::Broadcast { root }, BinomialTree),
        (Collective::Broadcast { root }, PipelinedChain { segment_bytes: 4096 }),
        (Collective::Reduce { root }, BinomialTree),
        (Collective::AllGather, Ring),
        (Collective::AllGather, PipelinedRing { segment_bytes: 4096 }),
        (Collective::ReduceScatter, Ring),
        (Collective::ReduceScatter, PipelinedRing { segment_bytes: 4096 }),
        (Collective::AllToAll, Pairwise),
        (Collective::AllToAll, PipelinedPairwise { segment_bytes: 4096 }),
        (Collective::Gather { root }, Linear),
        (Collective::Scatter { root }, Linear),
        (Collective::Scan, PrefixDoubling),
        (Collective::ExclusiveScan, PrefixDoubling),
        (Collective::Barrier, Dissemination),
        (Collective::Barrier, TwoPhase),
    ]
}

/// Input and data lengths of one rank for `op` with per-rank count `n`.
fn lengths(op: Collective, n: usize, w: usize) -> (usize, usize) {
    match op {
        Collective::AllGather | Collective::Gather { .. } => (n, n * w),
        Collective::ReduceScatter | Collective::Scatter { .. } => (n * w, n),
        Collective::AllToAll => (n * w, n * w),
        Collective::Barrier => (0, 0),
        _ => (0, n),
    }
}

fn fold<T: Element>(op: ReduceOp, parts: impl Iterator<Item = Vec<T>>) -> Vec<T> {
    let mut acc: Option<Vec<T>> = None;
    for p in parts {
        match &mut acc {
            None => acc = Some(p),
            Some(a) => reduce_slice(op, a, &p).unwrap(),
        }
    }
    acc.unwrap_or_default()
}

/// What every rank's data buffer must hold afterwards.
fn reference<T: Element>(op: Collective, red: ReduceOp, before: &[SimRank<T>], n: usize) -> Vec<Vec<T>> {
    let w = before.len();
    let data = |r: usize| before[r].data.clone();
    let input = |r: usize| before[r].input.clone();
    let block = |v: Vec<T>, i: usize| v[i * n..(i + 1) * n].to_vec();
    (0..w)
        .map(|r| match op {
            Collective::AllReduce => fold(red, (0..w).map(data)),
            Collective::Broadcast { root } => data(root),
            Collective::Reduce { root } if r == root => fold(red, (0..w).map(data)),
            Collective::Reduce { .. } => data(r),
            Collective::AllGather => (0..w).flat_map(input).collect(),
            Collective::ReduceScatter => block(fold(red, (0..w).map(input)), r),
            Collective::AllToAll => (0..w).flat_map(|j| block(input(j), r)).collect(),
            Collective::Gather { root } if r == root => (0..w).flat_map(input).collect(),
            Collective::Gather { .. } => data(r),
            Collective::Scatter { root } => block(input(root), r),
            Collective::Scan => fold(red, (0..=r).map(data)),
            Collective::ExclusiveScan if r == 0 => data(0),
            Collective::ExclusiveScan => fold(red, (0..r).map(data)),
            Collective::Barrier => data(r),
        })
        .collect()
}

/// Runs one case and compares with the reference; `close` decides element equality.
fn check<T: Element>(
    op: Collective,
    algo: Algorithm,
    red: ReduceOp,
    w: usize,
    n: usize,
    value: impl Fn(usize, usize) -> T,
    close: impl Fn(T, T) -> bool,
) {
    let (in_len, data_len) = lengths(op, n, w);
    let mut ranks: Vec<SimRank<T>> = (0..w)
        .map(|r| SimRank {
            input: (0..in_len).map(|i| value(r, i)).collect(),
            data: (0..data_len).map(|i| value(r + 100, i)).collect(),
        })
        .collect();
    let want = reference(op, red, &ranks, n);
    let schedules: Vec<_> =
        (0..w).map(|r| generate(op, algo, r, w, n, T::DTYPE.size()).expect("pair is supported")).collect();
    simulate(&schedules, &mut ranks, red).unwrap_or_else(|e| panic!("{op:?} {algo} w={w} n={n}: {e}"));
    for (r, (got, want)) in ranks.iter().zip(&want).enumerate() {
        assert_eq!(got.data.len(), want.len());
        if let Some(i) = got.data.iter().zip(want).position(|(a, b)| !close(*a, *b)) {
            panic!(
                "{op:?} {algo} {red} {} w={w} n={n}: rank {r} element {i} is {:?}, expected {:?}",
                T::DTYPE,
                got.data[i],
                want[i]
            );
        }
    }
}

fn counts(w: usize) -> Vec<usize> {
    let mut c = vec![0, 1, w.saturating_sub(1), w, w + 1, PRIME];
    c.dedup();
    c
}

/// Small integers: every sum and max is exact in every element type and in any order.
fn small(r: usize, i: usize) -> f32 {
    ((r * 31 + i * 7) % 11) as f32 - 5.0
}

fn bits(r: usize, i: usize) -> i64 {
    let x = (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x as i64
}

fn all_types_for_world(w: usize) {
    for root in [0, w / 2, w - 1] {
        for (op, algo) in pairs(root) {
            if op.root().is_none() && root != 0 {
                continue;
            }
            for n in counts(w) {
                check(op, algo, ReduceOp::Sum, w, n, small, |a: f32, b| a == b);
                check(op, algo, ReduceOp::Max, w, n, small, |a: f32, b| a == b);
                check(op, algo, ReduceOp::BitXor, w, n, bits, |a: i64, b| a == b);
                let tol = |a: f32, b: f32| (a - b).abs() <= 1e-2 * b.abs().max(1.0);
                check(
                    op,
                    algo,
                    ReduceOp::Sum,
                    w,
                    n,
                    |r, i| f16::from_f32(small(r, i)),
                    |a: f16, b| tol(a.to_f32(), b.to_f32()),
                );
                check(
                    op,
                    algo,
                    ReduceOp::Sum,
                    w,
                    n,
                    |r, i| bf16::from_f32(small(r, i)),
                    |a: bf16, b| tol(a.to_f32(), b.to_f32()),
                );
            }
        }
    }
}

#[test]
fn every_algorithm_matches_the_reference_for_worlds_1_to_4() {
    for w in 1..=4 {
        all_types_for_world(w);
    }
}

#[test]
fn every_algorithm_matches_the_reference_for_worlds_5_to_8() {
    for w in 5..=8 {
        all_types_for_world(w);
    }
}

#[test]
fn every_algorithm_matches_the_reference_for_worlds_9_to_12() {
    for w in 9..=12 {
        all_types_for_world(w);
    }
}

#[test]
fn every_algorithm_matches_the_reference_for_worlds_13_to_16() {
    for w in 13..=16 {
        all_types_for_world(w);
    }
}

#[test]
fn every_algorithm_handles_3_000_001_elements() {
    // Buffer-sized operations at every world size; block operations (whose buffers are
    // count × world) at the world sizes where that fits comfortably in memory.
    for w in 1..=16 {
        for (op, algo) in pairs(w / 2) {
            let (input, data) = lengths(op, LARGE, w);
            if input.max(data) > 4 * LARGE {
                continue;
            }
            check(op, algo, ReduceOp::Sum, w, LARGE, small, |a: f32, b| a == b);
        }
    }
}

#[test]
fn schedules_are_deterministic_and_move_the_expected_volume() {
    // Ring allreduce sends 2(w-1) chunks of count/w; halving-doubling 2 log2 w messages.
    let (w, n) = (8, 8000);
    let ring = generate(Collective::AllReduce, Algorithm::Ring, 3, w, n, 4).unwrap();
    assert_eq!(ring.send_volume(), (2 * (w - 1), 2 * (w - 1) * n / w));
    let hd = generate(Collective::AllReduce, Algorithm::HalvingDoubling, 3, w, n, 4).unwrap();
    assert_eq!(hd.send_volume(), (6, 2 * n * (w - 1) / w));
    assert_eq!(hd, generate(Collective::AllReduce, Algorithm::HalvingDoubling, 3, w, n, 4).unwrap());
    assert!(generate(Collective::AllReduce, Algorithm::Linear, 0, 2, 1, 4).is_err());
    assert_eq!(DType::F32.size(), 4);
}

/// In a ring of two and in the all-to-all, a rank's own segments go out two ahead of its
/// receives, never all at once (a whole block posted at once waited in the peer's mailbox).
#[test]
fn block_collectives_send_their_own_segments_only_a_little_ahead_of_their_receives() {
    use super::schedule::Step;
    let segment_bytes = 1 << 10;
    let algo = Algorithm::PipelinedRing { segment_bytes };
    let pairwise = Algorithm::PipelinedPairwise { segment_bytes };
    // 8 segments of 256 f32 per block.
    for (op, algo, w) in [
        (Collective::ReduceScatter, algo, 2),
        (Collective::AllGather, algo, 2),
        (Collective::AllToAll, pairwise, 2),
        (Collective::AllToAll, pairwise, 4),
    ] {
        let s = generate(op, algo, 1, w, 8 * 256, 4).unwrap();
        let mut ahead = 0i64;
        let mut most = 0;
        for step in &s.steps {
            match step {
                Step::Send { .. } => ahead += 1,
                Step::Recv { .. } => ahead -= 1,
                _ => {}
            }
            most = most.max(ahead);
        }
        assert_eq!(most, 2, "{op:?} {algo} w={w}: {} sends ahead of receives at most", most);
    }
}

#[test]
fn the_size_table_picks_the_tree_for_small_broadcasts_and_the_chain_for_large_ones() {
    use super::algo::{BROADCAST_PAIR_TREE_BYTES, BROADCAST_TREE_BYTES, select};
    let bcast = Collective::Broadcast { root: 0 };
    let chain = |a| matches!(a, Algorithm::PipelinedChain { .. });
    assert_eq!(select(bcast, BROADCAST_TREE_BYTES, 4), Algorithm::BinomialTree);
    assert!(chain(select(bcast, BROADCAST_TREE_BYTES + 1, 4)));
    // Between two ranks the one message wins up to a larger size.
    assert_eq!(select(bcast, BROADCAST_PAIR_TREE_BYTES, 2), Algorithm::BinomialTree);
    assert!(chain(select(bcast, BROADCAST_PAIR_TREE_BYTES + 1, 2)));
}

/// Host layouts the two-level allreduce is checked on: contiguous, round-robin and shuffled
/// placements, with 1 to 4 ranks per host.
fn layouts() -> Vec<Vec<u64>> {
    vec![
        vec![0, 0, 1, 1],
        vec![0, 1, 0, 1],
        vec![5, 5, 5, 9, 9, 9],
        vec![0, 1, 2, 0, 1, 2],
        vec![3, 1, 1, 3, 2, 2, 2, 3, 1],
        vec![0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3],
        vec![0, 1, 2, 3],
        vec![4, 4, 4],
    ]
}

/// Runs the two-level allreduce on `keys`' layout in the simulator: every rank's result.
fn two_level<T: Element>(keys: &[u64], n: usize, red: ReduceOp, value: impl Fn(usize, usize) -> T) -> Vec<Vec<T>> {
    use super::algo::generate_on;
    use super::algo::hierarchical::HostLayout;
    let layout = HostLayout::from_keys(keys);
    let w = keys.len();
    let algo = Algorithm::Hierarchical { segment_bytes: 4096 };
    let mut ranks: Vec<SimRank<T>> =
        (0..w).map(|r| SimRank { input: Vec::new(), data: (0..n).map(|i| value(r, i)).collect() }).collect();
    let schedules: Vec<_> = (0..w)
        .map(|r| generate_on(Collective::AllReduce, algo, r, w, n, T::DTYPE.size(), Some(&layout)).unwrap())
        .collect();
    simulate(&schedules, &mut ranks, red).unwrap_or_else(|e| panic!("hierarchical {keys:?} n={n}: {e}"));
    ranks.into_iter().map(|r| r.data).collect()
}

#[test]
fn the_two_level_allreduce_matches_the_reference_on_every_layout() {
    for keys in layouts() {
        let w = keys.len();
        for n in [0, 1, w - 1, w, w + 1, PRIME, LARGE] {
            let want_xor = fold(ReduceOp::BitXor, (0..w).map(|r| (0..n).map(|i| bits(r, i)).collect()));
            for (r, got) in two_level(&keys, n, ReduceOp::BitXor, bits).iter().enumerate() {
                assert!(got == &want_xor, "{keys:?} n={n}: rank {r}'s xor differs from the reference");
            }
            if n > PRIME {
                continue;
            }
            let want = fold(ReduceOp::Sum, (0..w).map(|r| (0..n).map(|i| small(r, i)).collect()));
            for (r, got) in two_level(&keys, n, ReduceOp::Sum, small).iter().enumerate() {
                assert!(got == &want, "{keys:?} n={n}: rank {r}'s sum differs from the reference");
            }
        }
    }
}

/// Integers come out bitwise equal to the flat ring's; floats (added in another order) within
/// rounding, and the same on every rank.
#[test]
fn flat_and_two_level_agree_bitwise_for_integers_and_closely_for_floats() {
    let float = |r: usize, i: usize| ((r * 7919 + i * 104_729) % 10_007) as f32 / 10_007.0 - 0.5;
    for keys in layouts() {
        let w = keys.len();
        let n = 10_000;
        let flat = |red, v: &dyn Fn(usize, usize) -> i64| {
            let mut ranks: Vec<SimRank<i64>> =
                (0..w).map(|r| SimRank { input: Vec::new(), data: (0..n).map(|i| v(r, i)).collect() }).collect();
            let s: Vec<_> =
                (0..w).map(|r| generate(Collective::AllReduce, Algorithm::Ring, r, w, n, 8).unwrap()).collect();
            simulate(&s, &mut ranks, red).unwrap();
            ranks.into_iter().map(|r| r.data).collect::<Vec<_>>()
        };
        let sum_int = |r: usize, i: usize| bits(r, i) >> 8;
        assert_eq!(two_level(&keys, n, ReduceOp::Sum, sum_int), flat(ReduceOp::Sum, &sum_int), "{keys:?}");
        let got = two_level(&keys, n, ReduceOp::Sum, float);
        for i in 0..n {
            let exact: f64 = (0..w).map(|r| float(r, i) as f64).sum();
            assert!(got.iter().all(|g| g[i].to_bits() == got[0][i].to_bits()), "{keys:?}: ranks differ at {i}");
            assert!(
                (got[0][i] as f64 - exact).abs() <= 1e-5 * w as f64,
                "{keys:?} element {i}: {} vs {exact}",
                got[0][i]
            );
        }
    }
}

#[test]
fn the_size_table_goes_two_level_only_across_hosts_with_several_ranks_each() {
    use super::algo::hierarchical::HostLayout;
    use super::algo::select_on;
    let large = 64 << 20;
    let two_level = |keys: &[u64], bytes| {
        matches!(
            select_on(Collective::AllReduce, bytes, keys.len(), Some(&HostLayout::from_keys(keys))),
            Algorithm::Hierarchical { .. }
        )
    };
    assert!(two_level(&[0, 0, 1, 1], large));
    assert!(two_level(&[0, 1, 0, 1], large));
    // One host, one rank per host, or hosts of different sizes: flat.
    assert!(!two_level(&[0, 0, 0, 0], large));
    assert!(!two_level(&[0, 1, 2, 3], large));
    assert!(!two_level(&[0, 0, 1], large));
    // Small messages keep the latency algorithms.
    assert!(!two_level(&[0, 0, 1, 1], 4096));
    assert_eq!(select_on(Collective::AllReduce, large, 4, None).name(), "pipelined_ring");
}

#[test]
fn the_two_level_broadcast_delivers_the_roots_buffer_on_every_layout() {
    use super::algo::generate_on;
    use super::algo::hierarchical::HostLayout;
    for keys in layouts() {
        let layout = HostLayout::from_keys(&keys);
        let w = keys.len();
        for root in 0..w {
            // Below and above the sizes where a level switches from the tree to the chain.
            for n in [0, 1, PRIME, 300_000] {
                let op = Collective::Broadcast { root };
                let algo = Algorithm::Hierarchical { segment_bytes: 1 << 20 };
                let mut ranks: Vec<SimRank<i64>> =
                    (0..w).map(|r| SimRank { input: Vec::new(), data: (0..n).map(|i| bits(r, i)).collect() }).collect();
                let want = ranks[root].data.clone();
                let schedules: Vec<_> =
                    (0..w).map(|r| generate_on(op, algo, r, w, n, 8, Some(&layout)).unwrap()).collect();
                simulate(&schedules, &mut ranks, ReduceOp::Sum)
                    .unwrap_or_else(|e| panic!("broadcast {keys:?} root {root} n={n}: {e}"));
                for (r, got) in ranks.iter().enumerate() {
                    assert!(got.data == want, "broadcast {keys:?} root {root} n={n}: rank {r} differs");
                }
            }
        }
    }
    // The table: two-level wherever a host holds several of several hosts' ranks.
    use super::algo::select_on;
    let bcast = Collective::Broadcast { root: 0 };
    let two = |keys: &[u64]| select_on(bcast, 4096, keys.len(), Some(&HostLayout::from_keys(keys))).name();
    assert_eq!(two(&[0, 0, 1]), "hierarchical");
    assert_eq!(two(&[0, 1, 2]), "binomial_tree");
    assert_eq!(two(&[0, 0, 0]), "binomial_tree");
}

#[test]
fn the_two_level_reduce_leaves_the_sum_at_the_root_and_every_other_buffer_as_it_was() {
    use super::algo::generate_on;
    use super::algo::hierarchical::HostLayout;
    for keys in layouts() {
        let layout = HostLayout::from_keys(&keys);
        let w = keys.len();
        for root in 0..w {
            for n in [0, 1, PRIME, 300_000] {
                let op = Collective::Reduce { root };
                let algo = Algorithm::Hierarchical { segment_bytes: 1 << 20 };
                let schedules: Vec<_> =
                    (0..w).map(|r| generate_on(op, algo, r, w, n, 8, Some(&layout)).unwrap()).collect();
                for (red, value) in
                    [(ReduceOp::BitXor, bits as fn(usize, usize) -> i64), (ReduceOp::Sum, |r, i| bits(r, i) >> 8)]
                {
                    let mut ranks: Vec<SimRank<i64>> = (0..w)
                        .map(|r| SimRank { input: Vec::new(), data: (0..n).map(|i| value(r, i)).collect() })
                        .collect();
                    let before: Vec<Vec<i64>> = ranks.iter().map(|r| r.data.clone()).collect();
                    let want = fold(red, before.iter().cloned());
                    simulate(&schedules, &mut ranks, red)
                        .unwrap_or_else(|e| panic!("reduce {keys:?} root {root} n={n}: {e}"));
                    for (r, got) in ranks.iter().enumerate() {
                        let expect = if r == root { &want } else { &before[r] };
                        assert!(&got.data == expect, "reduce {red:?} {keys:?} root {root} n={n}: rank {r} differs");
                    }
                }
            }
        }
    }
    use super::algo::select_on;
    let reduce = Collective::Reduce { root: 0 };
    let table = |keys: &[u64]| select_on(reduce, 4096, keys.len(), Some(&HostLayout::from_keys(keys))).name();
    assert_eq!(table(&[0, 0, 1]), "hierarchical");
    assert_eq!(table(&[0, 1, 2]), "binomial_tree");
    assert_eq!(table(&[0, 0, 0]), "binomial_tree");
}

#[test]
fn the_two_level_all_gather_delivers_every_block_on_every_layout() {
    use super::algo::generate_on;
    use super::algo::hierarchical::HostLayout;
    for keys in layouts() {
        let layout = HostLayout::from_keys(&keys);
        let w = keys.len();
        for n in [0, 1, PRIME, 100_000] {
            let algo = Algorithm::Hierarchical { segment_bytes: 1 << 16 };
            let schedules: Vec<_> =
                (0..w).map(|r| generate_on(Collective::AllGather, algo, r, w, n, 8, Some(&layout)).unwrap()).collect();
            let mut ranks: Vec<SimRank<i64>> =
                (0..w).map(|r| SimRank { input: (0..n).map(|i| bits(r, i)).collect(), data: vec![0; n * w] }).collect();
            simulate(&schedules, &mut ranks, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("all-gather {keys:?} n={n}: {e}"));
            let want: Vec<i64> = (0..w).flat_map(|q| (0..n).map(move |i| bits(q, i))).collect();
            for (r, got) in ranks.iter().enumerate() {
                assert!(got.data == want, "all-gather {keys:?} n={n}: rank {r} differs");
            }
        }
    }
    // Hosts of different sizes have no two-level all-gather; the table keeps the flat ring.
    let uneven = HostLayout::from_keys(&[0, 0, 1]);
    let pinned = Algorithm::Hierarchical { segment_bytes: 1 << 16 };
    assert!(generate_on(Collective::AllGather, pinned, 0, 3, 10, 8, Some(&uneven)).is_err());
    use super::algo::select_on;
    let table =
        |keys: &[u64]| select_on(Collective::AllGather, 1 << 20, keys.len(), Some(&HostLayout::from_keys(keys))).name();
    assert_eq!(table(&[0, 0, 1, 1]), "hierarchical");
    assert_eq!(table(&[0, 1, 2, 3]), "ring");
    assert_eq!(table(&[0, 0, 1]), "ring");
}

#[test]
fn the_two_level_reduce_scatter_matches_the_reference_on_every_layout() {
    use super::algo::generate_on;
    use super::algo::hierarchical::HostLayout;
    for keys in layouts() {
        let layout = HostLayout::from_keys(&keys);
        let w = keys.len();
        for n in [0, 1, PRIME, 100_000] {
            let algo = Algorithm::Hierarchical { segment_bytes: 1 << 16 };
            let op = Collective::ReduceScatter;
            let schedules: Vec<_> = (0..w).map(|r| generate_on(op, algo, r, w, n, 8, Some(&layout)).unwrap()).collect();
            for (red, value) in
                [(ReduceOp::BitXor, bits as fn(usize, usize) -> i64), (ReduceOp::Sum, |r, i| bits(r, i) >> 8)]
            {
                let mut ranks: Vec<SimRank<i64>> = (0..w)
                    .map(|r| SimRank { input: (0..n * w).map(|i| value(r, i)).collect(), data: vec![0; n] })
                    .collect();
                simulate(&schedules, &mut ranks, red).unwrap_or_else(|e| panic!("reduce-scatter {keys:?} n={n}: {e}"));
                let total = fold(red, (0..w).map(|q| (0..n * w).map(|i| value(q, i)).collect()));
                for (r, got) in ranks.iter().enumerate() {
                    assert!(
                        got.data == total[r * n..(r + 1) * n],
                        "reduce-scatter {red:?} {keys:?} n={n}: rank {r} differs"
                    );
                }
            }
        }
    }
    use super::algo::select_on;
    let table = |keys: &[u64]| {
        select_on(Collective::ReduceScatter, 1 << 20, keys.len(), Some(&HostLayout::from_keys(keys))).name()
    };
    assert_eq!(table(&[0, 1, 0, 1]), "hierarchical");
    assert_eq!(table(&[0, 0, 1]), "ring");
}

#[test]
fn the_two_level_all_to_all_delivers_every_block_to_its_place_on_every_layout() {
    use super::algo::hierarchical::HostLayout;
    use super::algo::{generate_on, select_on};
    for keys in layouts() {
        let layout = HostLayout::from_keys(&keys);
        let w = keys.len();
        if layout.ranks_per_host().is_none() {
            let pinned = Algorithm::Hierarchical { segment_bytes: 1 << 16 };
            assert!(generate_on(Collective::AllToAll, pinned, 0, w, 10, 8, Some(&layout)).is_err(), "{keys:?}");
            continue;
        }
        // Whole blocks, and blocks in several segments.
        for (n, segment_bytes) in [(0, 1 << 20), (1, 1 << 20), (PRIME, 1 << 20), (PRIME, 4096)] {
            let algo = Algorithm::Hierarchical { segment_bytes };
            let schedules: Vec<_> =
                (0..w).map(|r| generate_on(Collective::AllToAll, algo, r, w, n, 8, Some(&layout)).unwrap()).collect();
            let mut ranks: Vec<SimRank<i64>> = (0..w)
                .map(|r| SimRank { input: (0..n * w).map(|i| bits(r, i)).collect(), data: vec![0; n * w] })
                .collect();
            simulate(&schedules, &mut ranks, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("all-to-all {keys:?} n={n}: {e}"));
            for (r, got) in ranks.iter().enumerate() {
                // Block q of rank r is block r of rank q's input.
                let want: Vec<i64> = (0..w).flat_map(|q| (r * n..(r + 1) * n).map(move |i| bits(q, i))).collect();
                assert!(got.data == want, "all-to-all {keys:?} n={n} segment {segment_bytes}: rank {r} differs");
            }
            // Between hosts a rank sends one message per other host (one per segment).
            let host_of = |q: usize| layout.host_of(q);
            for (r, schedule) in schedules.iter().enumerate() {
                let across = schedule
                    .steps
                    .iter()
                    .filter(|s| matches!(s, super::schedule::Step::Send { to, .. } if host_of(*to) != host_of(r)))
                    .count();
                let per_message = (n * layout.ranks_per_host().unwrap()).div_ceil((segment_bytes / 8).max(1)).max(1);
                assert_eq!(across, (layout.hosts() - 1) * per_message, "{keys:?} n={n}: rank {r}");
            }
        }
    }
    let table = |keys: &[u64], block: usize| {
        select_on(Collective::AllToAll, block, keys.len(), Some(&HostLayout::from_keys(keys))).name()
    };
    assert_eq!(table(&[0, 1, 0, 1], 4096), "hierarchical");
    assert_eq!(table(&[0, 1, 0, 1], 1 << 20), "pairwise");
    assert_eq!(table(&[0, 0, 1], 4096), "pairwise");
    assert_eq!(table(&[0, 1, 2, 3], 4096), "pairwise");
}
