//! Data-parallel training of a candle model: an MLP classifies a generated 3-class spiral
//! (nothing is downloaded), each rank training on its share of every batch, with
//! `nexar_candle::Ddp` averaging the gradients as PyTorch's `DistributedDataParallel` does.
//!
//! ```text
//! cargo build -p nexar-examples --example ddp_candle
//! cargo run -p nexar --features cli --bin nexar -- launch -n 4 target/debug/examples/ddp_candle
//! ```
//!
//! `DDP_EPOCHS` (default 40), `DDP_BATCH` (samples per rank and step, default 32) and `DDP_HOOK`
//! (`plain`, `bf16`, `powersgd`) change the run. Rank 0 prints the loss and the test accuracy
//! after every epoch; the program fails unless the accuracy ends above 95 % and every rank ends
//! with the same weights.

use candle_core::{DType, Device};
use candle_nn::{Module, Optimizer, VarBuilder, VarMap};
use nexar::NexarClient;
use nexar::ddp::{CommHook, PowerSgd, ShardSampler};
use nexar_examples::env_usize;
use nexar_examples::spiral::{Mlp, accuracy, batch, spiral};

fn hook_from_env() -> anyhow::Result<CommHook> {
    Ok(match std::env::var("DDP_HOOK").as_deref().unwrap_or("plain") {
        "plain" => CommHook::Plain,
        "bf16" => CommHook::Compressed(nexar::Compression::Bf16),
        "powersgd" => CommHook::PowerSgd(PowerSgd { rank: 2, start_step: 10, ..Default::default() }),
        other => anyhow::bail!("DDP_HOOK={other}: expected plain, bf16 or powersgd"),
    })
}

fn main() -> std::process::ExitCode {
    nexar_examples::main_of("ddp_candle", run)
}

// ANCHOR: main
fn run() -> anyhow::Result<()> {
    // A small runtime drives the communication; candle computes on this thread and its pool.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let comm: NexarClient = runtime.block_on(NexarClient::init())?;
    // `init` bound this thread to the rank's share of the host's cores: candle's pool gets
    // exactly that share.
    rayon::ThreadPoolBuilder::new().num_threads(nexar::affinity::compute_threads()).build_global()?;
    let (rank, world) = (comm.rank(), comm.world_size());

    let (xs, ys) = spiral(300, 3, 1);
    let (test_x, test_y) = spiral(100, 3, 2);
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    // Every rank registers the same variables (checked) and starts from rank 0's weights.
    let mut ddp = runtime.block_on(nexar_candle::Ddp::builder().hook(hook_from_env()?).build(&varmap, &comm))?;
    let mut opt = candle_nn::AdamW::new_lr(varmap.all_vars(), 0.01)?;

    let (epochs, per_rank) = (env_usize("DDP_EPOCHS", 40), env_usize("DDP_BATCH", 32));
    let sampler = ShardSampler::for_comm(xs.len(), &comm).seed(7);
    let mut test_accuracy = 0.0;
    for epoch in 0..epochs as u64 {
        let mine = sampler.indices(epoch);
        let mut losses = Vec::new();
        for step in mine.chunks(per_rank) {
            let (x, y) = batch(&xs, &ys, step)?;
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
            let mut grads = loss.backward()?;
            ddp.sync_blocking(&mut grads)?; // the average over every rank's share
            opt.step(&grads)?;
            losses.push(loss.to_scalar::<f32>()? as f64);
        }
        let local = losses.iter().sum::<f64>() / losses.len().max(1) as f64;
        let loss = runtime.block_on(nexar::ddp::mean_over_ranks(&comm, local))?;
        test_accuracy = accuracy(&model, &test_x, &test_y)?;
        if rank == 0 {
            println!("epoch {epoch:>3}  loss {loss:.4}  test accuracy {:.1} %", 100.0 * test_accuracy);
        }
    }
    // ANCHOR_END: main

    // Every rank must end with the same weights: compare digests of them.
    let vars: Vec<candle_core::Var> = ddp.vars().map(|(_, v)| v.clone()).collect();
    let digest = nexar_candle::values(&vars)?
        .iter()
        .flatten()
        .fold(0u64, |h, x| (h ^ x.to_bits()).wrapping_mul(0x100_0000_01b3));
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
            "ddp_candle: {world} ranks, {epochs} epochs, test accuracy {:.1} %, weights identical on every rank",
            100.0 * test_accuracy
        );
    }
    drop(ddp);
    runtime.block_on(comm.shutdown());
    Ok(())
}
