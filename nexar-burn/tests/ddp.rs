//! `nexar_burn::Ddp` with real burn models on in-process ranks over real QUIC, in f32 (the f64
//! comparison is `ddp_f64.rs`, a process of its own: burn's element type is a setting of the
//! device, fixed once per process): parameters bitwise equal across ranks and to a reference
//! that averages the shards' gradients alike; two ranks against one process on the whole batch;
//! a parameter without a gradient and an entry that is no parameter; a model whose parameter
//! shapes differ between ranks.

mod common;

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use common::*;
use nexar::NexarClient;

const LIMIT: std::time::Duration = std::time::Duration::from_secs(180);

#[test]
fn two_ranks_end_bitwise_equal_to_each_other_and_to_a_reference_after_20_steps() {
    let (steps, per) = (20, 8);
    let got = train(steps, per);
    assert_eq!(dtype_of(&Mlp::new(&device(), 8)), DType::F32);
    assert_eq!(bits(&got[0].0), bits(&got[1].0), "rank 1 did not start from rank 0's weights");
    assert_eq!(bits(&got[0].1), bits(&got[1].1), "the ranks' parameters differ after {steps} steps");
    assert_ne!(bits(&got[0].0), bits(&got[0].1), "the parameters did not move");
    let want = reference(&got[0].0, steps, per, false);
    assert_eq!(bits(&got[0].1), bits(&want), "the parameters differ from the in-process reference");
}

/// Two ranks on half batches against one process on the whole batch: the same numbers, the
/// batch's sum split in two (Σ₀/(B/2) + Σ₁/(B/2)) / 2 against Σ/B. Measured after 20 steps
/// from the tests' fixed initial weights: f32 4.4e-7 relative (1.9e-7 to 1.0e-6 over 13 runs
/// from random ones); bound 1e-5, documented in the guide's training chapter. f64 is in
/// `ddp_f64.rs`.
#[test]
fn two_ranks_match_one_process_on_the_concatenated_batch_in_f32() {
    let (steps, per) = (20, 8);
    let got = train(steps, per);
    let alone = reference(&got[0].0, steps, per, true);
    let rel = max_relative(&got[0].1, &alone);
    println!("f32: two ranks against one process: {rel:e} relative");
    assert!(rel < 1e-5, "f32: {rel:e}");
}

/// Two parameters `a` and `b`, both ones.
#[derive(Module, Debug)]
struct Two {
    a: Param<Tensor<1>>,
    b: Param<Tensor<1>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parameter_without_gradient_gets_the_others_average_and_other_entries_are_left_alone() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                let device = device();
                let ones = || Param::from_tensor(Tensor::<1>::ones([4], &device));
                let (mut ddp, model) = nexar_burn::Ddp::new(Two { a: ones(), b: ones() }, &c).await.unwrap();
                assert_eq!(ddp.param_names().collect::<Vec<_>>(), ["a", "b"]);
                // Rank 0 uses `b`, rank 1 does not: rank 1 has no gradient for it.
                let input = Tensor::<1>::from_floats([2.0, 2.0, 2.0, 2.0], &device);
                let r = c.rank() as f64 + 1.0;
                let mut y = (model.a.val() * input).mul_scalar(r).sum();
                if c.rank() == 0 {
                    y = y + model.b.val().sum();
                }
                let mut grads = GradientsParams::from_grads(y.backward(), &model);
                assert_eq!(grads.get::<1>(model.b.id).is_some(), c.rank() == 0);
                // An entry for something that is no parameter of the model.
                let other = burn::module::ParamId::new();
                grads.register(other, Tensor::<1>::from_floats([7.0 + r as f32], &device.clone().inner()));
                let grads = tokio::time::timeout(LIMIT, ddp.sync(&model, grads)).await.unwrap().unwrap();
                let ga = grads.get::<1>(model.a.id).unwrap().into_data().try_to_vec::<f32>().unwrap();
                let gb = grads.get::<1>(model.b.id).unwrap().into_data().try_to_vec::<f32>().unwrap();
                let go = grads.get::<1>(other).unwrap().into_data().try_to_vec::<f32>().unwrap();
                drop(ddp);
                c.shutdown().await;
                (ga, gb, go)
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    for (r, (ga, gb, go)) in results.iter().enumerate() {
        assert_eq!(ga, &[3.0; 4], "rank {r}: (2·1 + 2·2) / 2");
        assert_eq!(gb, &[0.5; 4], "rank {r}: (1 + 0) / 2");
        assert_eq!(go, &[8.0 + r as f32], "rank {r}: an entry that is no parameter is its own");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parameter_shape_that_differs_between_ranks_is_an_error_on_every_rank_naming_it() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                // Rank 1's hidden layer is one wider: fc1.weight is [4, 9] there, not [4, 8].
                let model = Mlp::new(&device(), 8 + c.rank());
                let message = match tokio::time::timeout(LIMIT, nexar_burn::Ddp::new(model, &c)).await.unwrap() {
                    Ok(_) => panic!("rank {}: built over models of other shapes", c.rank()),
                    Err(e) => e.to_string(),
                };
                c.shutdown().await;
                message
            })
        })
        .collect();
    for (r, t) in tasks.into_iter().enumerate() {
        let message = t.await.unwrap();
        assert!(message.contains("ranks registered different parameters"), "rank {r}: {message}");
        assert!(message.contains("`fc1.weight`"), "rank {r}: {message}");
        assert!(message.contains("[4, 8]") && message.contains("[4, 9]"), "rank {r}: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_changed_since_the_build_is_an_error_naming_the_parameter() {
    let mut ranks = NexarClient::bootstrap_local(1).await.unwrap();
    let c = ranks.pop().unwrap();
    let device = device();
    let (mut ddp, model) = nexar_burn::Ddp::new(Mlp::new(&device, 8), &c).await.unwrap();
    let wider = Mlp::new(&device, 9);
    let grads = grads_on(&wider, &[0, 1], &device);
    let e = ddp.sync(&wider, grads).await.unwrap_err();
    assert!(matches!(e, nexar_burn::Error::ModelChanged { .. }), "{e}");
    assert!(e.to_string().contains("`fc1.weight`"), "{e}");
    // The model it was built from still syncs.
    let grads = grads_on(&model, &[0, 1], &device);
    tokio::time::timeout(LIMIT, ddp.sync(&model, grads)).await.unwrap().unwrap();
    drop(ddp);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_no_sync_step_gives_its_running_sums_back_and_the_next_step_averages_both() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                let device = device();
                let ones = || Param::from_tensor(Tensor::<1>::ones([2], &device));
                let (mut ddp, model) = nexar_burn::Ddp::new(Two { a: ones(), b: ones() }, &c).await.unwrap();
                // Each step, rank r's gradient of `a` is r + 1 and of `b` is 1.
                let step = |model: &Two| {
                    let y = model.a.val().mul_scalar(c.rank() as f64 + 1.0).sum() + model.b.val().sum();
                    GradientsParams::from_grads(y.backward(), model)
                };
                let a_of =
                    |g: &GradientsParams| g.get::<1>(model.a.id).unwrap().into_data().try_to_vec::<f32>().unwrap();
                ddp.no_sync().unwrap();
                let accumulated = tokio::time::timeout(LIMIT, ddp.sync(&model, step(&model))).await.unwrap().unwrap();
                let synced = tokio::time::timeout(LIMIT, ddp.sync(&model, step(&model))).await.unwrap().unwrap();
                let got = (a_of(&accumulated), a_of(&synced));
                drop(ddp);
                c.shutdown().await;
                got
            })
        })
        .collect();
    for (r, t) in tasks.into_iter().enumerate() {
        let (accumulated, synced) = t.await.unwrap();
        assert_eq!(accumulated, [(r + 1) as f32; 2], "rank {r}: its own running sum");
        assert_eq!(synced, [3.0; 2], "rank {r}: (2·1 + 2·2) / 2");
    }
}
