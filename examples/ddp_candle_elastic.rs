//! Elastic data-parallel training of a candle model: the spiral MLP of `ddp_candle`, trained by
//! rank processes that survive a rank killed mid-epoch and take a replacement in, with no
//! checkpoint and no restart.
//!
//! Start a seed, the workers, kill one, start a replacement:
//!
//! ```text
//! cargo build -p nexar-examples --example ddp_candle_elastic
//! cargo build -p nexar --features cli --bin nexar
//! target/debug/nexar seed --bind 127.0.0.1:7000 --world-size 4     # prints `token: …`
//! # in four shells (or four background jobs):
//! NEXAR_SEED_ADDR=127.0.0.1:7000 NEXAR_TOKEN=<token> NEXAR_LISTEN_ADDR=127.0.0.1:0 \
//!   ELASTIC_STEP_MS=20 target/debug/examples/ddp_candle_elastic
//! # kill -9 one of them (any rank; rank 0 prints the epoch lines): the others print the error
//! # naming it, recover, and redo the step over three ranks; then start the replacement:
//! ELASTIC_JOIN=1 NEXAR_SEED_ADDR=127.0.0.1:7000 NEXAR_TOKEN=<token> NEXAR_LISTEN_ADDR=127.0.0.1:0 \
//!   ELASTIC_STEP_MS=20 target/debug/examples/ddp_candle_elastic
//! ```
//!
//! It also runs without a seed: alone (one rank) or under `nexar launch -n 4` (no replacement
//! can join a launched job, whose seed lives inside rank 0 with the job's secret).
//!
//! **Every step is one fixed global batch** (`ELASTIC_BATCH`, default 96: it divides by 2, 3
//! and 4) taken from a seeded permutation of the epoch; rank `r` of `w` trains on
//! `global[r::w]`. The loss is scaled so that the ranks' averaged gradient is exactly the
//! gradient of the global batch's mean loss, whatever the world size: when the world changes,
//! the same global step is split over the new world.
//!
//! **The optimizer is SGD with momentum, written here,** with its velocity buffers as candle
//! `Var`s, so that a survivor can hand them to a new rank (`broadcast_vars`). candle's `AdamW`
//! keeps its moment estimates private (no accessor for them), so its state cannot be sent to
//! a rank that joins; a job that wants Adam must keep the moments itself, as this one keeps
//! its velocities.
//!
//! **After a failure.** A `sync` that fails names the dead rank (printed as
//! `rank R: step S failed: …`). The survivors `recover()`, rebuild the DDP layer on the
//! survivors' communicator, which agrees on the step to redo (a survivor whose allreduce
//! completed before the others' failed is one step ahead: `rebuild` takes the newest step and
//! the parameters of the lowest rank that reached it, `nexar::ddp::StepAgreement`; the
//! velocities follow from the same rank), print `rank R: recovered, world W, redoing step
//! S`, and redo that step with the global batch split over the survivors. A failure in the
//! final weight comparison is survived the same way. A failure while the communicator grows
//! (below) ends the program with the error.
//!
//! **Growth, at epoch boundaries.** While the world is below `ELASTIC_WORLD` (default: the
//! world the job started with), the ranks wait at the next epoch boundary, at most
//! `NEXAR_JOIN_TIMEOUT_MS`, for a rank to join (`rebuild_adding(1)`). A step being redone after
//! a failure is redone over the survivors first. The members then rebuild the DDP layer on the
//! grown communicator, which gives the newcomer their step and parameters (its
//! `Builder::build` runs the same registration check, step agreement and broadcast), and send
//! it the velocities from the same rank. If nobody joins in time, training
//! goes on in the smaller world and stops waiting for one. A replacement started soon after the
//! kill may spend `NEXAR_CONNECT_TIMEOUT_MS` (default 10 s) dialling the dead rank: the seed
//! lists it until its own connection to it times out (`NEXAR_IDLE_TIMEOUT_MS`).
//!
//! **What it prints** (stdout, one line each, for people and for
//! `nexar/tests/integration/ddp_elastic.rs`): `rank R: started, world W` on every rank (a
//! newcomer: `rank R: joined as rank R at epoch E step S, world W`); from rank 0, `epoch E
//! step S world W` in the middle of every epoch and `epoch E done at step T, world W: loss …,
//! test accuracy … %` at its end; `rank R: step T (…) failed: <error>`, `rank R: recovered,
//! world W, redoing step T (…)` and `rank R: step T redone over W ranks (N samples each)` after
//! a failure; `rank R: grown, world W` after a growth; `rank R: done, world W, test accuracy …
//! %, weights identical` at the end on every rank, and a summary from rank 0.
//!
//! `ELASTIC_EPOCHS` (default 30), `ELASTIC_BATCH`, `ELASTIC_WORLD`, and `ELASTIC_STEP_MS`
//! (a pause after every step, standing in for a bigger model's compute so a rank can be killed
//! mid-epoch; default 0) change the run. The program fails unless the test accuracy ends above
//! 95 % and every rank ends with the same weights.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Var};
use candle_nn::{Module, VarBuilder, VarMap};
use nexar::ddp::DdpError;
use nexar::{CollectiveError, NexarClient};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use tokio::runtime::Runtime;

use nexar_examples::env_usize;
use nexar_examples::spiral::{Mlp, accuracy, batch, spiral};

/// SGD with momentum (PyTorch's form: `v = μ·v + g`, `w = w − lr·v`), its velocities kept in
/// candle `Var`s so that they can be broadcast to a rank that joins.
struct Momentum {
    params: Vec<Var>,
    velocity: Vec<Var>,
    lr: f64,
    momentum: f64,
}

impl Momentum {
    fn new(params: Vec<Var>, lr: f64, momentum: f64) -> candle_core::Result<Momentum> {
        let velocity =
            params.iter().map(|p| Var::zeros(p.dims(), p.dtype(), p.device())).collect::<candle_core::Result<_>>()?;
        Ok(Momentum { params, velocity, lr, momentum })
    }

    fn step(&self, grads: &GradStore) -> candle_core::Result<()> {
        for (p, v) in self.params.iter().zip(&self.velocity) {
            // After `sync` every parameter has its averaged gradient.
            let Some(g) = grads.get(p.as_tensor()) else { continue };
            let next = v.as_tensor().affine(self.momentum, 0.0)?.add(g)?;
            p.set(&p.as_tensor().sub(&next.affine(self.lr, 0.0)?)?)?;
            v.set(&next)?;
        }
        Ok(())
    }
}

/// How a piece of work failed: a collective (a rank died: recover and go on) or anything else
/// (the program ends with it).
enum Failure {
    Comm(String),
    Fatal(anyhow::Error),
}

impl From<CollectiveError> for Failure {
    fn from(e: CollectiveError) -> Self {
        Failure::Comm(e.to_string())
    }
}

impl From<nexar_candle::Error> for Failure {
    fn from(e: nexar_candle::Error) -> Self {
        match e {
            nexar_candle::Error::Ddp(d @ (DdpError::Bucket { .. } | DdpError::Collective { .. })) => {
                Failure::Comm(d.to_string())
            }
            other => Failure::Fatal(other.into()),
        }
    }
}

impl From<candle_core::Error> for Failure {
    fn from(e: candle_core::Error) -> Self {
        Failure::Fatal(e.into())
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Fatal(e)
    }
}

fn main() -> std::process::ExitCode {
    nexar_examples::main_of("ddp_candle_elastic", run)
}

/// Everything a rank trains with.
struct Job {
    runtime: Runtime,
    comm: NexarClient,
    ddp: nexar_candle::Ddp,
    model: Mlp,
    opt: Momentum,
    train: (Vec<[f32; 2]>, Vec<u32>),
    test: (Vec<[f32; 2]>, Vec<u32>),
    /// Samples per global step.
    global_batch: usize,
    steps_per_epoch: u64,
    step_pause: std::time::Duration,
}

impl Job {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// `(epoch, step of the epoch)` of global step `t`.
    fn position(&self, t: u64) -> (u64, u64) {
        (t / self.steps_per_epoch, t % self.steps_per_epoch)
    }

    /// This rank's share of global step `t`'s batch: the step's slice of the epoch's seeded
    /// permutation, every `world`-th sample from this rank's.
    fn share(&self, t: u64) -> Vec<usize> {
        let (epoch, step) = self.position(t);
        let mut order: Vec<usize> = (0..self.train.0.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7 + epoch));
        let start = step as usize * self.global_batch;
        order[start..start + self.global_batch].iter().copied().skip(self.rank()).step_by(self.world()).collect()
    }

    /// Trains global step `t` on this rank's share; returns the share's part of the global
    /// batch's mean loss, scaled as the gradient is.
    fn step(&mut self, t: u64) -> Result<f64, Failure> {
        let share = self.share(t);
        let (x, y) = batch(&self.train.0, &self.train.1, &share)?;
        // The mean over the share times share/global: the sum over the ranks is the global
        // batch's mean loss. DDP averages (divides by the world size), so scale by it too.
        let scale = (share.len() * self.world()) as f64 / self.global_batch as f64;
        let loss = candle_nn::loss::cross_entropy(&self.model.forward(&x)?, &y)?.affine(scale, 0.0)?;
        let mut grads = loss.backward()?;
        self.ddp.sync_blocking(&mut grads)?;
        self.opt.step(&grads)?;
        if !self.step_pause.is_zero() {
            std::thread::sleep(self.step_pause);
        }
        Ok(loss.to_scalar::<f32>()? as f64)
    }

    /// After a failed collective at step `t`: the survivors agree on the failed ranks, rebuild
    /// the layer on the new communicator, and agree on the step to go on from (returned).
    fn recover(&mut self, t: u64) -> anyhow::Result<u64> {
        for _attempt in 0..3 {
            let old = self.world();
            let survivors = self.runtime.block_on(self.comm.recover())?;
            anyhow::ensure!(
                survivors.world_size() < old,
                "rank {}: a collective failed, but the survivors agree that no rank did",
                self.rank()
            );
            self.comm = survivors;
            match self.runtime.block_on(resync(&mut self.ddp, &self.comm, &self.opt.velocity, t)) {
                Ok(at) => return Ok(at),
                // Another rank died meanwhile: agree again.
                Err(Failure::Comm(e)) => println!("rank {}: recovery failed: {e}; agreeing again", self.rank()),
                Err(Failure::Fatal(e)) => return Err(e),
            }
        }
        anyhow::bail!("rank {}: ranks kept failing during the recovery", self.rank())
    }

    /// At an epoch boundary, below the target world: takes in the ranks that joined (at least
    /// one, waiting at most `NEXAR_JOIN_TIMEOUT_MS`) and sends them the state. `Ok(false)`:
    /// nobody joined in time.
    fn grow(&mut self, t: u64) -> anyhow::Result<bool> {
        let (rank, world) = (self.rank(), self.world());
        println!("rank {rank}: waiting for a rank to join (world {world})");
        let grown = match self.runtime.block_on(self.comm.rebuild_adding(1)) {
            Ok(grown) => grown,
            Err(e) => {
                println!("rank {rank}: no rank joined ({e}); training on with world {world}");
                return Ok(false);
            }
        };
        // The newcomer's `Builder::build` checks the registration, agrees on the step (the
        // members') and takes the source's parameters, as `rebuild` does here; then the
        // velocities, from the same source.
        let (ddp, velocity) = (&mut self.ddp, &self.opt.velocity);
        let agreed = self.runtime.block_on(async {
            let agreed = ddp.rebuild(&grown).await?;
            ddp.broadcast_vars(velocity, agreed.source.unwrap_or(0)).await?;
            Ok::<_, nexar_candle::Error>(agreed)
        })?;
        anyhow::ensure!(agreed.step == t, "rank {rank}: growing at step {t}, the ranks agreed on {}", agreed.step);
        self.comm = grown;
        println!("rank {}: grown, world {}", self.rank(), self.world());
        Ok(true)
    }

    /// Whether every rank holds the same weights (one allreduce of a digest of them).
    fn same_weights(&self) -> Result<bool, Failure> {
        let digest = nexar_candle::values(&self.opt.params)
            .map_err(|e| Failure::Fatal(e.into()))?
            .iter()
            .flatten()
            .fold(0u64, |h, x| (h ^ x.to_bits()).wrapping_mul(0x100_0000_01b3));
        let mut both = [digest, !digest];
        self.runtime.block_on(self.comm.all_reduce(&mut both[..], nexar::Max))?;
        Ok(both[0] == !both[1])
    }
}

/// The survivors' agreement after `recover()`: `rebuild` continues on `comm` from the newest
/// step any of them finished, with the parameters of the lowest rank that finished it (a rank
/// whose allreduce completed before the failure reached the others is one step ahead; its
/// update was averaged over every rank, the dead one too, so it stands); the velocities come
/// from the same rank.
async fn resync(ddp: &mut nexar_candle::Ddp, comm: &NexarClient, velocity: &[Var], t: u64) -> Result<u64, Failure> {
    debug_assert_eq!(ddp.reducer().step(), t, "the layer counts the job's steps");
    let agreed = ddp.rebuild(comm).await?;
    ddp.broadcast_vars(velocity, agreed.source.unwrap_or(0)).await?;
    Ok(agreed.step)
}

fn run() -> anyhow::Result<()> {
    // A small runtime drives the communication; candle computes on this thread and its pool.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let joining = std::env::var("ELASTIC_JOIN").is_ok_and(|v| v == "1");
    let comm = if joining {
        let me = runtime.block_on(NexarClient::from_env())?;
        println!("world rank {}: joined the running cluster, waiting to be admitted", me.world_rank());
        runtime.block_on(me.admitted())?
    } else {
        runtime.block_on(NexarClient::init())?
    };
    let threads = env_usize("RAYON_NUM_THREADS", nexar::affinity::compute_threads());
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global()?;
    let target = env_usize("ELASTIC_WORLD", comm.world_size());
    let epochs = env_usize("ELASTIC_EPOCHS", 30) as u64;
    let global_batch = env_usize("ELASTIC_BATCH", 96);
    let step_pause = std::time::Duration::from_millis(env_usize("ELASTIC_STEP_MS", 0) as u64);

    let train = spiral(300, 3, 1);
    let test = spiral(100, 3, 2);
    anyhow::ensure!(
        (1..=train.0.len()).contains(&global_batch),
        "ELASTIC_BATCH={global_batch}: between 1 and {} samples",
        train.0.len()
    );
    // Whole global batches only: every step has the same size, whatever the world.
    let steps_per_epoch = (train.0.len() / global_batch) as u64;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    // Checks the registration against every rank, agrees on the step and gives this rank the
    // source's weights: rank 0's at the start, the members' on a newcomer (as their `rebuild`).
    let ddp = runtime.block_on(nexar_candle::Ddp::builder().build(&varmap, &comm))?;
    let params: Vec<Var> = ddp.vars().map(|(_, v)| v.clone()).collect();
    let opt = Momentum::new(params, 0.05, 0.9)?;
    let mut job = Job { runtime, comm, ddp, model, opt, train, test, global_batch, steps_per_epoch, step_pause };

    let mut t = 0u64;
    if joining {
        // `build` agreed on the members' step and took the source's parameters; the velocities
        // come from the same rank.
        let source = job.ddp.agreement().source.unwrap_or(0);
        job.runtime.block_on(job.ddp.broadcast_vars(&job.opt.velocity, source))?;
        t = job.ddp.reducer().step();
        let (epoch, step) = job.position(t);
        println!(
            "rank {}: joined as rank {} at epoch {epoch} step {step}, world {}",
            job.rank(),
            job.rank(),
            job.world()
        );
    } else {
        println!("rank {}: started, world {}", job.rank(), job.world());
    }

    let total = epochs * steps_per_epoch;
    let (mut recoveries, mut growths, mut may_grow) = (0, 0, true);
    let mut redo: Option<u64> = None;
    let mut losses = Vec::new();
    loop {
        if t == total {
            match job.same_weights() {
                Ok(same) => {
                    anyhow::ensure!(same, "rank {}: the ranks' weights differ", job.rank());
                    break;
                }
                Err(Failure::Comm(e)) => {
                    println!("rank {}: the weight comparison failed: {e}", job.rank());
                    t = job.recover(t)?;
                    recoveries += 1;
                    println!("rank {}: recovered, world {}, redoing the weight comparison", job.rank(), job.world());
                    continue;
                }
                Err(Failure::Fatal(e)) => return Err(e),
            }
        }
        // Growth at epoch boundaries, after any step being redone (every rank decides alike).
        if t.is_multiple_of(steps_per_epoch) && job.world() < target && may_grow && redo != Some(t) {
            if job.grow(t)? {
                growths += 1;
            } else {
                may_grow = false;
            }
            continue;
        }
        let (epoch, step) = job.position(t);
        if job.rank() == 0 && step == steps_per_epoch / 2 {
            println!("epoch {epoch} step {step} world {}", job.world());
        }
        match job.step(t) {
            Ok(loss) => {
                if redo.take() == Some(t) {
                    let share = job.global_batch.div_ceil(job.world());
                    println!("rank {}: step {t} redone over {} ranks ({share} samples each)", job.rank(), job.world());
                }
                losses.push(loss);
                t += 1;
                if t.is_multiple_of(steps_per_epoch) {
                    if job.rank() == 0 {
                        let test_accuracy = accuracy(&job.model, &job.test.0, &job.test.1)?;
                        let loss = losses.iter().sum::<f64>() / losses.len().max(1) as f64;
                        println!(
                            "epoch {} done at step {t}, world {}: loss {loss:.4} (rank 0's shares), test accuracy {:.1} %",
                            t / steps_per_epoch - 1,
                            job.world(),
                            100.0 * test_accuracy
                        );
                    }
                    losses.clear();
                }
            }
            Err(Failure::Comm(e)) => {
                let before = job.rank();
                println!("rank {before}: step {t} (epoch {epoch} step {step}) failed: {e}");
                let at = job.recover(t)?;
                recoveries += 1;
                let (epoch, step) = job.position(at);
                println!(
                    "rank {}: recovered, world {}, redoing step {at} (epoch {epoch} step {step}; rank {before} before)",
                    job.rank(),
                    job.world()
                );
                t = at;
                redo = Some(t);
            }
            Err(Failure::Fatal(e)) => return Err(e),
        }
    }

    // Every rank holds the same weights (checked above), so every rank's test accuracy is the
    // job's.
    let test_accuracy = accuracy(&job.model, &job.test.0, &job.test.1)?;
    anyhow::ensure!(
        test_accuracy > 0.95,
        "rank {}: test accuracy {:.1} % is not above 95 %",
        job.rank(),
        100.0 * test_accuracy
    );
    let (rank, world) = (job.rank(), job.world());
    println!("rank {rank}: done, world {world}, test accuracy {:.1} %, weights identical", 100.0 * test_accuracy);
    if rank == 0 {
        println!(
            "ddp_candle_elastic: {world} ranks at the end, {epochs} epochs, {recoveries} recoveries, {growths} growths, \
             test accuracy {:.1} %, weights identical on every rank",
            100.0 * test_accuracy
        );
    }
    let Job { runtime, comm, ddp, .. } = job;
    drop(ddp);
    runtime.block_on(comm.shutdown());
    Ok(())
}
