//! Data-parallel training of a burn model: an MLP classifies a generated 3-class spiral (the
//! data set of `ddp_candle`, nothing is downloaded), each rank training on its share of every
//! batch, with `nexar_burn::Ddp` averaging the gradients as PyTorch's
//! `DistributedDataParallel` does, in burn's own training loop (forward, `backward`,
//! `GradientsParams`, the optimizer's `step`).
//!
//! ```text
//! cargo build -p nexar-examples --example ddp_burn
//! cargo run -p nexar --features cli --bin nexar -- launch -n 4 target/debug/examples/ddp_burn
//! ```
//!
//! `DDP_EPOCHS` (default 40) and `DDP_BATCH` (samples per rank and step, default 32) change the
//! run. Rank 0 prints the loss and the test accuracy after every epoch; the program fails unless
//! the accuracy ends above 95 % and every rank ends with the same weights.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use nexar::NexarClient;
use nexar::ddp::ShardSampler;
use nexar_examples::env_usize;
use nexar_examples::spiral::spiral;

/// The classifier of the spiral examples: `2 → 64 → 64 → 3`, ReLU between the layers.
#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn new(device: &Device) -> Mlp {
        let dims = [2, 64, 64, 3];
        Mlp { layers: (0..3).map(|i| LinearConfig::new(dims[i], dims[i + 1]).init(device)).collect() }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut h = x;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(h);
            if i + 1 < self.layers.len() {
                h = burn::tensor::activation::relu(h);
            }
        }
        h
    }
}

/// The samples `idx` as tensors: inputs `[n, 2]` and labels `[n]`.
fn batch(xs: &[[f32; 2]], ys: &[u32], idx: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
    let x: Vec<f32> = idx.iter().flat_map(|&i| xs[i]).collect();
    let y: Vec<i64> = idx.iter().map(|&i| ys[i] as i64).collect();
    let n = idx.len();
    (Tensor::from_data(TensorData::new(x, [n, 2]), device), Tensor::from_data(TensorData::new(y, [n]), device))
}

/// The share of `xs` that `model` classifies as `ys` says.
fn accuracy(model: &Mlp, xs: &[[f32; 2]], ys: &[u32], device: &Device) -> anyhow::Result<f64> {
    let all: Vec<usize> = (0..xs.len()).collect();
    let (x, _) = batch(xs, ys, &all, device);
    let predicted = model.forward(x).argmax(1).into_data().convert::<i64>();
    let predicted = predicted.try_to_vec::<i64>().map_err(|e| anyhow::anyhow!("reading the predictions: {e}"))?;
    let right = predicted.iter().zip(ys).filter(|(p, y)| **p == **y as i64).count();
    Ok(right as f64 / xs.len() as f64)
}

fn main() -> std::process::ExitCode {
    nexar_examples::main_of("ddp_burn", run)
}

// ANCHOR: main
fn run() -> anyhow::Result<()> {
    // A small runtime drives the communication; burn computes on this thread and its pool.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let comm: NexarClient = runtime.block_on(NexarClient::init())?;
    // `init` bound this thread to the rank's share of the host's cores: burn's pool (flex
    // computes on rayon's global pool) gets exactly that share.
    rayon::ThreadPoolBuilder::new().num_threads(nexar::affinity::compute_threads()).build_global()?;
    let (rank, world) = (comm.rank(), comm.world_size());

    let device = Device::flex().autodiff();
    let (xs, ys) = spiral(300, 3, 1);
    let (test_x, test_y) = spiral(100, 3, 2);
    // Every rank registers the same parameters (checked) and starts from rank 0's weights.
    let (mut ddp, mut model) = nexar_burn::Ddp::new_blocking(Mlp::new(&device), &comm, runtime.handle())?;
    let mut optim = AdamWConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);

    let (epochs, per_rank) = (env_usize("DDP_EPOCHS", 40), env_usize("DDP_BATCH", 32));
    let sampler = ShardSampler::for_comm(xs.len(), &comm).seed(7);
    let mut test_accuracy = 0.0;
    for epoch in 0..epochs as u64 {
        let mine = sampler.indices(epoch);
        let mut losses = Vec::new();
        for step in mine.chunks(per_rank) {
            let (x, y) = batch(&xs, &ys, step, &device);
            let loss = loss_fn.forward(model.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let grads = ddp.sync_blocking(&model, grads)?; // the average over every rank's share
            model = optim.step(0.01, model, grads);
            losses.push(loss.into_scalar::<f64>());
        }
        let local = losses.iter().sum::<f64>() / losses.len().max(1) as f64;
        let loss = runtime.block_on(nexar::ddp::mean_over_ranks(&comm, local))?;
        test_accuracy = accuracy(&model.valid(), &test_x, &test_y, &device.clone().inner())?;
        if rank == 0 {
            println!("epoch {epoch:>3}  loss {loss:.4}  test accuracy {:.1} %", 100.0 * test_accuracy);
        }
    }
    // ANCHOR_END: main

    // Every rank must end with the same weights: compare digests of them.
    let digest =
        nexar_burn::values(&model)?.iter().flatten().fold(0u64, |h, x| (h ^ x.to_bits()).wrapping_mul(0x100_0000_01b3));
    let mut both = [digest, !digest];
    runtime.block_on(comm.all_reduce(&mut both[..], nexar::Max))?;
    anyhow::ensure!(both[0] == !both[1], "rank {rank}: the ranks' weights differ");
    anyhow::ensure!(
        test_accuracy > 0.95,
        "rank {rank}: test accuracy {:.1} % is not above 95 %",
        100.0 * test_accuracy
    );
    if rank == 0 {
        println!(
            "ddp_burn: {world} ranks, {epochs} epochs, test accuracy {:.1} %, weights identical on every rank",
            100.0 * test_accuracy
        );
    }
    drop(ddp);
    runtime.block_on(comm.shutdown());
    Ok(())
}
