//! The data set and model of the data-parallel examples (`ddp_candle`, `ddp_candle_elastic`):
//! a generated 3-class spiral, nothing downloaded, and a small MLP. `ddp_burn` takes the data
//! set and builds the same MLP in burn.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder};
use rand::{Rng, SeedableRng};

// ANCHOR: data
/// `per_class` points of each of `classes` spiral arms, with noise from a seeded generator:
/// inputs `(n, 2)` and labels `(n,)`.
pub fn spiral(per_class: usize, classes: usize, seed: u64) -> (Vec<[f32; 2]>, Vec<u32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut xs = Vec::with_capacity(per_class * classes);
    let mut ys = Vec::with_capacity(per_class * classes);
    for c in 0..classes {
        for i in 0..per_class {
            let r = i as f32 / per_class as f32;
            let t = c as f32 * 4.0 + r * 4.0 + (rng.random::<f32>() - 0.5) * 0.4;
            xs.push([r * t.sin(), r * t.cos()]);
            ys.push(c as u32);
        }
    }
    (xs, ys)
}
// ANCHOR_END: data

/// The classifier of the spiral examples: `2 → 64 → 64 → 3`, ReLU between the layers.
pub struct Mlp {
    layers: Vec<candle_nn::Linear>,
}

impl Mlp {
    /// The layers' variables, named `fc0` to `fc2`, made in `vb`'s map.
    pub fn new(vb: VarBuilder) -> candle_core::Result<Mlp> {
        let dims = [2, 64, 64, 3];
        let layers = (0..3).map(|i| candle_nn::linear(dims[i], dims[i + 1], vb.pp(format!("fc{i}"))));
        Ok(Mlp { layers: layers.collect::<candle_core::Result<_>>()? })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// The samples `idx` as tensors: inputs `(n, 2)` and labels `(n,)`.
pub fn batch(xs: &[[f32; 2]], ys: &[u32], idx: &[usize]) -> candle_core::Result<(Tensor, Tensor)> {
    let x: Vec<f32> = idx.iter().flat_map(|&i| xs[i]).collect();
    let y: Vec<u32> = idx.iter().map(|&i| ys[i]).collect();
    Ok((Tensor::from_vec(x, (idx.len(), 2), &Device::Cpu)?, Tensor::from_vec(y, idx.len(), &Device::Cpu)?))
}

/// The share of `xs` that `model` classifies as `ys` says.
pub fn accuracy(model: &Mlp, xs: &[[f32; 2]], ys: &[u32]) -> anyhow::Result<f64> {
    let all: Vec<usize> = (0..xs.len()).collect();
    let (x, y) = batch(xs, ys, &all)?;
    let predicted = model.forward(&x)?.argmax(1)?;
    let right = predicted.eq(&y)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    Ok(right / xs.len() as f64)
}
