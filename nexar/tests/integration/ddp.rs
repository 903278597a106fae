//! The data-parallel layer (`nexar::ddp`) over real QUIC between in-process ranks: averaged
//! gradients equal to a reference bit for bit, registration checked on every rank, buckets of
//! every shape and type, the hooks' accuracy, accumulation, bad input refused before anything
//! is sent, a silent rank named with its bucket, and a job that survives a dead rank.

use std::time::{Duration, Instant};

use nexar::ddp::{CommHook, Ddp, DdpError, PowerSgd};
use nexar::prelude::*;
use nexar::{Compression, bf16, f16};

use crate::common::{TEST_LIMIT, on_each};

/// A linear model `y = x·w + b` (`w` is `IN × OUT`) with a mean squared loss over a batch.
const IN: usize = 6;
const OUT: usize = 3;

/// The number type of a test model: `f32` or `f64`.
trait Real:
    Copy
    + Default
    + PartialEq
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + nexar::ddp::GradElement
{
    fn of(x: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl Real for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
}

/// Sample `i` of a generated data set: inputs in [-1, 1] and a target from a fixed linear map.
fn sample<T: Real>(i: usize) -> ([T; IN], [T; OUT]) {
    let x: [f64; IN] = std::array::from_fn(|k| (((i * 7919 + k * 104_729) % 2001) as f64 / 1000.0) - 1.0);
    let y: [f64; OUT] =
        std::array::from_fn(|o| (0..IN).map(|k| x[k] * ((k + 2 * o) as f64 * 0.3 - 1.0)).sum::<f64>() + o as f64);
    (x.map(T::of), y.map(T::of))
}

/// The gradients (`dw`, `db`) of the mean squared loss over `batch`.
fn gradients<T: Real>(w: &[T], b: &[T], batch: &[usize]) -> (Vec<T>, Vec<T>) {
    let mut dw = vec![T::default(); IN * OUT];
    let mut db = vec![T::default(); OUT];
    let scale = T::of(2.0) / T::of(batch.len() as f64);
    for &i in batch {
        let (x, y) = sample::<T>(i);
        for o in 0..OUT {
            let mut pred = b[o];
            for k in 0..IN {
                pred = pred + x[k] * w[k * OUT + o];
            }
            let r = (pred - y[o]) * scale;
            db[o] = db[o] + r;
            for k in 0..IN {
                dw[k * OUT + o] = dw[k * OUT + o] + r * x[k];
            }
        }
    }
    (dw, db)
}

fn sgd<T: Real>(param: &mut [T], grad: &[T], lr: T) {
    param.iter_mut().zip(grad).for_each(|(p, g)| *p = *p - lr * *g);
}

fn initial<T: Real>() -> (Vec<T>, Vec<T>) {
    ((0..IN * OUT).map(|i| T::of((i as f64 * 0.37).sin() * 0.1)).collect(), vec![T::default(); OUT])
}

async fn model_ddp<T: Real>(comm: &NexarClient) -> Ddp {
    Ddp::builder().param("w", &[IN, OUT], T::DTYPE).param("b", &[OUT], T::DTYPE).build(comm).await.unwrap()
}

/// The samples of rank `r` of `world` at `step`: a disjoint share of a batch of `per_rank × world`.
fn shard(step: usize, r: usize, world: usize, per_rank: usize) -> Vec<usize> {
    let start = step * per_rank * world;
    (0..per_rank).map(|j| start + r + j * world).collect()
}

/// Trains `steps` steps data-parallel on every rank; returns each rank's final `(w, b)`.
async fn train<T: Real>(world: usize, steps: usize, per_rank: usize) -> Vec<(Vec<T>, Vec<T>)> {
    let ranks = NexarClient::bootstrap_local(world).await.unwrap();
    on_each(&ranks, move |c| async move {
        let mut ddp = model_ddp::<T>(&c).await;
        let (mut w, mut b) = initial::<T>();
        for step in 0..steps {
            let (dw, db) = gradients(&w, &b, &shard(step, c.rank(), world, per_rank));
            ddp.ready("b", &db).unwrap();
            ddp.ready("w", &dw).unwrap();
            let avg = tokio::time::timeout(TEST_LIMIT, ddp.finish()).await.unwrap().unwrap();
            sgd(&mut w, avg.get("w").unwrap(), T::of(0.05));
            sgd(&mut b, avg.get("b").unwrap(), T::of(0.05));
        }
        (w, b)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_end_bitwise_equal_to_each_other_and_to_a_reference_that_averages_alike() {
    let (steps, per_rank) = (20, 8);
    let got = train::<f32>(2, steps, per_rank).await;
    let (mut w, mut b) = initial::<f32>();
    for step in 0..steps {
        let (w0, b0) = gradients(&w, &b, &shard(step, 0, 2, per_rank));
        let (w1, b1) = gradients(&w, &b, &shard(step, 1, 2, per_rank));
        let avg = |a: &[f32], c: &[f32]| a.iter().zip(c).map(|(x, y)| (x + y) / 2.0).collect::<Vec<f32>>();
        sgd(&mut w, &avg(&w0, &w1), 0.05);
        sgd(&mut b, &avg(&b0, &b1), 0.05);
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got[0].0), bits(&got[1].0), "the ranks' weights differ");
    assert_eq!(bits(&got[0].1), bits(&got[1].1), "the ranks' biases differ");
    assert_eq!(bits(&got[0].0), bits(&w), "weights differ from the reference");
    assert_eq!(bits(&got[0].1), bits(&b), "biases differ from the reference");
}

/// Trains in one process on the whole batch of every step.
fn train_alone<T: Real>(steps: usize, batch: usize) -> (Vec<T>, Vec<T>) {
    let (mut w, mut b) = initial::<T>();
    for step in 0..steps {
        let all: Vec<usize> = (step * batch..(step + 1) * batch).collect();
        let (dw, db) = gradients(&w, &b, &all);
        sgd(&mut w, &dw, T::of(0.05));
        sgd(&mut b, &db, T::of(0.05));
    }
    (w, b)
}

fn max_relative<T: Real>(a: &[T], b: &[T]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x.to_f64() - y.to_f64()).abs() / y.to_f64().abs().max(1e-3)).fold(0.0, f64::max)
}

/// Two ranks on half batches against one process on the concatenated batch. The only
/// difference is where the batch sum is split: (Σ₀ / (B/2) + Σ₁ / (B/2)) / 2 against Σ / B, the
/// same numbers added in another order. In f64 that stays within 1e-12 relative after 20 steps;
/// in f32 within 2e-5 (measured: about 1e-6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_match_one_process_on_the_whole_batch() {
    let (steps, per_rank) = (20, 8);
    let alone = train_alone::<f64>(steps, 2 * per_rank);
    let got = train::<f64>(2, steps, per_rank).await;
    let rel = max_relative(&got[0].0, &alone.0).max(max_relative(&got[0].1, &alone.1));
    assert!(rel < 1e-12, "f64: {rel:e} relative");
    let alone = train_alone::<f32>(steps, 2 * per_rank);
    let got = train::<f32>(2, steps, per_rank).await;
    let rel = max_relative(&got[0].0, &alone.0).max(max_relative(&got[0].1, &alone.1));
    println!("f32: two ranks against one process: {rel:e} relative");
    assert!(rel < 2e-5, "f32: {rel:e} relative");
}

/// Builds a layer whose registration differs on rank 1 by `change`; every rank must fail,
/// within 10 s, with an error naming what differs.
async fn registration_fails_everywhere(change: fn(nexar::ddp::DdpBuilder) -> nexar::ddp::DdpBuilder, names: &[&str]) {
    let ranks = NexarClient::bootstrap_local(3).await.unwrap();
    let started = Instant::now();
    let errors = on_each(&ranks, move |c| async move {
        let mut builder = Ddp::builder();
        if c.rank() != 1 {
            builder = builder
                .param("fc1.weight", &[8, 4], DType::F32)
                .param("fc1.bias", &[8], DType::F32)
                .param("fc2.weight", &[8, 8], DType::F32)
                .param("fc2.bias", &[8], DType::F32);
        } else {
            builder = change(builder);
        }
        tokio::time::timeout(Duration::from_secs(10), builder.build(&c)).await.expect("took over 10 s").unwrap_err()
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(10));
    for (r, e) in errors.iter().enumerate() {
        assert!(matches!(e, DdpError::Registration { .. }), "rank {r}: {e}");
        let text = e.to_string();
        for name in names {
            assert!(text.contains(name), "rank {r} does not name {name}: {text}");
        }
        assert!(text.contains("rank 1"), "rank {r} does not name rank 1: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parameter_registered_with_another_shape_fails_on_every_rank_naming_it() {
    registration_fails_everywhere(
        |b| {
            b.param("fc1.weight", &[8, 4], DType::F32)
                .param("fc1.bias", &[8], DType::F32)
                .param("fc2.weight", &[8, 4], DType::F32)
                .param("fc2.bias", &[8], DType::F32)
        },
        &["parameter 2", "`fc2.weight` [8, 8] f32", "`fc2.weight` [8, 4] f32"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_equal_sized_parameters_swapped_fail_on_every_rank() {
    registration_fails_everywhere(
        |b| {
            b.param("fc1.weight", &[8, 4], DType::F32)
                .param("fc2.bias", &[8], DType::F32)
                .param("fc2.weight", &[8, 8], DType::F32)
                .param("fc1.bias", &[8], DType::F32)
        },
        &["parameter 1", "`fc1.bias`", "`fc2.bias`"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_parameter_or_other_settings_fail_on_every_rank() {
    registration_fails_everywhere(
        |b| {
            b.param("fc1.weight", &[8, 4], DType::F32).param("fc1.bias", &[8], DType::F32).param(
                "fc2.weight",
                &[8, 8],
                DType::F32,
            )
        },
        &["registered 4 parameters", "registered 3", "`fc2.bias`"],
    )
    .await;
    registration_fails_everywhere(
        |b| {
            b.param("fc1.weight", &[8, 4], DType::F32)
                .param("fc1.bias", &[8], DType::F32)
                .param("fc2.weight", &[8, 8], DType::F32)
                .param("fc2.bias", &[8], DType::F32)
                .hook(CommHook::Compressed(Compression::Bf16))
        },
        &["settings differ", "hook plain", "hook bf16"],
    )
    .await;
}

/// Rank `r`'s gradient element `i` of parameter `p`: small integers, exact in every type.
fn grad_value(p: usize, r: usize, i: usize) -> f32 {
    ((p * 5 + r * 3 + i) % 9) as f32 - 4.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buckets_hold_oversized_zero_sized_and_mixed_type_parameters() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    on_each(&ranks, |c| async move {
        let mut ddp = Ddp::builder()
            .param("big", &[3000], DType::F32) // 12 KB, over the 4 KB cap
            .param("empty", &[0, 5], DType::F32)
            .param("half", &[33], DType::F16)
            .param("brain", &[2, 17], DType::BF16)
            .param("double", &[100], DType::F64)
            .param("scalar", &[], DType::F32)
            .bucket_cap_bytes(4096)
            .first_bucket_bytes(256)
            .build(&c)
            .await
            .unwrap();
        let layout = ddp.layout().clone();
        assert!(layout.buckets.iter().all(|b| { b.members.iter().all(|&m| ddp.params()[m].dtype() == b.dtype) }));
        for step in 0..3 {
            let r = c.rank() + step;
            let g = |p: usize, n: usize| (0..n).map(|i| grad_value(p, r, i)).collect::<Vec<f32>>();
            ddp.ready("scalar", &g(5, 1)).unwrap();
            ddp.ready("double", &g(4, 100).iter().map(|&x| x as f64).collect::<Vec<_>>()).unwrap();
            ddp.ready("brain", &g(3, 34).iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).unwrap();
            ddp.ready("half", &g(2, 33).iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()).unwrap();
            ddp.ready::<f32>("empty", &[]).unwrap();
            ddp.ready("big", &g(0, 3000)).unwrap();
            let avg = tokio::time::timeout(TEST_LIMIT, ddp.finish()).await.unwrap().unwrap();
            let want = |p: usize, i: usize| (grad_value(p, step, i) + grad_value(p, step + 1, i)) / 2.0;
            let big: &[f32] = avg.get("big").unwrap();
            assert!(big.iter().enumerate().all(|(i, &x)| x == want(0, i)), "big at step {step}");
            assert!(avg.get::<f32>("empty").unwrap().is_empty());
            let half: &[f16] = avg.get("half").unwrap();
            assert!(half.iter().enumerate().all(|(i, x)| x.to_f32() == want(2, i)), "half");
            let brain: &[bf16] = avg.get("brain").unwrap();
            assert!(brain.iter().enumerate().all(|(i, x)| x.to_f32() == want(3, i)), "bf16");
            let double: &[f64] = avg.get("double").unwrap();
            assert!(double.iter().enumerate().all(|(i, &x)| x == want(4, i) as f64), "f64");
            assert_eq!(avg.get::<f32>("scalar").unwrap(), &[want(5, 0)]);
            assert!(avg.get::<f64>("big").is_err(), "a view in another type is refused");
            assert_eq!(avg.iter().count(), 6);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bf16_hook_stays_within_its_error_bound() {
    let world = 3;
    let ranks = NexarClient::bootstrap_local(world).await.unwrap();
    let len = 5000;
    let value = |r: usize, i: usize| ((i * 31 + r * 17) as f32 * 0.013).sin() * 3.0 + 0.001 * r as f32;
    let results = on_each(&ranks, move |c| async move {
        let mut ddp = Ddp::builder()
            .param("g", &[len], DType::F32)
            .hook(CommHook::Compressed(Compression::Bf16))
            .build(&c)
            .await
            .unwrap();
        let g: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
        ddp.ready("g", &g).unwrap();
        let avg = ddp.finish().await.unwrap();
        avg.get::<f32>("g").unwrap().to_vec()
    })
    .await;
    for (i, (&got, &other)) in results[0].iter().zip(&results[1]).enumerate() {
        let exact: f64 = (0..world).map(|r| value(r, i) as f64).sum::<f64>() / world as f64;
        let magnitude: f64 = (0..world).map(|r| value(r, i).abs() as f64).sum();
        // The sum's bound, divided like the sum (the division adds one f32 rounding).
        let bound = Compression::Bf16.sum_error_bound(world, magnitude) / world as f64 + exact.abs() * 1e-7;
        let err = (got as f64 - exact).abs();
        assert!(err <= bound, "element {i}: error {err:e} over the bound {bound:e}");
        assert_eq!(got.to_bits(), other.to_bits(), "ranks agree");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn powersgd_recovers_a_low_rank_average_and_top_k_delays_without_losing() {
    let (n, m) = (40, 30);
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    on_each(&ranks, move |c| async move {
        let hook = CommHook::PowerSgd(PowerSgd { rank: 2, start_step: 1, ..Default::default() });
        let mut ddp = Ddp::builder()
            .param("w", &[n, m], DType::F32)
            .param("b", &[m], DType::F32)
            .hook(hook)
            .build(&c)
            .await
            .unwrap();
        // Each rank's gradient is rank one, u·vᵣᵀ: their average has rank one too.
        let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.3).cos()).collect();
        let v = |r: usize| (0..m).map(|j| ((j + 7 * r) as f32 * 0.2).sin()).collect::<Vec<f32>>();
        let mine = v(c.rank());
        let g: Vec<f32> = (0..n * m).map(|i| u[i / m] * mine[i % m]).collect();
        let avg_v: Vec<f32> = (0..m).map(|j| (v(0)[j] + v(1)[j]) / 2.0).collect();
        let bias: Vec<f32> = (0..m).map(|j| (j + c.rank()) as f32).collect();
        for step in 0..4 {
            ddp.ready("b", &bias).unwrap();
            ddp.ready("w", &g).unwrap();
            let avg = ddp.finish().await.unwrap();
            let w: &[f32] = avg.get("w").unwrap();
            let err = (0..n * m).map(|i| (w[i] - u[i / m] * avg_v[i % m]).abs()).fold(0.0f32, f32::max);
            // Step 0 is plain (start_step 1); from step 1 on, PowerSGD: rank 2 holds a rank-1 average.
            assert!(err < 1e-4, "step {step}: {err}");
            let b: &[f32] = avg.get("b").unwrap();
            assert!(b.iter().enumerate().all(|(j, &x)| x == j as f32 + 0.5), "the vector travels whole");
        }
        let mut topk =
            Ddp::builder().param("g", &[100], DType::F32).hook(CommHook::TopK { ratio: 0.1 }).build(&c).await.unwrap();
        let mut total = vec![0f64; 100];
        let g: Vec<f32> = (0..100).map(|i| if i % 2 == c.rank() { (i + 1) as f32 } else { 0.0 }).collect();
        for step in 0..25 {
            let sent = if step == 0 { g.clone() } else { vec![0.0; 100] };
            topk.ready("g", &sent).unwrap();
            let avg = topk.finish().await.unwrap();
            for (t, x) in total.iter_mut().zip(avg.get::<f32>("g").unwrap()) {
                *t += *x as f64;
            }
        }
        // Everything sent at step 0 arrived, averaged, within 25 steps of 10 elements per rank.
        assert!(total.iter().enumerate().all(|(i, &t)| t == (i + 1) as f64 / 2.0), "{total:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sync_over_four_steps_equals_one_step_on_four_times_the_batch() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let per = 4;
    let results = on_each(&ranks, move |c| async move {
        let mut ddp = model_ddp::<f64>(&c).await;
        let (w, b) = initial::<f64>();
        // Four micro-steps of `per` samples each, losses summed (torch semantics: the
        // accumulated gradient is the sum of the micro-batches' mean gradients).
        for micro in 0..4 {
            if micro < 3 {
                ddp.no_sync().unwrap();
            }
            let batch: Vec<usize> = shard(0, c.rank(), 2, 4 * per)[micro * per..(micro + 1) * per].to_vec();
            let (dw, db) = gradients(&w, &b, &batch);
            ddp.ready("w", &dw).unwrap();
            ddp.ready("b", &db).unwrap();
            let avg = ddp.finish().await.unwrap();
            assert_eq!(avg.synced(), micro == 3);
            if micro == 3 {
                let scale = |v: &[f64]| v.iter().map(|x| x / 4.0).collect::<Vec<f64>>();
                return (scale(avg.get("w").unwrap()), scale(avg.get("b").unwrap()));
            }
        }
        unreachable!()
    })
    .await;
    let (w, b) = initial::<f64>();
    let (dw, db) = gradients(&w, &b, &(0..2 * 4 * per).collect::<Vec<_>>());
    assert!(max_relative(&results[0].0, &dw) < 1e-12, "{:?} against {dw:?}", results[0].0);
    assert!(max_relative(&results[0].1, &db) < 1e-12);
    assert_eq!(results[0], results[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_gradients_are_refused_before_anything_is_sent_and_the_step_goes_on() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    on_each(&ranks, |c| async move {
        let mut ddp = model_ddp::<f32>(&c).await;
        let r = c.rank();
        if r == 0 {
            let e = ddp.ready("w", &[0f32; 5]).unwrap_err();
            let text = e.to_string();
            assert!(matches!(e, DdpError::WrongGradient { .. }), "{e}");
            assert!(text.contains("rank 0") && text.contains("`w`"), "{text}");
            assert!(text.contains("[6, 3] f32 (18 elements)") && text.contains("5 f32 elements"), "{text}");
            let e = ddp.ready("w", &[0f64; 18]).unwrap_err();
            assert!(e.to_string().contains("18 f64 elements"), "{e}");
            let e = ddp.ready("v", &[0f32; 18]).unwrap_err();
            assert!(matches!(e, DdpError::UnknownParameter { .. }) && e.to_string().contains("`v`"), "{e}");
            assert!(ddp.ready_index::<f32>(7, &[]).is_err());
        }
        ddp.ready("b", &[1.0f32 + r as f32; OUT]).unwrap();
        let e = ddp.ready("b", &[1.0f32; OUT]).unwrap_err();
        assert!(matches!(e, DdpError::HandedTwice { .. }) && e.to_string().contains("`b`"), "{e}");
        assert!(ddp.no_sync().is_err(), "no_sync in the middle of a step");
        let e = ddp.finish().await.err().expect("finish before every gradient");
        assert!(matches!(e, DdpError::Missing { .. }) && e.to_string().contains("`w` (bucket 0)"), "{e}");
        // The step is still open: what was handed over stays.
        ddp.ready("w", &[2.0f32; IN * OUT]).unwrap();
        let avg = ddp.finish().await.unwrap();
        assert_eq!(avg.get::<f32>("b").unwrap(), &[1.5; OUT]);
        assert_eq!(avg.get::<f32>("w").unwrap(), &[2.0; IN * OUT]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_never_hands_a_gradient_over_is_named_with_its_bucket() {
    let cfg = NexarConfig::builder().op_timeout(Duration::from_secs(3)).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
    let errors = on_each(&ranks, |c| async move {
        let mut ddp = Ddp::builder()
            .param("fc1.weight", &[64, 64], DType::F32)
            .param("fc2.weight", &[64, 64], DType::F32)
            .first_bucket_bytes(1024)
            .build(&c)
            .await
            .unwrap();
        // Buckets: 0 holds fc2.weight (the first, small cap), 1 holds fc1.weight.
        ddp.ready("fc2.weight", &[1.0f32; 4096]).unwrap();
        if c.rank() != 2 {
            ddp.ready("fc1.weight", &[1.0f32; 4096]).unwrap();
        }
        let started = Instant::now();
        let e = tokio::time::timeout(TEST_LIMIT, ddp.finish()).await.unwrap().err().expect("the step fails");
        if c.rank() == 2 {
            // Stays in the job (silent, not dead) while the others time out.
            tokio::time::sleep(Duration::from_secs(8)).await;
        }
        (e.to_string(), started.elapsed())
    })
    .await;
    for (r, (text, took)) in errors.iter().enumerate().take(2) {
        assert!(text.contains("bucket 1 (`fc1.weight`)"), "rank {r}: {text}");
        assert!(text.contains("rank 2"), "rank {r} does not name the silent rank: {text}");
        assert!(*took < Duration::from_secs(60), "rank {r} took {took:?}");
    }
    assert!(errors[2].0.contains("`fc1.weight` (bucket 1)"), "the silent rank: {}", errors[2].0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_rebuild_and_redo_the_step_after_a_rank_dies() {
    let ranks = NexarClient::bootstrap_local(3).await.unwrap();
    // The tasks own the only handles, so that rank 1's going is a death.
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                let mut ddp = Ddp::builder().param("g", &[1000], DType::F32).build(&c).await.unwrap();
                let g = vec![c.rank() as f32; 1000];
                ddp.ready("g", &g).unwrap();
                assert_eq!(ddp.finish().await.unwrap().get::<f32>("g").unwrap()[0], 1.0);
                if c.rank() == 1 {
                    // Dies: its handles go without a goodbye.
                    drop(ddp);
                    drop(c);
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                ddp.ready("g", &g).unwrap();
                let e = tokio::time::timeout(TEST_LIMIT, ddp.finish()).await.unwrap().err().expect("rank 1 is gone");
                assert!(matches!(e, DdpError::Bucket { bucket: 0, .. }), "{e}");
                let survivors = c.recover().await.unwrap();
                ddp.rebuild(&survivors).await.unwrap();
                assert_eq!(ddp.step(), 1, "the failed step is not counted");
                ddp.ready("g", &g).unwrap();
                let avg = ddp.finish().await.unwrap();
                Some((survivors.world_size(), avg.get::<f32>("g").unwrap()[0]))
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    assert_eq!(results[0], Some((2, 1.0)));
    assert_eq!(results[2], Some((2, 1.0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_and_state_are_broadcast_from_any_rank() {
    let ranks = NexarClient::bootstrap_local(3).await.unwrap();
    on_each(&ranks, |c| async move {
        let ddp = model_ddp::<f32>(&c).await;
        let r = c.rank();
        let (mut w, mut b) = (vec![r as f32; IN * OUT], vec![10.0 * r as f32; OUT]);
        ddp.broadcast(2, &mut [&mut w[..], &mut b[..]]).await.unwrap();
        assert_eq!((w[0], b[0]), (2.0, 20.0));
        let state = ddp.broadcast_bytes(1, if r == 1 { b"step 41".to_vec() } else { Vec::new() }).await.unwrap();
        assert_eq!(state, b"step 41");
        let e = ddp.broadcast(3, &mut [&mut w[..]]).await.unwrap_err();
        assert!(e.to_string().contains("root 3"), "{e}");
        // Parts of other lengths on one rank: an error on every rank, naming the part.
        let mut short = vec![0f32; if r == 0 { 4 } else { 5 }];
        let e = ddp.broadcast(0, &mut [&mut b[..], &mut short[..]]).await.unwrap_err();
        assert!(e.to_string().contains("part 1 has between 4 and 5 elements"), "{e}");
    })
    .await;
}

#[test]
fn the_blocking_calls_drive_the_layer_from_plain_threads() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let ranks = runtime.block_on(NexarClient::bootstrap_local(2)).unwrap();
    let threads: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            let handle = runtime.handle().clone();
            std::thread::spawn(move || {
                let mut ddp = handle.block_on(model_ddp::<f32>(&c));
                let mut total = 0.0;
                for step in 0..5 {
                    ddp.ready("w", &[(c.rank() + step) as f32; IN * OUT]).unwrap();
                    ddp.ready("b", &[0.0f32; OUT]).unwrap();
                    total += ddp.finish_blocking().unwrap().get::<f32>("w").unwrap()[0];
                }
                let mut w = [c.rank() as f32; 4];
                ddp.broadcast_blocking(1, &mut [&mut w[..]]).unwrap();
                let inside = handle.block_on(async { ddp.finish_blocking().err().map(|e| e.to_string()) });
                (total, w[0], inside)
            })
        })
        .collect();
    for t in threads {
        let (total, w, inside) = t.join().unwrap();
        assert_eq!(total, 0.5 + 1.5 + 2.5 + 3.5 + 4.5);
        assert_eq!(w, 1.0);
        assert!(inside.unwrap().contains("inside an async task"));
    }
}

/// Survivors at different steps (one finished the step the others failed) agree on the newest
/// step and on the lowest rank at it, whose state they take; ranks at one step agree on it with
/// no source; a fresh layer starts at step 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_agrees_on_the_newest_step_and_its_lowest_rank() {
    let ranks = NexarClient::bootstrap_local(3).await.unwrap();
    let agreed = on_each(&ranks, |c| async move {
        let mut ddp = model_ddp::<f32>(&c).await;
        let fresh = ddp.agreement();
        assert_eq!((fresh.step, fresh.source, ddp.step()), (0, None, 0));
        ddp.set_step(if c.rank() == 0 { 6 } else { 7 });
        let apart = ddp.rebuild(&c).await.unwrap();
        assert_eq!(ddp.step(), 7);
        let together = ddp.rebuild(&c).await.unwrap();
        (apart, together)
    })
    .await;
    for (r, (apart, together)) in agreed.iter().enumerate() {
        assert_eq!((apart.step, apart.source), (7, Some(1)), "rank {r}");
        assert_eq!((together.step, together.source), (7, None), "rank {r}");
    }
}
