//! `all_reduce_compressed` over real QUIC (and the TCP lane for large buffers): results within
//! the documented error bound of the exact sum for bf16 and f16, exact extrema, the f16
//! overflow and the argument errors reported alike on every rank.

use nexar::{CollectiveError, Compression, Max, NexarClient, Prod, Sum};

use crate::common::{TEST_LIMIT, on_each};

/// Rank `r`'s contribution to element `i`: varied signs and magnitudes over four decades.
fn value(r: usize, i: usize) -> f32 {
    let x = ((r * 7919 + i * 104_729) % 10_007) as f32 / 10_007.0 - 0.5;
    x * [0.01f32, 0.1, 1.0, 10.0][(i + r) % 4]
}

async fn ranks(n: usize) -> Vec<NexarClient> {
    NexarClient::bootstrap_local(n).await.unwrap()
}

/// Every element of every rank's result is within the bound of the exact (f64) sum.
async fn sums_within_the_bound(n: usize, len: usize, compression: Compression) {
    sums_within_the_bound_on(ranks(n).await, len, compression).await;
}

async fn sums_within_the_bound_on(ranks: Vec<NexarClient>, len: usize, compression: Compression) {
    let n = ranks.len();
    let results = on_each(&ranks, move |c| async move {
        let mut v: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
        tokio::time::timeout(TEST_LIMIT, c.all_reduce_compressed(&mut v, Sum, compression)).await.unwrap().unwrap();
        v
    })
    .await;
    let mut worst = 0f64;
    for i in 0..len {
        let exact: f64 = (0..n).map(|r| value(r, i) as f64).sum();
        let magnitude: f64 = (0..n).map(|r| (value(r, i) as f64).abs()).sum();
        let bound = compression.sum_error_bound(n, magnitude);
        for (rank, got) in results.iter().enumerate() {
            let err = (got[i] as f64 - exact).abs();
            assert!(err <= bound, "{compression:?}, {n} ranks, rank {rank}, element {i}: error {err} over {bound}");
            worst = worst.max(err / bound.max(f64::MIN_POSITIVE));
        }
        assert!(results.iter().all(|r| r[i].to_bits() == results[0][i].to_bits()), "ranks differ at {i}");
    }
    eprintln!("{compression:?}, {n} ranks, {len} elements: worst error {:.0}% of the bound", worst * 100.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_and_f16_sums_stay_within_the_documented_bound() {
    for n in [2, 3, 4] {
        for compression in [Compression::Bf16, Compression::F16] {
            // Lengths that do and do not divide by the world size.
            sums_within_the_bound(n, 1001, compression).await;
        }
    }
}

/// Rounds each element to bf16, as an `f32`.
fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| nexar::bf16::from_f32(*x).to_f32()).collect()
}

/// The bf16 allreduce runs on the `f32` buffer itself, converting each message as it is sent
/// and read; its result has exactly the bits of an allreduce of the bf16-rounded buffers, on
/// every transport (shared memory, the TCP lane sealed and plaintext), for every size the
/// size table treats differently, on 1 to 4 ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_on_the_f32_buffer_gives_the_bits_of_an_allreduce_of_bf16_buffers() {
    let tcp = nexar::NexarConfig::builder().shared_memory(false).build().unwrap();
    let plain = tcp.clone().into_builder().bulk_encryption(false).build().unwrap();
    for (transport, cfg) in [("default", nexar::NexarConfig::default()), ("tcp lane", tcp), ("plaintext", plain)] {
        for n in [1, 2, 3, 4] {
            let ranks = NexarClient::bootstrap_local_with(n, cfg.clone()).await.unwrap();
            let lens: &[usize] =
                if transport == "default" || n == 3 { &[1, 7, 1001, 40_000, 1 << 20] } else { &[1001, 1 << 20] };
            for &len in lens {
                let outcomes = on_each(&ranks, move |c| async move {
                    let mine: Vec<f32> = (0..len).map(|i| value(c.rank(), i) * 1.01).collect();
                    let mut results = Vec::new();
                    for op in [nexar::ReduceOp::Sum, nexar::ReduceOp::Max, nexar::ReduceOp::Min] {
                        let mut compressed = mine.clone();
                        let call = c.all_reduce_compressed(&mut compressed, op, Compression::Bf16);
                        tokio::time::timeout(TEST_LIMIT, call).await.unwrap().unwrap();
                        let mut wire: Vec<nexar::bf16> = mine.iter().map(|x| nexar::bf16::from_f32(*x)).collect();
                        tokio::time::timeout(TEST_LIMIT, c.all_reduce(&mut wire, op)).await.unwrap().unwrap();
                        results.push((op, compressed, wire.iter().map(|h| h.to_f32()).collect::<Vec<f32>>()));
                    }
                    results
                })
                .await;
                for (rank, results) in outcomes.iter().enumerate() {
                    for (op, compressed, expect) in results {
                        let differ = compressed.iter().zip(expect).position(|(a, b)| a.to_bits() != b.to_bits());
                        assert_eq!(differ, None, "{transport}, {n} ranks, {len} elements, {op}, rank {rank}");
                        assert_eq!(compressed, &rounded(compressed), "results are bf16 values");
                    }
                }
            }
        }
    }
}

/// 4 MiB of f32 (2 MiB on the wire) takes the TCP lane: the bound holds there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_buffer_on_the_tcp_lane_stays_within_the_bound() {
    sums_within_the_bound(2, 1 << 20, Compression::Bf16).await;
}

/// In segments (of 100 `f32` here, rounded up to whole blocks) with a shorter last one: the
/// same bound, the same result on every rank, and an f16 overflow in a late segment still
/// leaves every buffer as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segmented_sums_stay_within_the_bound_and_a_late_overflow_changes_nothing() {
    for n in [2, 3] {
        let cfg = nexar::NexarConfig::builder().segment_bytes(400).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(n, cfg).await.unwrap();
        for compression in [Compression::Bf16, Compression::F16] {
            sums_within_the_bound_on(ranks.clone(), 1001, compression).await;
        }
        let outcomes = on_each(&ranks, |c| async move {
            let mut v: Vec<f32> = (0..1001).map(|i| value(c.rank(), i)).collect();
            v[950] = 40_000.0; // beyond f16's range once summed, in the last segment
            let before = v.clone();
            let got = c.all_reduce_compressed(&mut v, Sum, Compression::F16).await;
            (got, v == before)
        })
        .await;
        for (rank, (got, unchanged)) in outcomes.into_iter().enumerate() {
            assert!(
                matches!(&got, Err(CollectiveError::Overflow { what, .. }) if what.contains("element 950")),
                "{got:?}"
            );
            assert!(unchanged, "{n} ranks, rank {rank}: a failed call leaves the buffer as it was");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extrema_are_the_rounded_extremum_and_buffers_of_any_kind_work() {
    let ranks = ranks(3).await;
    let results = on_each(&ranks, |c| async move {
        let mut v = nexar::Buf::from_vec((0..100).map(|i| value(c.rank(), i)).collect::<Vec<f32>>());
        c.all_reduce_compressed(&mut v, Max, Compression::F16).await.unwrap();
        v.as_slice().to_vec()
    })
    .await;
    for (i, got) in results[0].iter().enumerate() {
        let max = (0..3).map(|r| value(r, i)).fold(f32::MIN, f32::max);
        assert_eq!(*got, nexar::f16::from_f32(max).to_f32(), "element {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_f16_sum_beyond_its_range_fails_alike_on_every_rank() {
    let ranks = ranks(2).await;
    let outcomes = on_each(&ranks, |c| async move {
        let mut v = vec![1.0f32; 10];
        v[7] = 40_000.0; // 80,000 in all: beyond ±65504
        let got = c.all_reduce_compressed(&mut v, Sum, Compression::F16).await;
        (got, v)
    })
    .await;
    for (rank, (got, v)) in outcomes.into_iter().enumerate() {
        match got {
            Err(CollectiveError::Overflow { what, .. }) => assert!(what.contains("element 7"), "{what}"),
            other => panic!("rank {rank}: {other:?}"),
        }
        assert_eq!(v[7], 40_000.0, "rank {rank}: a failed call leaves the buffer as it was");
    }
    // Bf16 has f32's range.
    let sums = on_each(&ranks, |c| async move {
        let mut v = vec![40_000.0f32; 4];
        c.all_reduce_compressed(&mut v, Sum, Compression::Bf16).await.unwrap();
        v
    })
    .await;
    assert!(sums.iter().all(|v| v.iter().all(|x| (*x - 80_000.0).abs() <= 80_000.0 / 128.0)), "{sums:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lengths_that_differ_and_products_are_refused() {
    let ranks = ranks(2).await;
    // 5 and 6 elements make the same 3-element blocks. f16 compares the lengths first; bf16's
    // messages carry the whole length in their headers, and a segmented call (segments of 100
    // here) fails on its first segment, before any rank waits for a segment the other lacks.
    let cfg = nexar::NexarConfig::builder().segment_bytes(400).build().unwrap();
    let segmented = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    for (compression, lens, ranks) in [
        (Compression::F16, [5, 6], &ranks),
        (Compression::Bf16, [5, 6], &ranks),
        (Compression::Bf16, [250, 301], &segmented),
        (Compression::F16, [250, 301], &segmented),
    ] {
        let outcomes = on_each(ranks, move |c| async move {
            let mut v = vec![1.0f32; lens[c.rank()]];
            let call = c.all_reduce_compressed(&mut v, Sum, compression);
            tokio::time::timeout(TEST_LIMIT, call).await.expect("a length mismatch fails, never hangs")
        })
        .await;
        for (rank, got) in outcomes.into_iter().enumerate() {
            let err = got.expect_err("lengths differ").to_string();
            let (a, b) = (lens[0], lens[1]);
            let named = err.contains(&format!("{a} to {b} elements"))
                || err.contains(&format!("passed {a} elements")) && err.contains(&format!("passed {b}"))
                || err.contains(&format!("passed {b} elements")) && err.contains(&format!("passed {a}"));
            assert!(named, "{compression:?}, rank {rank}: {err}");
        }
    }
    let mut v = vec![1.0f32; 4];
    let err = ranks[0].all_reduce_compressed(&mut v, Prod, Compression::Bf16).await.unwrap_err();
    assert!(err.to_string().contains("prod"), "{err}");
    // The communicator carries on.
    let sums = on_each(&ranks, |c| async move {
        let mut v = vec![2.0f32; 8];
        c.all_reduce_compressed(&mut v, Sum, Compression::Bf16).await.unwrap();
        v
    })
    .await;
    assert!(sums.iter().all(|v| v.iter().all(|x| *x == 4.0)));
}
