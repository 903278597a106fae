//! One rank of the scale benchmark (`bench/scale.py`): how long the cluster takes to form, the
//! first allreduce (1 Mi f64, which also brings the links' back ends up), a steady 4 KiB
//! allreduce (median and p99 of the slowest rank), this rank's proportional memory (PSS) and
//! the liveness messages it sends per second while idle. Prints one JSON line.
//!
//! With `SCALE_KILL_RANK=K` (under `nexar launch --on-failure continue`), rank K then prints
//! its process id (`{"victim_pid": …}`) and waits to be killed from outside (`kill -9`); the
//! others start an allreduce that waits for it, and each prints when that allreduce failed
//! naming the dead rank and when `recover()` returned (seconds since the Unix epoch), and checks
//! an allreduce on the rebuilt communicator.
//!
//! ```text
//! cargo build --release -p nexar --features cli --bin nexar --example scale
//! target/release/nexar launch -n 64 target/release/examples/scale
//! ```

use std::time::{Duration, Instant};

use nexar::prelude::*;

/// Kilobytes of proportional set size, from `/proc/self/smaps_rollup` (0 where unreadable).
fn pss_kib() -> u64 {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The value of `var` as a number, or `default`.
fn env_usize(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

async fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    let comm = NexarClient::init().await?;
    let formed = started.elapsed();
    let (me, world) = (comm.rank(), comm.world_size());

    let mut big = vec![1.0f64; 1 << 20];
    let t = Instant::now();
    comm.all_reduce(&mut big, Sum).await?;
    let first = t.elapsed();
    anyhow::ensure!(big.iter().all(|&x| x == world as f64), "rank {me}: the first allreduce is wrong");

    let iterations = env_usize("SCALE_ITERATIONS", 200);
    let mut small = vec![1.0f32; 1024];
    for _ in 0..20 {
        comm.all_reduce(&mut small, Sum).await?;
    }
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let t = Instant::now();
        comm.all_reduce(&mut small, Sum).await?;
        times.push(t.elapsed().as_secs_f64());
    }
    // The slowest rank's time is the operation's: the maximum over ranks, per iteration.
    comm.all_reduce(&mut times, Max).await?;
    times.sort_by(f64::total_cmp);

    let idle = Duration::from_secs(env_usize("SCALE_IDLE_S", 5) as u64);
    let before = comm.liveness_sent();
    tokio::time::sleep(idle).await;
    let liveness = (comm.liveness_sent() - before) as f64 / idle.as_secs_f64();
    let pss = pss_kib();
    println!(
        "{{\"rank\":{me},\"world\":{world},\"form_s\":{:.3},\"first_allreduce_s\":{:.4},\"steady_4k_median_us\":{:.1},\"steady_4k_p99_us\":{:.1},\"pss_kib\":{pss},\"liveness_per_s\":{liveness:.2},\"dead\":{}}}",
        formed.as_secs_f64(),
        first.as_secs_f64(),
        percentile(&times, 0.5) * 1e6,
        percentile(&times, 0.99) * 1e6,
        comm.failed_ranks().len(),
    );
    comm.barrier().await?;
    if let Some(victim) = std::env::var("SCALE_KILL_RANK").ok().and_then(|v| v.parse::<usize>().ok()) {
        return survive(comm, victim).await;
    }
    comm.shutdown().await;
    Ok(())
}

/// Seconds since the Unix epoch, to compare with the time of the kill.
fn epoch_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The kill run: `victim` waits to be killed, the others find it dead and recover.
async fn survive(comm: NexarClient, victim: usize) -> anyhow::Result<()> {
    let me = comm.rank();
    if me == victim {
        println!("{{\"rank\":{me},\"victim_pid\":{}}}", std::process::id());
        tokio::time::sleep(Duration::from_secs(3600)).await;
        anyhow::bail!("rank {me} was to be killed");
    }
    let mut x = vec![1.0f32; 1024];
    let err = match comm.all_reduce(&mut x, Sum).await {
        Ok(()) => anyhow::bail!("rank {me}: an allreduce without rank {victim} completed"),
        Err(e) => e,
    };
    let failed_at = epoch_s();
    // Found by this rank, or by another that aborted the allreduce for it.
    let named = comm.failed_ranks().contains(&victim) || err.to_string().contains(&format!("rank {victim} is gone"));
    anyhow::ensure!(named, "rank {me}: the allreduce failed, but not for rank {victim}: {err}");
    let rebuilt = comm.recover().await?;
    let recovered_at = epoch_s();
    let mut y = vec![1.0f32; 1024];
    rebuilt.all_reduce(&mut y, Sum).await?;
    let world = rebuilt.world_size();
    anyhow::ensure!(y.iter().all(|&v| v == world as f32), "rank {me}: the allreduce after recovery is wrong");
    println!(
        "{{\"rank\":{me},\"failed_at\":{failed_at:.3},\"recovered_at\":{recovered_at:.3},\"world_after\":{world},\"error\":{:?}}}",
        err.to_string()
    );
    rebuilt.barrier().await?;
    rebuilt.shutdown().await;
    Ok(())
}

// One runtime thread per rank process: where ranks outnumber the cores, a multi-threaded
// runtime's threads compete with the other ranks for them (a 4 KiB allreduce of 64 ranks on 2
// cores took 15-19 ms against 10 ms; see the guide's performance chapter).
#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NEXAR_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scale: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
