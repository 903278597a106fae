//! The step time of nexar-candle's DDP against the same model trained in one process: an MLP of
//! `--layers` Linear layers of `--width` (25 × 1000 by default: 50 parameter tensors, 25 M
//! parameters), trained with SGD on a fixed batch against a fixed target (MSE). What
//! `bench/compare_ddp.py` runs beside PyTorch DDP with the same shapes.
//!
//! ```text
//! cargo build --release -p nexar-candle --example ddp_bench
//! cargo build --release -p nexar --features cli --bin nexar
//! RAYON_NUM_THREADS=1 target/release/examples/ddp_bench --local
//! RAYON_NUM_THREADS=1 target/release/nexar launch -n 2 target/release/examples/ddp_bench --hook bf16
//! ```
//!
//! `--batch B` is the global batch: `--local` trains one process on `B / 2` samples (one rank's
//! share at np 2, the reference for DDP's overhead); under `nexar launch -n N` every rank
//! trains on `B / N`. Each step is timed in parts: `compute` (forward and backward), the copies
//! of the gradients into the buckets (`copy_in`, which also starts each complete bucket's
//! allreduce), the wait for the buckets (`exposed`: the allreduce time not hidden behind the
//! copies, the hook's own work included), the copies of the averages back into gradient tensors
//! (`copy_out`) and the optimizer (`opt`). The parts are the steps of `nexar_candle::Ddp::sync`,
//! done here through the reducer underneath so that each can be timed; `--sync library` calls
//! `Ddp::sync_blocking` instead (copies and wait as one `sync` figure), to check that the split
//! costs nothing. Each rank prints one JSON line: medians and p99 in milliseconds, and its peak
//! resident memory (`VmHWM`).
//!
//! Other options: `--hook plain|bf16|powersgd`, `--powersgd-rank R` (default 4),
//! `--powersgd-start S` (default 2), `--bucket-mb M` (default 25; MiB, as torch's
//! `bucket_cap_mb`), `--steps N` (default 30), `--warmup W` (default 5), `--lr` (default 1e-4).

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, Storage, Tensor, Var};
use candle_nn::{Linear, Module, Optimizer, VarBuilder, VarMap};
use nexar::NexarClient;
use nexar::ddp::{CommHook, PowerSgd};

#[derive(Clone, Debug)]
struct Args {
    local: bool,
    hook: String,
    layers: usize,
    width: usize,
    batch: usize,
    steps: usize,
    warmup: usize,
    bucket_mb: usize,
    powersgd_rank: usize,
    powersgd_start: u64,
    lr: f64,
    library_sync: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        local: false,
        hook: "plain".into(),
        layers: 25,
        width: 1000,
        batch: 64,
        steps: 30,
        warmup: 5,
        bucket_mb: 25,
        powersgd_rank: 4,
        powersgd_start: 2,
        lr: 1e-4,
        library_sync: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--local" {
            a.local = true;
            continue;
        }
        let value = it.next().ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<usize>().map_err(|e| anyhow::anyhow!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--hook" => a.hook = value,
            "--layers" => a.layers = num(&value)?,
            "--width" => a.width = num(&value)?,
            "--batch" => a.batch = num(&value)?,
            "--steps" => a.steps = num(&value)?,
            "--warmup" => a.warmup = num(&value)?,
            "--bucket-mb" => a.bucket_mb = num(&value)?,
            "--powersgd-rank" => a.powersgd_rank = num(&value)?,
            "--powersgd-start" => a.powersgd_start = num(&value)? as u64,
            "--lr" => a.lr = value.parse()?,
            "--sync" => match value.as_str() {
                "split" => a.library_sync = false,
                "library" => a.library_sync = true,
                other => anyhow::bail!("--sync {other}: expected split or library"),
            },
            other => anyhow::bail!("unknown option {other} (see the file's header)"),
        }
    }
    anyhow::ensure!(a.layers >= 1 && a.width >= 1 && a.steps >= 1, "layers, width and steps must be at least 1");
    Ok(a)
}

fn hook(a: &Args) -> anyhow::Result<CommHook> {
    Ok(match a.hook.as_str() {
        "plain" => CommHook::Plain,
        "bf16" => CommHook::Compressed(nexar::Compression::Bf16),
        "powersgd" => {
            CommHook::PowerSgd(PowerSgd { rank: a.powersgd_rank, start_step: a.powersgd_start, ..Default::default() })
        }
        other => anyhow::bail!("--hook {other}: expected plain, bf16 or powersgd"),
    })
}

struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    /// `layers` Linear layers `width → width` named `fc00`, `fc01`, …: weight and bias each.
    fn new(layers: usize, width: usize, vb: VarBuilder) -> candle_core::Result<Mlp> {
        let layers = (0..layers).map(|i| candle_nn::linear(width, width, vb.pp(format!("fc{i:02}"))));
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

/// Milliseconds of each part of each timed step.
#[derive(Default)]
struct Times {
    step: Vec<f64>,
    compute: Vec<f64>,
    /// `compute` and `opt` of the same step: what torch's `no_sync()` step holds.
    compute_opt: Vec<f64>,
    copy_in: Vec<f64>,
    exposed: Vec<f64>,
    copy_out: Vec<f64>,
    sync: Vec<f64>,
    opt: Vec<f64>,
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Median and p99 (nearest rank) of `v`.
fn stats(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let median = if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 };
    let p99 = s[((0.99 * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1];
    (median, p99)
}

/// A line of `/proc/self/status` in MiB (`VmHWM`, the peak resident memory; `VmRSS`).
fn status_mib(key: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// What one run prints: where it ran, its figures and its memory.
struct Report<'a> {
    mode: &'a str,
    rank: usize,
    world: usize,
    per_rank: usize,
    params: (usize, usize),
    /// `VmHWM` and `VmRSS` at the end of the timed steps, MiB.
    memory: (f64, f64),
    /// Minor page faults per timed step.
    faults: f64,
}

/// Minor page faults of this process so far (`/proc/self/stat`, field 10): a step that faults
/// in tens of thousands of pages is paying for memory the allocator gave back to the system.
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    after_name.split_whitespace().nth(7).and_then(|f| f.parse().ok()).unwrap_or(0)
}

fn json_line(a: &Args, r: &Report, t: &Times, extra: &str) -> String {
    let Report { mode, rank, world, per_rank, params, memory, faults } = *r;
    let mut out = format!(
        "{{\"framework\":\"nexar\",\"mode\":\"{mode}\",\"hook\":\"{}\",\"rank\":{rank},\"world\":{world},\
         \"tensors\":{},\"params\":{},\"layers\":{},\"width\":{},\"batch\":{},\"per_rank_batch\":{},\
         \"steps\":{},\"threads\":{}",
        if mode == "local" { "none" } else { &a.hook },
        params.0,
        params.1,
        a.layers,
        a.width,
        a.batch,
        per_rank,
        t.step.len(),
        candle_core::utils::get_num_threads(),
    );
    for (name, v) in [
        ("step", &t.step),
        ("compute", &t.compute),
        ("compute_opt", &t.compute_opt),
        ("copy_in", &t.copy_in),
        ("exposed", &t.exposed),
        ("copy_out", &t.copy_out),
        ("sync", &t.sync),
        ("opt", &t.opt),
    ] {
        if !v.is_empty() {
            let (m, p) = stats(v);
            out.push_str(&format!(",\"{name}_ms\":{m:.3},\"{name}_p99_ms\":{p:.3}"));
        }
    }
    out.push_str(&format!(
        ",\"peak_rss_mib\":{:.1},\"rss_mib\":{:.1},\"minor_faults_per_step\":{faults:.0}{extra}}}",
        memory.0, memory.1
    ));
    out
}

/// The model, its data and its optimizer, for `per_rank` samples.
struct Setup {
    varmap: VarMap,
    model: Mlp,
    x: Tensor,
    target: Tensor,
}

fn setup(a: &Args, per_rank: usize) -> anyhow::Result<Setup> {
    let varmap = VarMap::new();
    let model = Mlp::new(a.layers, a.width, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let x = Tensor::randn(0f32, 1.0, (per_rank, a.width), &Device::Cpu)?;
    let target = Tensor::randn(0f32, 1.0, (per_rank, a.width), &Device::Cpu)?;
    Ok(Setup { varmap, model, x, target })
}

fn param_counts(varmap: &VarMap) -> (usize, usize) {
    let vars = varmap.all_vars();
    (vars.len(), vars.iter().map(|v| v.elem_count()).sum())
}

fn forward_backward(s: &Setup) -> anyhow::Result<GradStore> {
    let loss = candle_nn::loss::mse(&s.model.forward(&s.x)?, &s.target)?;
    Ok(loss.backward()?)
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ddp_bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let a = parse_args()?;
    if a.local { run_local(&a) } else { run_ddp(&a) }
}

/// One process, no DDP, half the global batch.
fn run_local(a: &Args) -> anyhow::Result<()> {
    let s = setup(a, a.batch / 2)?;
    let mut opt = candle_nn::SGD::new(s.varmap.all_vars(), a.lr)?;
    let mut t = Times::default();
    let mut faults = 0;
    for i in 0..a.warmup + a.steps {
        let f0 = minor_faults();
        let start = Instant::now();
        let grads = forward_backward(&s)?;
        let compute = ms(start);
        let o = Instant::now();
        opt.step(&grads)?;
        let opt_ms = ms(o);
        drop(grads);
        if i >= a.warmup {
            t.step.push(ms(start));
            t.compute.push(compute);
            t.compute_opt.push(compute + opt_ms);
            t.opt.push(opt_ms);
            faults += minor_faults() - f0;
        }
    }
    let memory = (status_mib("VmHWM"), status_mib("VmRSS"));
    let report = Report {
        mode: "local",
        rank: 0,
        world: 1,
        per_rank: a.batch / 2,
        params: param_counts(&s.varmap),
        memory,
        faults: faults as f64 / a.steps as f64,
    };
    println!("{}", json_line(a, &report, &t, ""));
    Ok(())
}

fn run_ddp(a: &Args) -> anyhow::Result<()> {
    // A small runtime drives the communication; candle computes on this thread and its pool.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let comm: NexarClient = runtime.block_on(NexarClient::init())?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let s = setup(a, a.batch / world)?;
    let mut ddp = runtime.block_on(
        nexar_candle::Ddp::builder().hook(hook(a)?).bucket_cap_bytes(a.bucket_mb << 20).build(&s.varmap, &comm),
    )?;
    let mut opt = candle_nn::SGD::new(s.varmap.all_vars(), a.lr)?;
    let vars: Vec<Var> = ddp.vars().map(|(_, v)| v.clone()).collect();
    let layout = ddp.reducer().layout().clone();
    let mut t = Times::default();
    let mut strided = 0usize;
    let mut faults = 0;
    for i in 0..a.warmup + a.steps {
        let f0 = minor_faults();
        let start = Instant::now();
        let mut grads = forward_backward(&s)?;
        let compute = ms(start);
        let sync_start = Instant::now();
        let (mut copy_in, mut exposed, mut copy_out) = (0.0, 0.0, 0.0);
        if a.library_sync {
            ddp.sync_blocking(&mut grads)?;
        } else {
            // `Ddp::sync`, step by step: every gradient into its bucket, in bucket order (a
            // complete bucket goes on the wire at once), then the wait, then the copies back.
            let c = Instant::now();
            let reducer = ddp.reducer_mut();
            for bucket in &layout.buckets {
                for &p in &bucket.members {
                    let g = grads.get(vars[p].as_tensor()).ok_or_else(|| anyhow::anyhow!("no gradient for #{p}"))?;
                    if !g.is_contiguous() {
                        strided += 1;
                    }
                    let g = g.contiguous()?;
                    let (storage, l) = g.storage_and_layout();
                    let Storage::Cpu(CpuStorage::F32(v)) = &*storage else { anyhow::bail!("an f32 CPU gradient") };
                    let (from, to) = l.contiguous_offsets().ok_or_else(|| anyhow::anyhow!("contiguous"))?;
                    reducer.ready_index(p, &v[from..to])?;
                }
            }
            copy_in = ms(c);
            let w = Instant::now();
            let averaged = reducer.finish_blocking()?;
            exposed = ms(w);
            let c = Instant::now();
            for (p, var) in vars.iter().enumerate() {
                let avg = Tensor::from_slice(averaged.get_index::<f32>(p)?, var.shape(), var.device())?;
                grads.insert(var.as_tensor(), avg);
            }
            copy_out = ms(c);
        }
        let sync = ms(sync_start);
        let o = Instant::now();
        opt.step(&grads)?;
        let opt_ms = ms(o);
        drop(grads);
        if i >= a.warmup {
            t.step.push(ms(start));
            t.compute.push(compute);
            t.compute_opt.push(compute + opt_ms);
            t.sync.push(sync);
            t.opt.push(opt_ms);
            faults += minor_faults() - f0;
            if !a.library_sync {
                t.copy_in.push(copy_in);
                t.exposed.push(exposed);
                t.copy_out.push(copy_out);
            }
        }
    }
    // Before the check below, whose copies of the weights are no part of training.
    let memory = (status_mib("VmHWM"), status_mib("VmRSS"));
    // The ranks must have stayed in step: the same weights everywhere.
    let digest = nexar_candle::values(&vars)?
        .iter()
        .flatten()
        .fold(0u64, |h, x| (h ^ x.to_bits()).wrapping_mul(0x100_0000_01b3));
    let mut both = [digest, !digest];
    runtime.block_on(comm.all_reduce(&mut both[..], nexar::Max))?;
    anyhow::ensure!(both[0] == !both[1], "rank {rank}: the ranks' weights differ");
    let extra = format!(
        ",\"buckets\":{},\"strided_grads_per_step\":{},\"sync_mode\":\"{}\"",
        layout.buckets.len(),
        strided / (a.warmup + a.steps),
        if a.library_sync { "library" } else { "split" }
    );
    let report = Report {
        mode: "ddp",
        rank,
        world,
        per_rank: a.batch / world,
        params: param_counts(&s.varmap),
        memory,
        faults: faults as f64 / a.steps as f64,
    };
    println!("{}", json_line(a, &report, &t, &extra));
    drop(ddp);
    runtime.block_on(comm.shutdown());
    Ok(())
}
