//! The program a launcher starts: `nexar launch`, srun, mpirun or torchrun start several copies
//! of it, and each joins the cluster with one call, [`NexarClient::init`], which finds out how
//! it was started. Every rank all-reduces a vector, checks the sum, and prints one line.
//!
//! ```text
//! cargo build --release -p nexar-examples --example launched -p nexar --features nexar/cli
//! target/release/nexar launch -n 4 target/release/examples/launched
//! NEXAR_SECRET=$(openssl rand -hex 16) srun -n 4 target/release/examples/launched
//! NEXAR_SECRET=$(openssl rand -hex 16) NEXAR_SEED_ADDR=127.0.0.1:29400 \
//!     mpirun -n 4 -x NEXAR_SECRET -x NEXAR_SEED_ADDR target/release/examples/launched
//! NEXAR_SECRET=$(openssl rand -hex 16) torchrun --nproc-per-node 4 --no-python target/release/examples/launched
//! ```
//!
//! `LAUNCHED_LEN` sets the vector's length (default 1 Mi elements). To see how a job reports a
//! failed rank: `LAUNCHED_FAIL_RANK=r` makes rank `r` exit with code 3 after joining,
//! `LAUNCHED_QUIT_RANK=r` makes it return an error (dropping its client without `shutdown()`),
//! and `LAUNCHED_PANIC_RANK=r` makes it panic. `LAUNCHED_HOLD_DIR=d` makes every rank write
//! its pid to `d/pid.RANK` once joined and then wait (to see what becomes of ranks whose
//! launcher is killed).

use nexar::prelude::*;

#[tokio::main]
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
            eprintln!("launched: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), NexarError> {
    let len: usize = std::env::var("LAUNCHED_LEN").ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 20);
    // ANCHOR: init
    let comm = NexarClient::init().await?;
    let (me, world) = (comm.rank(), comm.world_size());
    // ANCHOR_END: init
    if std::env::var("LAUNCHED_FAIL_RANK").ok().and_then(|v| v.parse().ok()) == Some(me) {
        eprintln!("rank {me}: failing on purpose (LAUNCHED_FAIL_RANK)");
        std::process::exit(3);
    }
    let rank_var = |var: &str| std::env::var(var).ok().and_then(|v| v.parse::<usize>().ok()) == Some(me);
    if rank_var("LAUNCHED_QUIT_RANK") {
        // Returns an error the way `?` does, dropping the client without `shutdown()`.
        return Err(NexarError::Config(nexar::ConfigError::Missing {
            what: "a reason to go on",
            var: "LAUNCHED_QUIT_RANK",
        }));
    }
    if rank_var("LAUNCHED_PANIC_RANK") {
        panic!("rank {me} panics on purpose (LAUNCHED_PANIC_RANK)");
    }
    if let Ok(dir) = std::env::var("LAUNCHED_HOLD_DIR") {
        let file = std::path::Path::new(&dir).join(format!("pid.{me}"));
        if let Err(e) = std::fs::write(&file, std::process::id().to_string()) {
            eprintln!("rank {me}: cannot write {}: {e}", file.display());
            std::process::exit(4);
        }
        tokio::time::sleep(std::time::Duration::from_secs(600)).await;
    }
    // Rank r contributes r + 1 in every element: the sum is 1 + 2 + … + world.
    // ANCHOR: allreduce
    let mut data: Buf<f64> = Buf::from_vec(vec![(me + 1) as f64; len]);
    let started = std::time::Instant::now();
    if let Err(e) = comm.all_reduce(&mut data, Sum).await {
        eprintln!("rank {me}: all_reduce failed after {} ms: {e}", started.elapsed().as_millis());
        return Err(e.into());
    }
    let took = started.elapsed();
    // ANCHOR_END: allreduce
    let expected = (world * (world + 1) / 2) as f64;
    let wrong = data.iter().filter(|&&x| x != expected).count();
    comm.barrier().await?;
    // ANCHOR: local
    let launcher = comm.launcher().map_or("no launcher".to_string(), |l| l.to_string());
    let local = match (comm.local_rank(), comm.local_world_size()) {
        (Some(r), Some(n)) => format!("local rank {r} of {n}"),
        (Some(r), None) => format!("local rank {r}"),
        _ => "local rank unknown".to_string(),
    };
    // The CPUs this thread (the one that called init) may run on: one under NEXAR_BIND=core.
    let cpus = nexar::affinity::allowed_cpus().map_or_else(|e| e.to_string(), |c| format!("{c:?}"));
    // ANCHOR_END: local
    println!(
        "rank {me} of {world} ({local}, {launcher}): all_reduce of {len} f64 {} in {took:?}; cpus {cpus}",
        if wrong == 0 { format!("= {expected} everywhere: ok") } else { format!("WRONG in {wrong} elements") }
    );
    comm.shutdown().await;
    if wrong != 0 {
        std::process::exit(1);
    }
    Ok(())
}
