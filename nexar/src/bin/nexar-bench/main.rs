//! `nexar-bench`: collective benchmarks in the spirit of nccl-tests.
//!
//! ```text
//! nexar-bench -b 4K -e 64M -f 4 --op allreduce --np 2          # ranks as separate processes
//! nexar-bench -b 8 -e 1M --op barrier --np 4 --inproc           # ranks in one process
//! nexar-bench -a --plot busbw.svg --plot-with bench/reference/openmpi_tcp_np2_allreduce.json
//! ```
//!
//! Every size is checked once with known data (`#wrong` counts wrong elements), then timed
//! over `-n` iterations after `-w` warm-ups. Time is the median over iterations of the slowest
//! rank's time, as in the OpenMPI and Gloo baselines.

mod checked;
mod plot;
mod report;
mod simulate;
mod soak;
mod spread;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Instant;

use checked::run_size;
use clap::{Parser, ValueEnum};
use nexar::prelude::*;
use nexar::{CollectiveError, bf16, f16};
use report::report;
use spread::Spread;
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
enum Op {
    Allreduce,
    /// `all_reduce_compressed` with bf16 on the wire (f32 data only); bandwidths count the
    /// f32 bytes, so they compare with `allreduce`'s.
    AllreduceBf16,
    /// The same with f16 on the wire.
    AllreduceF16,
    /// `all_reduce_topk`, sending the `--topk-ratio` share of the elements (f32 data only);
    /// checked with ratio 1 (exact), timed with the ratio; bandwidths count the f32 bytes.
    AllreduceTopk,
    Broadcast,
    Allgather,
    ReduceScatter,
    Alltoall,
    /// Reduce (sum) to rank 0.
    Reduce,
    /// Gather to rank 0.
    Gather,
    /// Scatter from rank 0.
    Scatter,
    Barrier,
    Sendrecv,
    /// Rank 0 sends to rank 1, which sends the message back (ranks past 1 wait); the time is
    /// half the round trip, as OSU's and OpenMPI's ping-pong report it.
    Pingpong,
    /// `#[nexar::rpc]` echo calls from rank 0 to rank 1: latency, and calls/s with 64 in flight.
    Rpc,
    /// The liveness and formation models (`nexar::simulate`) at the world sizes of
    /// `--sim-ranks`, for `--seconds` of simulated time: no ranks are started.
    Simulate,
    /// A fused plan of 100 allreduces of 10,000 f32 against 100 separate allreduces.
    Plan,
    /// Mixed collectives, RPC and point-to-point with random sizes (up to `-e`) for
    /// `--seconds`, every result checked: throughput and resident memory over time.
    Soak,
}

const PLAN_TENSORS: usize = 100;
const PLAN_TENSOR_LEN: usize = 10_000;

const fn plan_statements() -> [nexar::__private::Statement; PLAN_TENSORS] {
    let mut s = [nexar::__private::Statement::Barrier; PLAN_TENSORS];
    let mut i = 0;
    while i < PLAN_TENSORS {
        s[i] = nexar::__private::Statement::AllReduce { buf: i, op: ReduceOp::Sum };
        i += 1;
    }
    s
}

static PLAN_STATEMENTS: [nexar::__private::Statement; PLAN_TENSORS] = plan_statements();
static PLAN: nexar::__private::PlanSpec = nexar::__private::PlanSpec {
    name: "nexar-bench::plan",
    fingerprint: 0x6e65_7861_7270_6c6e,
    statements: &PLAN_STATEMENTS,
    bucket_bytes: nexar::__private::DEFAULT_BUCKET_BYTES,
};
static PLAN_CACHE: nexar::__private::PlanCache = nexar::__private::PlanCache::new();

/// The benchmark's plan over `tensors`, one allreduce statement per tensor.
fn fused(tensors: &mut [Buf<f32>]) -> nexar::__private::PlanRun<'_> {
    let mut run = nexar::__private::PlanRun::new(&PLAN, &PLAN_CACHE);
    for t in tensors.iter_mut() {
        run = run.write(t);
    }
    run
}

async fn run_plan(comm: &NexarClient, args: &Args) -> Result<Vec<Row>, CollectiveError> {
    let r = comm.rank();
    let w = comm.world_size() as f64;
    let mut tensors: Vec<Buf<f32>> =
        (0..PLAN_TENSORS).map(|t| Buf::from_vec(vec![(r + t) as f32; PLAN_TENSOR_LEN])).collect();
    fused(&mut tensors).run(comm).await?;
    let want = |t: usize| (0..comm.world_size()).map(|q| (q + t) as f32).sum::<f32>();
    let wrong =
        tensors.iter().enumerate().map(|(t, b)| b.iter().filter(|v| **v != want(t)).count() as u64).sum::<u64>();
    let mut rows = Vec::new();
    for mode in ["fused plan", "separate calls"] {
        for t in tensors.iter_mut() {
            t.fill(0.0);
        }
        let mut times = Vec::new();
        for i in 0..args.warmup + args.iters.max(1) {
            comm.barrier().await?;
            let start = Instant::now();
            if mode == "fused plan" {
                fused(&mut tensors).run(comm).await?;
            } else {
                for t in tensors.iter_mut() {
                    comm.all_reduce(t, Sum).await?;
                }
            }
            if i >= args.warmup {
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        comm.all_reduce(&mut times, Max).await?;
        let time_us = Spread::of(&times).p50;
        let bytes = PLAN_TENSORS * PLAN_TENSOR_LEN * 4;
        let algbw = bytes as f64 / time_us / 1e3;
        if r == 0 {
            println!("# {mode}: {PLAN_TENSORS} allreduces of {PLAN_TENSOR_LEN} f32 in {time_us:.1} us");
        }
        rows.push(Row {
            bytes,
            count: PLAN_TENSORS,
            time_us,
            algbw,
            busbw: algbw * 2.0 * (w - 1.0) / w,
            wrong,
            iters: times,
            across: None,
            algorithm: "",
        });
    }
    if r == 0 {
        println!("# fused plan speed-up over separate calls: {:.1}x", rows[1].time_us / rows[0].time_us);
    }
    Ok(rows)
}

/// The benchmark's RPC endpoint.
#[nexar::rpc]
fn echo(payload: Vec<u8>) -> Vec<u8> {
    payload
}

/// Calls kept in flight for the RPC throughput figure (fewer for large payloads: at most
/// [`RPC_BYTES_IN_FLIGHT`] of them).
const RPC_IN_FLIGHT: usize = 64;
/// Payload bytes kept in flight for the RPC throughput figure.
const RPC_BYTES_IN_FLIGHT: usize = 64 << 20;
/// Payload bytes the RPC throughput figure sends in all (at least 16 calls).
const RPC_BYTES_TIMED: usize = 1 << 30;

/// Calls in flight and calls in all for the RPC throughput figure of `bytes`-byte payloads.
fn rpc_throughput_calls(bytes: usize, iters: usize) -> (usize, usize) {
    let in_flight = (RPC_BYTES_IN_FLIGHT / bytes.max(1)).clamp(1, RPC_IN_FLIGHT);
    let total = (iters * 100).max(2_000).min((RPC_BYTES_TIMED / bytes.max(1)).max(16));
    (in_flight, total)
}

async fn run_rpc(comm: &NexarClient, args: &Args) -> Result<Vec<Row>, CollectiveError> {
    let fail = |e: nexar::RpcError| CollectiveError::Internal { rank: comm.rank(), op: "rpc", what: e.to_string() };
    let mut rows = Vec::new();
    for bytes in sizes(args) {
        let mut row = Row {
            bytes,
            count: 1,
            time_us: 0.0,
            algbw: 0.0,
            busbw: 0.0,
            wrong: 0,
            iters: Vec::new(),
            across: None,
            algorithm: "",
        };
        if comm.rank() == 0 && comm.world_size() > 1 {
            let payload = vec![7u8; bytes];
            let back = echo::call(comm, 1, payload.clone()).await.map_err(fail)?;
            row.wrong = u64::from(back != payload);
            for _ in 0..args.warmup {
                echo::call(comm, 1, payload.clone()).await.map_err(fail)?;
            }
            let mut times = Vec::with_capacity(args.iters);
            for _ in 0..args.iters.max(1) {
                let start = Instant::now();
                echo::call(comm, 1, payload.clone()).await.map_err(fail)?;
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
            row.time_us = Spread::of(&times).p50;
            row.iters = times;
            let (in_flight, total) = rpc_throughput_calls(bytes, args.iters);
            let start = Instant::now();
            let mut flight: tokio::task::JoinSet<Result<(), nexar::RpcError>> = tokio::task::JoinSet::new();
            for _ in 0..total {
                if flight.len() >= in_flight
                    && let Some(done) = flight.join_next().await
                {
                    done.map_err(|e| {
                        fail(nexar::RpcError::Codec { rank: 0, peer: 1, name: "echo", what: e.to_string() })
                    })?
                    .map_err(fail)?;
                }
                let (c, p) = (comm.clone(), payload.clone());
                flight.spawn(async move { echo::call(&c, 1, p).await.map(|_| ()) });
            }
            while let Some(done) = flight.join_next().await {
                done.map_err(|e| fail(nexar::RpcError::Codec { rank: 0, peer: 1, name: "echo", what: e.to_string() }))?
                    .map_err(fail)?;
            }
            let secs = start.elapsed().as_secs_f64();
            row.count = total;
            row.algbw = (total * bytes) as f64 / secs / 1e9;
            println!(
                "# rpc {bytes} B: {:.0} calls/s with {in_flight} in flight; {:.1} us per call alone",
                total as f64 / secs,
                row.time_us
            );
        }
        comm.barrier().await?;
        rows.push(row);
    }
    Ok(rows)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
enum BindTo {
    Core,
    None,
}

/// Where the benchmark's buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Memory {
    Host,
    /// `Buf<T, Cuda>` on GPU `rank % GPUs` (a build with the feature `cuda`; with `nccl`,
    /// allreduce and broadcast run on NCCL within each host where they can). Allreduce,
    /// broadcast and reduce only.
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Dt {
    F32,
    F64,
    F16,
    Bf16,
    I32,
    I64,
    U8,
}

#[derive(Parser, Clone, Debug)]
#[command(name = "nexar-bench", version, about = "nexar collective benchmarks (nccl-tests style)")]
struct Args {
    /// Smallest message size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long, default_value = "4K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest message size in bytes.
    #[arg(short = 'e', long, default_value = "64M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiply the size by this factor between steps.
    #[arg(short = 'f', long, default_value_t = 4)]
    factor: usize,
    /// The operation.
    #[arg(long, value_enum, default_value = "allreduce")]
    op: Op,
    /// Element type.
    #[arg(short = 'd', long, value_enum, default_value = "f32")]
    dtype: Dt,
    /// Where the buffers live: host memory, or GPU memory (`cuda`).
    #[arg(long, value_enum, default_value = "host")]
    memory: Memory,
    /// Timed iterations per size.
    #[arg(short = 'n', long, default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long, default_value_t = 5)]
    warmup: usize,
    /// Number of ranks.
    #[arg(long, default_value_t = 2)]
    np: usize,
    /// Run the ranks as tasks in this process instead of separate processes.
    #[arg(long)]
    inproc: bool,
    /// Place the rank processes on this many pretended hosts (`NEXAR_HOST_ID` per process,
    /// round-robin), so that the two-level algorithms run on one machine.
    #[arg(long)]
    hosts: Option<usize>,
    /// Per-iteration timing: print p50, p99, the largest iteration and the share of
    /// iterations over 10x the median for each size, and write every iteration to the JSON.
    #[arg(short = 'I', long = "per-iteration")]
    per_iteration: bool,
    /// Across ranks: print the smallest, average and largest of the ranks' own median times
    /// for each size (nccl-tests' `-a`), besides the slowest-rank time.
    #[arg(short = 'a', long = "across-ranks")]
    across_ranks: bool,
    /// Draw bus bandwidth against message size into this SVG file (log scale), one line per
    /// operation and dtype, with the series of every `--plot-with` file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// A JSON file to draw beside this run: an earlier nexar-bench result, or a reference
    /// series (`{"label": ..., "points": [{"bytes": ..., "busbw_gbps": ...}]}`, such as
    /// `bench/reference/openmpi_tcp_np2_allreduce.json`). Repeatable.
    #[arg(long = "plot-with")]
    plot_with: Vec<std::path::PathBuf>,
    /// Bind each rank's runtime thread to a core of its own when the ranks fit the cores
    /// (`core`, the default, as Open MPI's mpirun binds ranks) or leave placement to the
    /// kernel (`none`). The TCP lanes' threads are never bound.
    #[arg(long, value_enum, default_value = "core")]
    bind_to: BindTo,
    /// Where to write the JSON results.
    #[arg(long, default_value = "nexar-bench.json")]
    json: String,
    /// allreduce_topk: the share of elements each call sends.
    #[arg(long, default_value_t = 0.01)]
    topk_ratio: f64,
    /// How long the soak runs, in seconds.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Simulate: the world sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024,4096")]
    sim_ranks: Vec<usize>,
    /// Soak: the operations to mix (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "allreduce,broadcast,allgather,sendrecv,rpc")]
    mix: Vec<soak::SoakOp>,
    /// Soak: when a rank fails, agree, rebuild without it and carry on (reporting detection
    /// and rebuild times) instead of stopping.
    #[arg(long)]
    survive: bool,
    /// Each rank prints, before the run, its host layout and which transport carries its
    /// collective payloads to each peer (`shm`, `tcp-tls`, `quic`, or `relayed` where the
    /// topology gives no direct link), with what a TCP lane says of itself (sealed or
    /// plaintext, its congestion control).
    #[arg(long)]
    links: bool,
    /// (internal) run as a worker of a multi-process benchmark: joins `--seed` with the
    /// token in `NEXAR_TOKEN`, listening on `NEXAR_LISTEN_ADDR` if set (else loopback).
    #[arg(long, hide = true)]
    worker: bool,
    /// (internal) the seed a worker joins.
    #[arg(long, hide = true)]
    seed: Option<SocketAddr>,
}

/// One line per rank: where it sits among the hosts and what carries its payloads to each peer.
fn print_links(comm: &NexarClient) {
    let peers: Vec<String> = (0..comm.world_size())
        .filter(|p| *p != comm.rank())
        // No direct link (a sparse topology): the peer's messages are relayed.
        .map(|p| match comm.bulk_transport_details(p) {
            Some(details) => format!("{p} {} ({details})", comm.bulk_transport(p).unwrap_or("relayed")),
            None => format!("{p} {}", comm.bulk_transport(p).unwrap_or("relayed")),
        })
        .collect();
    let layout = match comm.host_layout() {
        Some(l) => {
            let host = l.host_of(comm.rank());
            format!("host {host} of {} with ranks {:?}", l.hosts(), l.members(host))
        }
        None => "host layout unknown".into(),
    };
    println!("# links of rank {} ({layout}): {}", comm.rank(), peers.join(", "));
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<usize>().map(|n| n * mult).map_err(|_| format!("not a size: {s}"))
}

/// One row of the results table.
#[derive(Clone, Debug)]
struct Row {
    bytes: usize,
    count: usize,
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: u64,
    /// Per-iteration times (the slowest rank's, in order), for `-I`.
    iters: Vec<f64>,
    /// The smallest, average and largest of the ranks' own median times, for `-a` (`None`
    /// where only one rank measures).
    across: Option<[f64; 3]>,
    /// The algorithm that ran, empty where not reported.
    algorithm: &'static str,
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("NEXAR_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // One thread per rank process (what measured fastest); several for in-process ranks.
    let runtime = if args.inproc && !args.worker {
        tokio::runtime::Builder::new_multi_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    };
    let result = match runtime {
        Ok(rt) => rt.block_on(run(args)),
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.op == Op::Simulate {
        return simulate::run(&args);
    }
    if args.op == Op::Pingpong && args.np < 2 && !args.worker {
        return Err("--op pingpong needs two ranks (--np 2 or more)".into());
    }
    if args.worker {
        let seed = args.seed.ok_or("worker needs --seed")?;
        // The token comes through the environment (NEXAR_TOKEN), never the command line, where
        // any user of the host could read it.
        let env = NexarConfig::from_env()?;
        let token = env.token.clone().ok_or("worker needs NEXAR_TOKEN")?;
        // Workers started by this benchmark listen on loopback; one started by hand on another
        // host (or network namespace) says where with NEXAR_LISTEN_ADDR.
        let listen_addr = match std::env::var_os("NEXAR_LISTEN_ADDR") {
            Some(_) => env.listen_addr,
            None => "127.0.0.1:0".parse()?,
        };
        let cfg = env.into_builder().listen_addr(listen_addr).build()?;
        let comm = NexarClient::connect(seed, &token, cfg).await?;
        // The runtime thread (this one: the runtime has one thread) gets a core of its own;
        // the TCP lanes' threads keep every core.
        if args.bind_to == BindTo::Core
            && let Some(cpu) = nexar::affinity::core_for(comm.rank(), comm.world_size())?
        {
            nexar::affinity::bind_thread(cpu)?;
        }
        if args.links {
            print_links(&comm);
        }
        // Workers started by hand know the world only from the seed.
        let args = Args { np: comm.world_size(), ..args };
        if args.op == Op::Soak {
            return Ok(soak::run(comm, args).await?);
        }
        let rows = run_all(&comm, &args).await?;
        let mut peak = [peak_rss_kib()];
        comm.all_reduce(&mut peak, Max).await?;
        if comm.rank() == 0 {
            report(&args, &rows, peak[0])?;
        }
        comm.shutdown().await;
        return Ok(());
    }
    if args.inproc {
        if args.hosts.is_some() {
            return Err("--hosts places rank processes; it does not apply to --inproc".into());
        }
        return inproc(args).await;
    }
    launch(args).await
}

async fn inproc(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let ranks = NexarClient::bootstrap_local(args.np).await?;
    if args.op == Op::Soak {
        let runs: Vec<_> = ranks.into_iter().map(|c| tokio::spawn(soak::run(c, args.clone()))).collect();
        for r in runs {
            r.await??;
        }
        return Ok(());
    }
    let mut tasks = Vec::new();
    for c in ranks {
        let args = args.clone();
        tasks.push(tokio::spawn(async move {
            let rows = run_all(&c, &args).await;
            (c, rows)
        }));
    }
    let mut done = Vec::new();
    for t in tasks {
        let (c, rows) = t.await?;
        let rows = rows?;
        if c.rank() == 0 {
            report(&args, &rows, peak_rss_kib())?;
        }
        done.push(c);
    }
    let closing: Vec<_> = done.into_iter().map(|c| tokio::spawn(async move { c.shutdown().await })).collect();
    for c in closing {
        c.await?;
    }
    Ok(())
}

/// Starts a seed in this process and `np` worker processes of this binary.
async fn launch(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = NexarConfig::from_env()?.into_builder().world_size(args.np).build()?;
    let seed = SeedNode::bind("127.0.0.1:0".parse()?, cfg).await?;
    let me = std::env::current_exe()?;
    let mut children = Vec::new();
    for process in 0..args.np {
        let mut cmd = tokio::process::Command::new(&me);
        cmd.args(std::env::args().skip(1))
            .args(["--worker", "--seed", &seed.local_addr().to_string()])
            .env("NEXAR_TOKEN", seed.token().to_string())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if let Some(hosts) = args.hosts {
            cmd.env("NEXAR_HOST_ID", format!("nexar-bench-host-{}", process % hosts.max(1)));
        }
        children.push(cmd.spawn()?);
    }
    let mut ok = true;
    for mut child in children {
        let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        while let Some(line) = lines.next_line().await? {
            println!("{line}");
        }
        ok &= child.wait().await?.success();
    }
    if !ok {
        return Err("a benchmark process failed".into());
    }
    Ok(())
}

fn sizes(args: &Args) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = args.min_bytes.max(1);
    while s <= args.max_bytes {
        out.push(s);
        s = s.saturating_mul(args.factor.max(2));
    }
    out
}

async fn run_all(comm: &NexarClient, args: &Args) -> Result<Vec<Row>, CollectiveError> {
    if args.op == Op::Rpc {
        return run_rpc(comm, args).await;
    }
    if args.op == Op::Plan {
        return run_plan(comm, args).await;
    }
    let sizes = if args.op == Op::Barrier { vec![0] } else { sizes(args) };
    let mut rows = Vec::new();
    for bytes in sizes {
        if args.memory == Memory::Cuda {
            rows.push(checked::run_size_on_device(comm, args, bytes).await?);
            continue;
        }
        let row = match args.dtype {
            Dt::F32 => run_size::<f32>(comm, args, bytes).await?,
            Dt::F64 => run_size::<f64>(comm, args, bytes).await?,
            Dt::F16 => run_size::<f16>(comm, args, bytes).await?,
            Dt::Bf16 => run_size::<bf16>(comm, args, bytes).await?,
            Dt::I32 => run_size::<i32>(comm, args, bytes).await?,
            Dt::I64 => run_size::<i64>(comm, args, bytes).await?,
            Dt::U8 => run_size::<u8>(comm, args, bytes).await?,
        };
        rows.push(row);
    }
    Ok(rows)
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(|l| l.to_string()))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}
