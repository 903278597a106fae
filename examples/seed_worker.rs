//! A seed node and workers as separate processes.
//!
//! Run everything at once (this program starts the seed and three workers as child processes
//! of itself, on 127.0.0.1):
//!
//! ```text
//! cargo run --example seed_worker
//! ```
//!
//! Or one process per terminal (or per host):
//!
//! ```text
//! cargo run --release --example seed_worker -- seed --bind 0.0.0.0:7000 --world-size 3
//! NEXAR_TOKEN=nexar1.… cargo run --release --example seed_worker -- worker --seed 10.0.0.1:7000
//! ```

use std::net::SocketAddr;
use std::process::Stdio;

use clap::{Parser, Subcommand};
use nexar::prelude::*;
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Subcommand)]
enum Role {
    /// Run the seed: print the join token and wait until the workers have come and gone.
    Seed {
        #[arg(long, default_value = "0.0.0.0:7000")]
        bind: SocketAddr,
        #[arg(long, default_value_t = 3)]
        world_size: usize,
    },
    /// Join through the seed and run the job.
    Worker {
        #[arg(long)]
        seed: SocketAddr,
        /// The join token (or NEXAR_TOKEN; the demo passes it that way, so that it never
        /// shows in a process list).
        #[arg(long, env = "NEXAR_TOKEN", hide_env_values = true)]
        token: String,
        #[arg(long, default_value = "0.0.0.0:0")]
        listen: SocketAddr,
    },
    /// Start a seed and `workers` worker processes on 127.0.0.1 (the default).
    Demo {
        #[arg(long, default_value_t = 3)]
        workers: usize,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("NEXAR_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().role.unwrap_or(Role::Demo { workers: 3 }) {
        Role::Seed { bind, world_size } => {
            // ANCHOR: seed
            let mut cfg = NexarConfig::from_env()?;
            cfg.world_size = Some(world_size);
            let seed = SeedNode::bind(bind, cfg).await?;
            println!("seed listening on {}", seed.local_addr());
            println!("token {}", seed.token());
            seed.wait_done().await?;
            // ANCHOR_END: seed
            println!("seed: all {world_size} workers came and went");
        }
        Role::Worker { seed, token, listen } => {
            // ANCHOR: worker
            let mut cfg = NexarConfig::from_env()?;
            cfg.listen_addr = listen;
            let comm = NexarClient::connect(seed, &token, cfg).await?;
            run_job(&comm).await?;
            comm.shutdown().await;
            // ANCHOR_END: worker
        }
        Role::Demo { workers } => demo(workers).await?,
    }
    Ok(())
}

/// The job each worker runs: send its rank to the next rank, receive from the previous one.
async fn run_job(comm: &NexarClient) -> anyhow::Result<()> {
    let (me, world) = (comm.rank(), comm.world_size());
    // ANCHOR: job
    let hello: Vec<u64> = vec![me as u64; 1024];
    let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
    let mut got = vec![0u64; 1024];
    let (s, r) = tokio::join!(comm.send(&hello, next, 1), comm.recv(&mut got, prev, 1));
    s?;
    r?;
    // ANCHOR_END: job
    anyhow::ensure!(got.iter().all(|v| *v == prev as u64), "rank {me}: corrupted message from rank {prev}");
    println!("worker rank {me}/{world}: got rank {prev}'s message; rtt to rank {next}: {:?}", comm.ping(next).await?);
    Ok(())
}

async fn demo(workers: usize) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let mut seed = tokio::process::Command::new(&me)
        .args(["seed", "--bind", "127.0.0.1:0", "--world-size", &workers.to_string()])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(seed.stdout.take().expect("piped")).lines();
    let (mut addr, mut token) = (None, None);
    while addr.is_none() || token.is_none() {
        let line = lines.next_line().await?.ok_or_else(|| anyhow::anyhow!("the seed exited early"))?;
        println!("{line}");
        if let Some(a) = line.strip_prefix("seed listening on ") {
            addr = Some(a.to_string());
        }
        if let Some(t) = line.strip_prefix("token ") {
            token = Some(t.to_string());
        }
    }
    let (addr, token) = (addr.expect("read above"), token.expect("read above"));
    let mut children = Vec::new();
    for _ in 0..workers {
        children.push(
            tokio::process::Command::new(&me)
                .args(["worker", "--seed", &addr, "--listen", "127.0.0.1:0"])
                .env("NEXAR_TOKEN", &token)
                .kill_on_drop(true)
                .spawn()?,
        );
    }
    for mut c in children {
        anyhow::ensure!(c.wait().await?.success(), "a worker process failed");
    }
    while let Some(line) = lines.next_line().await? {
        println!("{line}");
    }
    anyhow::ensure!(seed.wait().await?.success(), "the seed process failed");
    Ok(())
}
