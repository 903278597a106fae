//! The `nexar` command: launch a job's ranks, run a seed node, or join a cluster as a worker
//! and check the mesh.
//!
//! ```text
//! nexar launch -n 4 --tag-output ./my-program args…
//! nexar seed --bind 0.0.0.0:7000 --world-size 4
//! nexar check --seed 10.0.0.1:7000 --token nexar1.…
//! ```

mod launch;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use nexar::{DType, NexarClient, NexarConfig, SeedNode, bf16};

#[derive(Parser)]
#[command(name = "nexar", version, about = "nexar cluster tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the ranks of a job on this host, like `mpirun -n` or `torchrun --nproc-per-node`:
    /// each runs the program, which joins with `NexarClient::init()`.
    Launch(launch::LaunchArgs),
    /// Run a seed node: print the join token, admit workers, publish the peer table.
    Seed {
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:7000")]
        bind: SocketAddr,
        /// Number of workers that make the cluster (or NEXAR_WORLD_SIZE).
        #[arg(long)]
        world_size: Option<usize>,
        /// Exit once the cluster has formed and every worker has left.
        #[arg(long)]
        exit_when_done: bool,
    },
    /// Join a cluster and check the mesh: every rank exchanges typed messages of several
    /// dtypes and sizes with every other rank, verifies every element, and pings each peer.
    Check {
        /// The seed's address (or NEXAR_SEED_ADDR).
        #[arg(long)]
        seed: Option<SocketAddr>,
        /// The join token the seed printed (prefer NEXAR_TOKEN: a command line shows in every
        /// user's process list).
        #[arg(long, env = "NEXAR_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Address to listen on for peers (or NEXAR_LISTEN_ADDR).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Also exchange one message of this many MiB with every peer.
        #[arg(long, default_value_t = 0)]
        big_mib: usize,
        /// After the check, wait for this many more workers to join the running cluster,
        /// grow the communicator by them, and check it again.
        #[arg(long, default_value_t = 0)]
        grow: usize,
        /// This worker joins a cluster that is already running: wait to be admitted by the
        /// members' `--grow`, then check the grown communicator.
        #[arg(long)]
        join_running: bool,
    },
    /// Read the flight-recorder dumps in a directory (NEXAR_TRACE_DIR) and print, per
    /// communicator, the first collective where the ranks disagree or stop, and per operation
    /// the durations and the rank that arrived last most often.
    Trace {
        /// The directory holding `nexar-trace-*.json`.
        dir: std::path::PathBuf,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NEXAR_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let command = match Cli::parse().command {
        Command::Launch(args) => {
            return match launch::run(args).await {
                Ok(code) => code,
                Err(e) => {
                    launch::say(&e.to_string());
                    ExitCode::FAILURE
                }
            };
        }
        other => other,
    };
    match run(command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The commands other than `launch`, which needs no configuration of its own.
async fn run(command: Command) -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = NexarConfig::from_env()?;
    match command {
        Command::Launch(_) => Err("`nexar launch` is run by main".into()),
        Command::Trace { dir } => {
            let dumps = nexar::trace::TraceDump::read_dir(&dir)?;
            if dumps.is_empty() {
                return Err(format!("{}: no nexar-trace-*.json dumps here", dir.display()).into());
            }
            for analysis in nexar::trace::analyse(&dumps) {
                print!("{analysis}");
            }
            Ok(())
        }
        Command::Seed { bind, world_size, exit_when_done } => {
            let source = match world_size {
                Some(n) => format!("--world-size {n}"),
                None => format!("NEXAR_WORLD_SIZE={}", cfg.world_size.map_or("?".to_string(), |n| n.to_string())),
            };
            if world_size.is_some() {
                cfg.world_size = world_size;
            }
            let seed = SeedNode::bind(bind, cfg).await?;
            seed.describe_world_size(source);
            println!("listening: {}", seed.local_addr());
            println!("token: {}", seed.token());
            println!("workers join with: NEXAR_TOKEN={} nexar check --seed {}", seed.token(), seed.local_addr());
            let table = tokio::select! {
                table = seed.wait_formed() => table?,
                _ = tokio::signal::ctrl_c() => {
                    // The waiting workers hear who had joined, and why they will not form.
                    seed.close("the seed was stopped (Ctrl-C) before the cluster formed").await;
                    return Err("stopped before the cluster formed".into());
                }
            };
            println!("formed: {} ranks", table.len());
            for (rank, addr) in table.iter().enumerate() {
                println!("  rank {rank}: {addr}");
            }
            if exit_when_done {
                seed.wait_done().await?;
                println!("done: every worker has left");
            } else {
                tokio::signal::ctrl_c().await?;
            }
            Ok(())
        }
        Command::Check { seed, token, listen, big_mib, grow, join_running } => {
            if let Some(l) = listen {
                cfg.listen_addr = l;
            }
            let seed = seed.or(cfg.seed_addr).ok_or("give --seed or set NEXAR_SEED_ADDR")?;
            let token = token.or(cfg.token.clone()).ok_or("give --token or set NEXAR_TOKEN")?;
            let start = Instant::now();
            let joined = NexarClient::connect(seed, &token, cfg).await?;
            println!(
                "world rank {}: joined in {:?}, listening on {:?}",
                joined.world_rank(),
                start.elapsed(),
                joined.local_addr()
            );
            let mut client = if join_running { joined.admitted().await? } else { joined };
            let mut checked = check_mesh(&client, big_mib).await?;
            if grow > 0 {
                client = client.rebuild_adding(grow).await?;
                checked += check_mesh(&client, big_mib).await?;
            }
            let (rank, world) = (client.rank(), client.world_size());
            let mut sum = [rank as u64];
            client.all_reduce(&mut sum, nexar::Sum).await?;
            if sum[0] != (world * (world - 1) / 2) as u64 {
                return Err(format!("rank {rank}/{world}: allreduce gave {}", sum[0]).into());
            }
            for peer in (0..world).filter(|p| *p != rank) {
                let rtt = client.ping(peer).await?;
                println!("rank {rank}/{world}: ping rank {peer}: {rtt:?}");
            }
            client.shutdown().await;
            println!("rank {rank}/{world}: mesh check passed ({checked} messages verified)");
            Ok(())
        }
    }
}

/// A deterministic value for element `i` of the message from `src` to `dst` in case `case`.
fn pattern(src: usize, dst: usize, case: usize, i: usize) -> u64 {
    (src as u64 * 1_000_003) ^ (dst as u64 * 7919) ^ (case as u64 * 104_729) ^ (i as u64).wrapping_mul(2_654_435_761)
}

async fn check_mesh(client: &NexarClient, big_mib: usize) -> Result<usize, Box<dyn std::error::Error>> {
    let (me, world) = (client.rank(), client.world_size());
    let mut cases: Vec<(DType, usize)> = vec![
        (DType::F32, 0),
        (DType::U8, 1),
        (DType::F64, 1000),
        (DType::I16, 4097),
        (DType::BF16, 12345),
        (DType::U64, 1 << 17),
    ];
    if big_mib > 0 {
        cases.push((DType::F32, big_mib << 18));
    }
    let mut verified = 0;
    for peer in (0..world).filter(|p| *p != me) {
        let sends = async {
            for (case, (dtype, len)) in cases.iter().enumerate() {
                send_case(client, *dtype, *len, me, peer, case).await?;
            }
            Ok::<_, Box<dyn std::error::Error>>(())
        };
        // Receive in reverse order: every message waits for its own tag.
        let recvs = async {
            for (case, (dtype, len)) in cases.iter().enumerate().rev() {
                recv_case(client, *dtype, *len, peer, me, case).await?;
            }
            Ok::<_, Box<dyn std::error::Error>>(())
        };
        let (s, r) = tokio::join!(sends, recvs);
        s?;
        r?;
        verified += cases.len();
    }
    Ok(verified)
}

async fn send_case(
    c: &NexarClient,
    dtype: DType,
    len: usize,
    src: usize,
    dst: usize,
    case: usize,
) -> Result<(), nexar::P2pError> {
    let tag = case as u64;
    let p = |i| pattern(src, dst, case, i);
    match dtype {
        DType::F32 => c.send(&(0..len).map(|i| (p(i) % 1_000_000) as f32).collect::<Vec<_>>(), dst, tag).await,
        DType::F64 => c.send(&(0..len).map(|i| p(i) as f64).collect::<Vec<_>>(), dst, tag).await,
        DType::U8 => c.send(&(0..len).map(|i| p(i) as u8).collect::<Vec<_>>(), dst, tag).await,
        DType::I16 => c.send(&(0..len).map(|i| p(i) as i16).collect::<Vec<_>>(), dst, tag).await,
        DType::BF16 => c.send(&(0..len).map(|i| bf16::from_bits(p(i) as u16)).collect::<Vec<_>>(), dst, tag).await,
        _ => c.send(&(0..len).map(p).collect::<Vec<_>>(), dst, tag).await,
    }
}

async fn recv_case(
    c: &NexarClient,
    dtype: DType,
    len: usize,
    src: usize,
    dst: usize,
    case: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let tag = case as u64;
    let p = |i| pattern(src, dst, case, i);
    let ok = match dtype {
        DType::F32 => {
            let mut b = vec![0f32; len];
            c.recv(&mut b, src, tag).await?;
            b.iter().enumerate().all(|(i, v)| *v == (p(i) % 1_000_000) as f32)
        }
        DType::F64 => {
            let mut b = vec![0f64; len];
            c.recv(&mut b, src, tag).await?;
            b.iter().enumerate().all(|(i, v)| *v == p(i) as f64)
        }
        DType::U8 => {
            let mut b = vec![0u8; len];
            c.recv(&mut b, src, tag).await?;
            b.iter().enumerate().all(|(i, v)| *v == p(i) as u8)
        }
        DType::I16 => {
            let mut b = vec![0i16; len];
            c.recv(&mut b, src, tag).await?;
            b.iter().enumerate().all(|(i, v)| *v == p(i) as i16)
        }
        DType::BF16 => {
            let mut b = vec![bf16::ZERO; len];
            c.recv(&mut b, src, tag).await?;
            b.iter().enumerate().all(|(i, v)| v.to_bits() == p(i) as u16)
        }
        _ => {
            let mut b = vec![0u64; len];
            c.recv(&mut b, src, tag).await?;
            b.iter().enumerate().all(|(i, v)| *v == p(i))
        }
    };
    if !ok {
        return Err(format!(
            "rank {dst}: the {dtype} message of {len} elements from rank {src} (tag {tag}) arrived corrupted"
        )
        .into());
    }
    Ok(())
}
