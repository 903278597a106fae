//! Two in-process ranks over real QUIC against one process on the concatenated batch, in f64:
//! burn's element type is a setting of the device, fixed once per process, so this file is a
//! process of its own, with the device's float type set to f64 before any tensor exists.

mod common;

use burn::tensor::{DType, Device, FloatDType};
use common::*;

/// Two ranks on half batches against one process on the whole batch: the same numbers, the
/// batch's sum split in two (Σ₀/(B/2) + Σ₁/(B/2)) / 2 against Σ/B. Measured after 20 steps
/// from the tests' fixed initial weights: 8.1e-16 relative (3.7e-16 to 1.3e-14 over 8 runs from
/// random ones); bound 1e-12. The same run is also bitwise equal to the in-process
/// reference that averages the two shards' gradients as nexar does.
#[test]
fn two_ranks_match_one_process_on_the_concatenated_batch_in_f64() {
    let mut flex = Device::flex();
    flex.configure(FloatDType::F64).unwrap();
    assert_eq!(dtype_of(&Mlp::new(&device(), 8)), DType::F64, "the model is not f64");
    let (steps, per) = (20, 8);
    let got = train(steps, per);
    assert_eq!(bits(&got[0].1), bits(&got[1].1), "the ranks' parameters differ after {steps} steps");
    assert_eq!(bits(&got[0].1), bits(&reference(&got[0].0, steps, per, false)), "f64: not the shards' average");
    let alone = reference(&got[0].0, steps, per, true);
    let rel = max_relative(&got[0].1, &alone);
    println!("f64: two ranks against one process: {rel:e} relative");
    assert!(rel < 1e-12, "f64: {rel:e}");
}
