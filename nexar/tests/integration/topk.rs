//! `all_reduce_topk` over real QUIC (and shared memory between these same-host ranks): each
//! call sends only the largest elements, the residual carries the rest into later calls, and
//! at every step the ranks' results so far plus their residuals add up exactly to what they
//! contributed. Argument errors are reported alike on every rank.

use nexar::{ErrorFeedback, Max, NexarClient, NexarConfig, Sum};

use crate::common::{TEST_LIMIT, on_each};

/// Rank `r`'s contribution to element `i` at step `step`: small integers (exact in f32
/// sums), distinct magnitudes, both signs.
fn value(step: usize, r: usize, i: usize) -> f32 {
    let x = ((step * 31 + r * 7 + i * 13) % 41) as f32 - 20.0;
    if x == 0.0 { 1.0 } else { x }
}

/// `steps` calls with contributions, then calls with zeros until every residual is empty:
/// after each call, results so far plus all residuals equal the exact sums so far; at the end
/// the results alone do.
async fn nothing_is_lost(n: usize, len: usize, ratio: f64, steps: usize) {
    let ranks = NexarClient::bootstrap_local(n).await.unwrap();
    let k = ((len as f64 * ratio).ceil() as usize).max(1);
    let drain = len.div_ceil(k) * n + 1;
    let per_rank = on_each(&ranks, move |c| async move {
        let mut feedback = ErrorFeedback::new(ratio);
        let mut history = Vec::new();
        for step in 0..steps + drain {
            let mut v: Vec<f32> = (0..len).map(|i| if step < steps { value(step, c.rank(), i) } else { 0.0 }).collect();
            tokio::time::timeout(TEST_LIMIT, c.all_reduce_topk(&mut v, Sum, &mut feedback)).await.unwrap().unwrap();
            assert!(v.iter().filter(|x| **x != 0.0).count() <= n * k, "more than {n} x {k} elements came back");
            history.push((v, feedback.residual().to_vec()));
        }
        history
    })
    .await;
    let mut results = vec![0f64; len];
    let mut sent = vec![0f64; len];
    for step in 0..steps + drain {
        let (got, _) = &per_rank[0][step];
        for (rank, h) in per_rank.iter().enumerate() {
            assert!(
                h[step].0.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {rank} got another result at step {step}"
            );
        }
        for i in 0..len {
            results[i] += got[i] as f64;
            if step < steps {
                sent[i] += (0..n).map(|r| value(step, r, i) as f64).sum::<f64>();
            }
            let held: f64 = per_rank.iter().map(|h| h[step].1[i] as f64).sum();
            assert_eq!(results[i] + held, sent[i], "step {step}, element {i}: results plus residuals");
        }
    }
    assert_eq!(results, sent, "after the residuals drained, the results are the exact sums");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_residual_carries_what_was_not_sent() {
    nothing_is_lost(2, 200, 0.05, 3).await;
    nothing_is_lost(3, 97, 0.1, 2).await;
}

/// A first call sends exactly the largest `k` per rank: the rest is in the residual, and the
/// result holds only what was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_elements_go_first() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let outcomes = on_each(&ranks, |c| async move {
        // Rank r's largest magnitudes sit at 10 + r and 20 + r.
        let mut v = vec![1.0f32; 64];
        v[10 + c.rank()] = -50.0;
        v[20 + c.rank()] = 40.0;
        let mut feedback = ErrorFeedback::new(2.0 / 64.0);
        c.all_reduce_topk(&mut v, Sum, &mut feedback).await.unwrap();
        (v, feedback.residual().to_vec())
    })
    .await;
    for (rank, (v, residual)) in outcomes.iter().enumerate() {
        let nonzero: Vec<(usize, f32)> = v.iter().copied().enumerate().filter(|(_, x)| *x != 0.0).collect();
        assert_eq!(nonzero, vec![(10, -50.0), (11, -50.0), (20, 40.0), (21, 40.0)], "rank {rank}");
        assert_eq!(residual.iter().filter(|x| **x == 1.0).count(), 62, "rank {rank}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lengths_ratios_and_limits_that_do_not_fit_are_refused() {
    let cfg = NexarConfig::builder().max_message_bytes(64 << 10).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    // Ratios that differ: every rank says so.
    let outcomes = on_each(&ranks, |c| async move {
        let mut v = vec![1.0f32; 100];
        c.all_reduce_topk(&mut v, Sum, &mut ErrorFeedback::new(0.1 * (c.rank() + 1) as f64)).await
    })
    .await;
    for (rank, got) in outcomes.into_iter().enumerate() {
        let err = got.expect_err("ratios differ").to_string();
        assert!(err.contains("10 to 20 pairs"), "rank {rank}: {err}");
    }
    // Each rank alone: its own arguments.
    let c = &ranks[0];
    let mut v = vec![1.0f32; 100];
    let err = c.all_reduce_topk(&mut v, Max, &mut ErrorFeedback::new(0.1)).await.unwrap_err();
    assert!(err.to_string().contains("only Sum"), "{err}");
    let err = c.all_reduce_topk(&mut v, Sum, &mut ErrorFeedback::new(0.0)).await.unwrap_err();
    assert!(err.to_string().contains("(0, 1]"), "{err}");
    let mut big = vec![1.0f32; 1 << 20];
    let err = c.all_reduce_topk(&mut big, Sum, &mut ErrorFeedback::new(0.5)).await.unwrap_err();
    assert!(err.to_string().contains("max_message_bytes"), "{err}");
    // The communicator carries on; a feedback is bound to its buffer's length.
    let sums = on_each(&ranks, |c| async move {
        let mut feedback = ErrorFeedback::new(1.0);
        let mut v = vec![2.0f32; 8];
        c.all_reduce_topk(&mut v, Sum, &mut feedback).await.unwrap();
        let mut other = vec![2.0f32; 9];
        let refused = c.all_reduce_topk(&mut other, Sum, &mut feedback).await.unwrap_err();
        assert!(refused.to_string().contains("one ErrorFeedback per buffer"), "{refused}");
        v
    })
    .await;
    assert!(sums.iter().all(|v| v.iter().all(|x| *x == 4.0)));
}
