//! What the test files share: an MLP, its data, data-parallel training on two in-process ranks
//! over real QUIC, and the one-process references it is compared with.

#![allow(dead_code)] // Each test file uses its part.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{DType, Device, Tensor, TensorData};
use nexar::NexarClient;

/// A two-layer MLP `4 → width → 3` with tanh between the layers.
#[derive(Module, Debug)]
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Mlp {
    pub fn new(device: &Device, width: usize) -> Mlp {
        Mlp { fc1: LinearConfig::new(4, width).init(device), fc2: LinearConfig::new(width, 3).init(device) }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.fc1.forward(x).tanh())
    }
}

/// The device of the tests: burn's CPU backend with autodiff.
pub fn device() -> Device {
    Device::flex().autodiff()
}

/// Samples `idx`: four inputs in [-1, 1] and a target of three values each.
pub fn samples(idx: &[usize], device: &Device) -> (Tensor<2>, Tensor<2>) {
    let x: Vec<f64> =
        idx.iter().flat_map(|&i| (0..4).map(move |k| (((i * 31 + k * 17) % 200) as f64 / 100.0) - 1.0)).collect();
    let y: Vec<f64> = idx.iter().flat_map(|&i| (0..3).map(move |o| ((i + o) % 5) as f64 * 0.2)).collect();
    let n = idx.len();
    (Tensor::from_data(TensorData::new(x, [n, 4]), device), Tensor::from_data(TensorData::new(y, [n, 3]), device))
}

/// The mean squared error on `idx` and its gradients.
pub fn grads_on(model: &Mlp, idx: &[usize], device: &Device) -> GradientsParams {
    let (x, y) = samples(idx, device);
    let loss = (model.forward(x) - y).square().mean();
    GradientsParams::from_grads(loss.backward(), model)
}

/// Rank `r`'s samples at `step`: a disjoint half of the step's batch of `2 × per`.
pub fn shard(step: usize, r: usize, per: usize) -> Vec<usize> {
    (0..per).map(|j| step * 2 * per + 2 * j + r).collect()
}

pub const LR: f64 = 0.1;

/// A model's float parameters, each flattened to `f64`, in visit order.
pub type Values = Vec<Vec<f64>>;

/// Trains `steps` SGD steps data-parallel on two ranks, each a thread with burn's blocking
/// loop and the `_blocking` calls; returns every rank's parameter values after the broadcast
/// and at the end, in visit order.
pub fn train(steps: usize, per: usize) -> Vec<(Values, Values)> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let ranks = runtime.block_on(NexarClient::bootstrap_local(2)).unwrap();
    let handle = runtime.handle().clone();
    std::thread::scope(|s| {
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|comm| {
                let handle = handle.clone();
                s.spawn(move || {
                    let device = device();
                    // Each rank starts from weights of its own; the broadcast gives rank 1 rank 0's.
                    let model = Mlp::new(&device, 8);
                    let model = with_values(model.clone(), &initial_values(&model, comm.rank()));
                    let (mut ddp, mut model) = nexar_burn::Ddp::new_blocking(model, &comm, &handle).unwrap();
                    let initial = nexar_burn::values(&model).unwrap();
                    let mut optim = SgdConfig::new().init();
                    for step in 0..steps {
                        let grads = grads_on(&model, &shard(step, comm.rank(), per), &device);
                        let grads = ddp.sync_blocking(&model, grads).unwrap();
                        model = optim.step(LR, model, grads);
                    }
                    let end = nexar_burn::values(&model).unwrap();
                    // Leave cleanly: a rank that dropped its client at once could close its
                    // connection before the other received the step's last message.
                    drop(ddp);
                    handle.block_on(comm.shutdown());
                    (initial, end)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// Initial values for `model`'s float parameters that differ from rank to rank and are the
/// same from run to run (burn's generator is shared by the tests running at once), so that
/// the measured differences repeat.
pub fn initial_values<M: Module>(model: &M, rank: usize) -> Values {
    let sizes = nexar_burn::values(model).unwrap().into_iter().map(|v| v.len());
    sizes
        .enumerate()
        .map(|(k, n)| (0..n).map(|j| (((j * 37 + k * 11 + rank * 5) % 17) as f64 / 17.0 - 0.5) * 0.8).collect())
        .collect()
}

/// `model` with `values` (in visit order) as its float parameters.
pub fn with_values<M: Module>(model: M, values: &[Vec<f64>]) -> M {
    struct Set<'a>(std::slice::Iter<'a, Vec<f64>>);
    impl ModuleMapper for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let v = self.0.next().unwrap().clone();
            param.map(|old| {
                let data = TensorData::new(v, old.shape()).convert_dtype(old.dtype());
                Tensor::from_data(data, (&old.device(), old.dtype())).require_grad()
            })
        }
    }
    model.map(&mut Set(values.iter()))
}

/// Both shards' gradients averaged as nexar averages them: a sum, then a division by 2, in the
/// element type.
pub fn averaged(model: &Mlp, mut g0: GradientsParams, mut g1: GradientsParams) -> GradientsParams {
    struct Average<'a> {
        g0: &'a mut GradientsParams,
        g1: &'a mut GradientsParams,
        out: GradientsParams,
    }
    impl ModuleVisitor for Average<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let a = self.g0.remove::<D>(param.id).unwrap();
            let b = self.g1.remove::<D>(param.id).unwrap();
            let (shape, dtype, device) = (a.shape(), a.dtype(), a.device());
            let data = match dtype {
                DType::F64 => {
                    let (a, b) =
                        (a.into_data().try_to_vec::<f64>().unwrap(), b.into_data().try_to_vec::<f64>().unwrap());
                    TensorData::new(a.iter().zip(&b).map(|(x, y)| (x + y) / 2.0).collect::<Vec<f64>>(), shape)
                }
                _ => {
                    let (a, b) =
                        (a.into_data().try_to_vec::<f32>().unwrap(), b.into_data().try_to_vec::<f32>().unwrap());
                    TensorData::new(a.iter().zip(&b).map(|(x, y)| (x + y) / 2.0).collect::<Vec<f32>>(), shape)
                }
            };
            self.out.register(param.id, Tensor::<D>::from_data(data, (&device, dtype)));
        }
    }
    let mut avg = Average { g0: &mut g0, g1: &mut g1, out: GradientsParams::new() };
    model.visit(&mut avg);
    avg.out
}

/// The reference: one process from the same initial values, either both shards' gradients
/// averaged as nexar averages them, or the whole batch at once.
pub fn reference(initial: &[Vec<f64>], steps: usize, per: usize, whole_batch: bool) -> Values {
    let device = device();
    let mut model = with_values(Mlp::new(&device, 8), initial);
    let mut optim = SgdConfig::new().init();
    for step in 0..steps {
        let grads = if whole_batch {
            let all: Vec<usize> = (step * 2 * per..(step + 1) * 2 * per).collect();
            grads_on(&model, &all, &device)
        } else {
            let g0 = grads_on(&model, &shard(step, 0, per), &device);
            let g1 = grads_on(&model, &shard(step, 1, per), &device);
            averaged(&model, g0, g1)
        };
        model = optim.step(LR, model, grads);
    }
    nexar_burn::values(&model).unwrap()
}

pub fn bits(v: &[Vec<f64>]) -> Vec<u64> {
    v.iter().flatten().map(|x| x.to_bits()).collect()
}

pub fn max_relative(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs() / y.abs().max(1e-3)).fold(0.0, f64::max)
}

/// The element type of `model`'s float parameters (all alike in these tests).
pub fn dtype_of<M: Module>(model: &M) -> DType {
    struct First(Option<DType>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.get_or_insert(param.val().dtype());
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0.unwrap()
}
