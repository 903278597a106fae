//! `nexar launch`: start the ranks of a job on this host, like `mpirun -n` or
//! `torchrun --nproc-per-node`.
//!
//! Each rank is the same program, told its rank, the world size, its local rank and where the
//! seed listens through `NEXAR_LAUNCH_*` variables, and the job's secret through `NEXAR_SECRET`
//! (generated here unless the environment has one); `NexarClient::init` reads them. The
//! launcher's rank 0 hosts the seed in its own process.
//!
//! Every rank runs in its own process group. SIGINT and SIGTERM sent to `nexar launch` are passed
//! on to every rank's group; a rank that exits non-zero (or is killed) makes `launch` stop the
//! others at once and exit with that rank's code, naming it. Ranks still running
//! [`GRACE`] after being told to stop are killed.

use std::ffi::OsString;
use std::io::Write;
use std::process::{ExitCode, ExitStatus, Stdio};
use std::time::Duration;

use nexar::cluster::SharedSecret;
use rustix::process::{Pid, Signal, kill_process_group};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;

/// How long ranks have to exit after being told to stop, before they are killed.
const GRACE: Duration = Duration::from_secs(3);

/// `nexar launch` arguments.
#[derive(clap::Args, Debug)]
pub struct LaunchArgs {
    /// Ranks to start on this node.
    #[arg(short = 'n', long = "nproc-per-node", visible_alias = "np", default_value_t = 1)]
    nproc: usize,
    /// Prefix every line a rank prints with `[rank R]`.
    #[arg(long)]
    tag_output: bool,
    /// Nodes in the job (each runs `nexar launch` with the same arguments and its own --node-rank).
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0 to nnodes-1; node 0's first rank hosts the seed.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Where the seed listens, host:port, reachable from every node (needed with --nnodes > 1;
    /// on one node a free local port is chosen).
    #[arg(long)]
    master: Option<String>,
    /// Bind each rank's thread that calls `NexarClient::init` to a core of its own (`core`,
    /// as mpirun does by default, when the node has a CPU per rank) or not (`none`). Sets
    /// `NEXAR_BIND` for the ranks; without this flag an exported `NEXAR_BIND` is kept, else `core`.
    #[arg(long, value_parser = ["core", "none"])]
    bind_to: Option<String>,
    /// What a rank that exits non-zero or dies does to the others: `stop` them (the default,
    /// as mpirun and torchrun do), or let them `continue`, for programs that carry on without
    /// it (`comm.recover()`); `launch` then exits, once every rank has, with the first failed
    /// rank's code.
    #[arg(long, value_parser = ["stop", "continue"], default_value = "stop")]
    on_failure: String,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    program: Vec<OsString>,
}

/// A rank that was started.
struct Started {
    rank: usize,
    pid: u32,
}

/// Runs the job: starts the ranks, passes signals on, and returns the job's exit code.
pub async fn run(args: LaunchArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if args.nproc == 0 || args.nnodes == 0 {
        return Err("-n and --nnodes must be at least 1".into());
    }
    if args.node_rank >= args.nnodes {
        return Err(format!("--node-rank {} must be below --nnodes {}", args.node_rank, args.nnodes).into());
    }
    let secret_set = ["NEXAR_SECRET", "NEXAR_SECRET_FILE"].iter().any(|v| std::env::var_os(v).is_some());
    let seed = match (&args.master, args.nnodes) {
        (Some(master), _) => master.clone(),
        (None, 1) => format!("127.0.0.1:{}", free_udp_port()?),
        (None, _) => return Err("--nnodes > 1 needs --master HOST:PORT, the same on every node".into()),
    };
    if args.nnodes > 1 && !secret_set {
        return Err("--nnodes > 1 needs the same NEXAR_SECRET (or NEXAR_SECRET_FILE) on every node: \
                    export NEXAR_SECRET=<32 hex digits> before `nexar launch` on each"
            .into());
    }
    // One secret per job, unless the environment brings the job's own.
    let generated = (!secret_set).then(|| SharedSecret::generate().0);
    let world = args.nnodes * args.nproc;
    let bind = args.bind_to.clone().or_else(|| std::env::var("NEXAR_BIND").ok()).unwrap_or_else(|| "core".into());

    let mut ranks = Vec::with_capacity(args.nproc);
    let mut waits = JoinSet::new();
    let mut copies = JoinSet::new();
    for local in 0..args.nproc {
        let rank = args.node_rank * args.nproc + local;
        let mut cmd = tokio::process::Command::new(&args.program[0]);
        cmd.args(&args.program[1..])
            .env("NEXAR_LAUNCH_RANK", rank.to_string())
            .env("NEXAR_LAUNCH_WORLD_SIZE", world.to_string())
            .env("NEXAR_LAUNCH_LOCAL_RANK", local.to_string())
            .env("NEXAR_LAUNCH_LOCAL_WORLD_SIZE", args.nproc.to_string())
            .env("NEXAR_LAUNCH_SEED", &seed)
            .env("NEXAR_BIND", &bind)
            // A rank whose parent this is ends with it, even if it is killed with SIGKILL.
            .env(nexar::cluster::launcher::LAUNCH_PID_VAR, std::process::id().to_string())
            // A seed address and token set by hand would take precedence in `init`.
            .env_remove("NEXAR_SEED_ADDR")
            .env_remove("NEXAR_TOKEN")
            .process_group(0)
            .kill_on_drop(true);
        if let Some(secret) = &generated {
            cmd.env("NEXAR_SECRET", secret);
        }
        if args.tag_output {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = cmd.spawn().map_err(|e| {
            stop(&ranks, Signal::KILL);
            format!("cannot start {:?} as rank {rank}: {e}", args.program[0])
        })?;
        let pid = child.id().ok_or("a rank exited before its pid was read")?;
        if let Some(out) = child.stdout.take() {
            copies.spawn(copy_tagged(out, rank, false));
        }
        if let Some(err) = child.stderr.take() {
            copies.spawn(copy_tagged(err, rank, true));
        }
        ranks.push(Started { rank, pid });
        waits.spawn(async move { (rank, pid, child.wait().await) });
    }

    let (mut interrupt, mut terminate) = (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?);
    let mut outcome: Option<ExitCode> = None;
    let kill_timer = tokio::time::sleep(Duration::MAX);
    tokio::pin!(kill_timer);
    let mut killed = false;
    loop {
        tokio::select! {
            done = waits.join_next() => {
                let Some(done) = done else { break };
                let (rank, pid, status) = done?;
                let status = status.map_err(|e| format!("waiting for rank {rank}: {e}"))?;
                if !status.success() && outcome.is_none() {
                    let code = exit_code_of(status);
                    outcome = Some(ExitCode::from(code));
                    if args.on_failure == "continue" {
                        say(&format!("rank {rank} (pid {pid}) {}; the other ranks go on (--on-failure continue)", describe(status)));
                    } else {
                        say(&format!("rank {rank} (pid {pid}) {}; stopping the other ranks", describe(status)));
                        stop(&ranks, Signal::TERM);
                        kill_timer.as_mut().reset(tokio::time::Instant::now() + GRACE);
                    }
                } else if !status.success() && args.on_failure == "continue" {
                    say(&format!("rank {rank} (pid {pid}) {}", describe(status)));
                }
            }
            _ = interrupt.recv(), if outcome.is_none() => {
                say("interrupted; stopping every rank");
                outcome = Some(ExitCode::from(130));
                stop(&ranks, Signal::INT);
                kill_timer.as_mut().reset(tokio::time::Instant::now() + GRACE);
            }
            _ = terminate.recv(), if outcome.is_none() => {
                say("terminated; stopping every rank");
                outcome = Some(ExitCode::from(143));
                stop(&ranks, Signal::TERM);
                kill_timer.as_mut().reset(tokio::time::Instant::now() + GRACE);
            }
            _ = &mut kill_timer, if !killed => {
                say(&format!("ranks still running {GRACE:?} after being told to stop; killing them"));
                stop(&ranks, Signal::KILL);
                killed = true;
            }
        }
    }
    while copies.join_next().await.is_some() {}
    Ok(outcome.unwrap_or(ExitCode::SUCCESS))
}

/// Writes one line to stderr in a single write, so that it is not interleaved with the lines
/// the ranks write to the same stderr at the same moment (`eprintln!` may write in pieces).
pub fn say(message: &str) {
    let line = format!("nexar launch: {message}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Sends `sig` to every rank's process group (a rank's own children included). A group that
/// is gone already is no error.
fn stop(ranks: &[Started], sig: Signal) {
    for r in ranks {
        let Some(pid) = i32::try_from(r.pid).ok().and_then(Pid::from_raw) else { continue };
        if let Err(e) = kill_process_group(pid, sig)
            && e != rustix::io::Errno::SRCH
        {
            say(&format!("could not signal rank {} (pid {}): {e}", r.rank, r.pid));
        }
    }
}

/// The shell's convention: the exit code, or 128 + the signal that killed the process.
fn exit_code_of(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(1).max(1),
        (None, Some(sig)) => u8::try_from((128 + sig) & 0xff).unwrap_or(1),
        (None, None) => 1,
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => "ended".to_string(),
    }
}

/// Copies a rank's output line by line, each prefixed with its rank.
async fn copy_tagged(from: impl AsyncRead + Unpin, rank: usize, stderr: bool) {
    let mut lines = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match lines.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                // One write per line, prefix included, so lines never interleave.
                let mut tagged = format!("[rank {rank}] ").into_bytes();
                tagged.extend_from_slice(&line);
                // A closed stdout (say, `| head`) only stops the copying.
                let written = if stderr {
                    std::io::stderr().lock().write_all(&tagged)
                } else {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&tagged).and_then(|()| out.flush())
                };
                if written.is_err() {
                    return;
                }
            }
        }
    }
}

/// A UDP port free on this host now, for the seed of a one-node job.
fn free_udp_port() -> std::io::Result<u16> {
    Ok(std::net::UdpSocket::bind(("0.0.0.0", 0))?.local_addr()?.port())
}
