//! Starting a job the ways users start them: `nexar launch`, a real `mpirun`, a real `srun`
//! (a one-node SLURM cluster started by `tests/scripts/slurm.sh`), and torchrun's and a
//! Kubernetes JobSet's variables as those launchers set them. Each run starts four processes of
//! `examples/launched`, which join with `NexarClient::init()`, all-reduce and check the sum.
//!
//! Also: the shared secret refused when wrong, missing, or in a world-readable file; a fake
//! seed refused; duplicate ranks and disagreeing world sizes refused by name; a failing rank
//! ending the job with its code; SIGINT leaving no rank behind.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "0123456789abcdef0123456789abcdef";
const RANKS: usize = 4;
/// Generous: these tests share two cores with the rest of the suite.
const PROCESS_LIMIT: Duration = Duration::from_secs(180);

/// `examples/launched`, built by `cargo test --workspace` (examples of every member are built
/// before any test runs).
fn launched() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    let path = profile_dir.join("examples").join("launched");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build -p nexar-examples --example launched` (cargo test --workspace does)",
        path.display()
    );
    path
}

fn nexar() -> &'static str {
    env!("CARGO_BIN_EXE_nexar")
}

fn free_port() -> u16 {
    // The seed listens on UDP; torchrun's own store would hold the port before it (MASTER_PORT).
    loop {
        let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if port < 65000 && std::net::UdpSocket::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

/// A command with a clean environment: only PATH and the variables given, so that a launcher
/// that started the test suite itself (SLURM, mpirun) cannot leak into these jobs.
fn clean(program: impl AsRef<std::ffi::OsStr>, vars: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
    if let Ok(home) = std::env::var("HOME") {
        cmd.env("HOME", home);
    }
    cmd.env("LAUNCHED_LEN", "65536");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// Waits for a process with a limit, killing it past the limit.
fn wait(mut child: std::process::Child, what: &str) -> Output {
    let started = Instant::now();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if started.elapsed() > PROCESS_LIMIT {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!("{what} ran past {PROCESS_LIMIT:?}; stderr:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts one process per rank with the variables of `vars(rank)` and returns their outputs.
fn run_ranks(vars: impl Fn(usize) -> Vec<(&'static str, String)>) -> Vec<Output> {
    let children: Vec<_> =
        (0..RANKS).map(|r| clean(launched(), &vars(r)).spawn().expect("start examples/launched")).collect();
    children.into_iter().enumerate().map(|(r, c)| wait(c, &format!("rank {r}"))).collect()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Every rank printed its line with the launcher's name and a correct sum.
fn assert_formed(outputs: &[Output], launcher: &str) {
    for (r, out) in outputs.iter().enumerate() {
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "rank {r} failed ({}): {stdout}\n{stderr}", out.status);
        let expected = format!("rank {r} of {RANKS} ");
        assert!(stdout.contains(&expected), "rank {r} printed {stdout:?}");
        assert!(stdout.contains(launcher) && stdout.contains("everywhere: ok"), "rank {r} printed {stdout:?}");
    }
}

/// A launcher's output holds one line per rank, `[rank r] ` first when `tagged`:
/// `rank r of 4 (local rank r of 4, <launcher>): … ok`.
fn assert_job_lines(out: &Output, what: &str, tagged: bool, launcher: &str) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}): {stdout}\n{stderr}", out.status);
    for r in 0..RANKS {
        let prefix = if tagged { format!("[rank {r}] ") } else { String::new() };
        let line = stdout.lines().find(|l| l.starts_with(&format!("{prefix}rank {r} of 4 ")));
        let line = line.unwrap_or_else(|| panic!("{what}: no line for rank {r} in {stdout:?}\n{stderr}"));
        assert!(line.contains(&format!("local rank {r} of 4, {launcher}")) && line.contains("ok"), "{line}");
    }
}

/// Loud when a real launcher is missing here, fatal in CI (which installs it).
fn require_tool(tool: &str, installed_by: &str) -> bool {
    let found =
        Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().is_ok_and(|o| o.status.success());
    if !found {
        let msg = format!("THIS TEST DID NOT RUN: `{tool}` is not installed here ({installed_by} installs it)");
        assert!(std::env::var_os("CI").is_none(), "{msg}; CI must run it");
        eprintln!("{msg}");
    }
    found
}

fn torchrun_vars(rank: usize, port: u16) -> Vec<(&'static str, String)> {
    // What torchrun --nproc-per-node 4 --no-python sets for each worker (torch 2.x).
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", RANKS.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", RANKS.to_string()),
        ("GROUP_RANK", "0".into()),
        ("GROUP_WORLD_SIZE", "1".into()),
        ("ROLE_RANK", rank.to_string()),
        ("ROLE_WORLD_SIZE", RANKS.to_string()),
        ("ROLE_NAME", "default".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_RUN_ID", "none".into()),
        ("TORCHELASTIC_RESTART_COUNT", "0".into()),
        ("TORCHELASTIC_MAX_RESTARTS", "0".into()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".into()),
        ("OMP_NUM_THREADS", "1".into()),
        ("NEXAR_SECRET", SECRET.into()),
    ]
}

#[test]
fn nexar_launch_starts_four_ranks_that_form_the_cluster_with_tagged_output() {
    let child = clean(nexar(), &[])
        .args(["launch", "-n", "4", "--tag-output"])
        .arg(launched())
        .spawn()
        .expect("start nexar launch");
    assert_job_lines(&wait(child, "nexar launch"), "nexar launch", true, "nexar launch");
}

/// The `cpus [..]` each rank of a finished job printed, by rank.
fn cpus_by_rank(out: &Output, ranks: usize) -> Vec<String> {
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "the job failed ({}): {stdout}\n{}", out.status, text(&out.stderr));
    (0..ranks)
        .map(|r| {
            let line = stdout.lines().find(|l| l.starts_with(&format!("rank {r} of {ranks} ")));
            let line = line.unwrap_or_else(|| panic!("no line for rank {r} in {stdout:?}"));
            line.rsplit_once("; cpus ").unwrap_or_else(|| panic!("no cpus in {line}")).1.to_string()
        })
        .collect()
}

#[test]
fn nexar_launch_binds_each_rank_to_a_core_of_its_own_unless_told_not_to() {
    let allowed = nexar::affinity::allowed_cpus().expect("read this process's CPUs");
    let whole = format!("{allowed:?}");
    let run = |extra: &[&str]| {
        let child = clean(nexar(), &[])
            .args(["launch", "-n", "2"])
            .args(extra)
            .arg(launched())
            .spawn()
            .expect("start nexar launch");
        cpus_by_rank(&wait(child, "nexar launch"), 2)
    };
    let bound = run(&[]);
    if allowed.len() >= 2 {
        // mpirun's default: local rank i on the i-th CPU this process may use.
        assert_eq!(bound, vec![format!("[{}]", allowed[0]), format!("[{}]", allowed[1])], "default binding");
    } else {
        // Fewer CPUs than ranks: nothing is bound (ranks that share a core must not be).
        assert_eq!(bound, vec![whole.clone(), whole.clone()], "one CPU: no binding");
    }
    assert_eq!(run(&["--bind-to", "none"]), vec![whole.clone(), whole], "--bind-to none");
}

#[test]
fn a_rank_that_exits_3_ends_the_job_with_code_3_naming_it() {
    let started = Instant::now();
    let child = clean(nexar(), &[("LAUNCHED_FAIL_RANK", "2".into())])
        .args(["launch", "-n", "4"])
        .arg(launched())
        .spawn()
        .expect("start nexar launch");
    let out = wait(child, "nexar launch");
    let took = started.elapsed();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(stderr.contains("rank 2 (pid") && stderr.contains("exited with code 3"), "{stderr}");
    // The others are stopped at once, not left to time out; the bound is generous for a busy
    // machine (heartbeat timeout 5 s + 2 s + starting four processes).
    eprintln!("the job ended {took:?} after it started");
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[test]
fn sigint_to_nexar_launch_leaves_no_rank_behind() {
    let dir = std::env::temp_dir().join(format!("nexar-launch-sigint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Each rank records its pid and ignores SIGINT and SIGTERM: only the launcher's SIGKILL
    // after the grace period can end it.
    let script = format!("echo $$ > {}/pid.$NEXAR_LAUNCH_RANK; trap '' INT TERM; exec sleep 300", dir.display());
    let child = clean(nexar(), &[]).args(["launch", "-n", "3", "sh", "-c", &script]).spawn().unwrap();
    let pid_files = |n| (0..3).filter(|r| dir.join(format!("pid.{r}")).exists()).count() == n;
    let started = Instant::now();
    while !pid_files(3) {
        assert!(started.elapsed() < PROCESS_LIMIT, "the ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    let launch_pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(launch_pid, rustix::process::Signal::INT).unwrap();
    let out = wait(child, "nexar launch");
    assert_eq!(out.status.code(), Some(130), "stderr: {}", text(&out.stderr));
    for r in 0..3 {
        let pid = std::fs::read_to_string(dir.join(format!("pid.{r}"))).unwrap();
        let proc_dir = PathBuf::from(format!("/proc/{}", pid.trim()));
        assert!(!proc_dir.exists(), "rank {r} (pid {}) outlived nexar launch", pid.trim());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ranks_end_with_a_nexar_launch_that_is_killed_with_sigkill() {
    let dir = std::env::temp_dir().join(format!("nexar-launch-sigkill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hold = [("LAUNCHED_HOLD_DIR", dir.display().to_string())];
    let child = clean(nexar(), &hold).args(["launch", "-n", "3"]).arg(launched()).spawn().unwrap();
    let started = Instant::now();
    while (0..3).any(|r| !dir.join(format!("pid.{r}")).exists()) {
        assert!(started.elapsed() < PROCESS_LIMIT, "the ranks did not form and hold");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pids: Vec<String> =
        (0..3).map(|r| std::fs::read_to_string(dir.join(format!("pid.{r}"))).unwrap().trim().to_string()).collect();
    // No handler of the launcher's runs: only the kernel can tell the ranks.
    let launch_pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(launch_pid, rustix::process::Signal::KILL).unwrap();
    let out = wait(child, "nexar launch");
    assert_eq!(out.status.code(), None, "killed by a signal");
    let alive =
        |pid: &String| std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "));
    let ended = Instant::now();
    while pids.iter().any(alive) {
        let left: Vec<&String> = pids.iter().filter(|p| alive(p)).collect();
        assert!(ended.elapsed() < PROCESS_LIMIT, "ranks {left:?} outlived their launcher");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn torchrun_variables_form_the_cluster() {
    let port = free_port();
    assert_formed(&run_ranks(|r| torchrun_vars(r, port)), "torchrun");
}

#[test]
fn jobset_variables_form_the_cluster() {
    // What a JobSet (one replicated job of 4 pods, indexed) sets, with the seed at the index-0
    // pod's DNS name: here `localhost`, resolved like a pod name.
    let port = free_port();
    let outputs = run_ranks(|r| {
        vec![
            ("JOB_COMPLETION_INDEX", r.to_string()),
            ("JOBSET_NAME", "train".into()),
            ("REPLICATED_JOB_NAME", "workers".into()),
            ("JOB_INDEX", "0".into()),
            ("REPLICATED_JOB_REPLICAS", "1".into()),
            ("HOSTNAME", format!("train-workers-0-{r}")),
            ("NEXAR_WORLD_SIZE", RANKS.to_string()),
            ("NEXAR_SEED_ADDR", format!("localhost:{port}")),
            ("NEXAR_SECRET", SECRET.into()),
        ]
    });
    assert_formed(&outputs, "jobset");
}

#[test]
fn a_real_mpirun_starts_four_ranks_that_form_the_cluster() {
    if !require_tool("mpirun", ".ci/run (openmpi-bin)") {
        return;
    }
    let port = free_port();
    let vars = [("NEXAR_SECRET", SECRET.to_string()), ("NEXAR_SEED_ADDR", format!("127.0.0.1:{port}"))];
    let child = clean("mpirun", &vars)
        .args(["--allow-run-as-root", "--oversubscribe", "-n", "4", "-x", "NEXAR_SECRET", "-x", "NEXAR_SEED_ADDR"])
        .args(["-x", "LAUNCHED_LEN", "--mca", "btl", "self,tcp"])
        .arg(launched())
        .spawn()
        .expect("start mpirun");
    assert_job_lines(&wait(child, "mpirun"), "mpirun", false, "open mpi");
}

#[test]
fn a_real_srun_on_a_one_node_slurm_cluster_starts_four_ranks_that_form_the_cluster() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/slurm.sh");
    let child = clean("bash", &[("NEXAR_SECRET", SECRET.to_string())]).arg(script).arg(launched()).spawn().unwrap();
    let out = wait(child, "slurm.sh");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    if out.status.code() == Some(77) {
        let msg =
            format!("THIS TEST DID NOT RUN: {}", stdout.lines().chain(stderr.lines()).collect::<Vec<_>>().join(" "));
        assert!(std::env::var_os("CI").is_none(), "{msg}; CI must run it");
        eprintln!("{msg}");
        return;
    }
    assert_job_lines(&out, "srun", false, "slurm");
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides_and_the_others_say_so() {
    let port = free_port();
    let outputs = run_ranks(|r| {
        let mut vars = torchrun_vars(r, port);
        vars.push(("NEXAR_JOIN_TIMEOUT_MS", "8000".into()));
        if r == 3 {
            vars.retain(|(k, _)| *k != "NEXAR_SECRET");
            vars.push(("NEXAR_SECRET", "ffffffffffffffffffffffffffffffff".into()));
        }
        vars
    });
    let wrong = text(&outputs[3].stderr);
    assert!(!outputs[3].status.success());
    assert!(wrong.contains("could not prove it knows this job's secret"), "rank 3: {wrong}");
    for (r, out) in outputs.iter().enumerate().take(3) {
        let err = text(&out.stderr);
        assert!(!out.status.success(), "rank {r} should not have formed a cluster");
        // Rank 0 hosts the seed: it times out first, and the seed's last words tell the others.
        assert!(err.contains("3 of 4 ranks had joined"), "rank {r}: {err}");
        assert!(err.contains("holds a different secret"), "rank {r}: {err}");
        if r > 0 {
            assert!(err.contains("rank 0, which hosts the seed, gave up waiting"), "rank {r}: {err}");
        }
    }
}

/// A seed that closes while workers wait tells each of them who had joined and why it closes,
/// and does not leave before they have it (dropping it would cut them off mid-note).
#[tokio::test]
async fn a_closing_seed_tells_the_waiting_workers_who_joined_and_why() {
    use nexar::{ClusterError, NexarClient, NexarConfig, NexarError, SeedNode};
    let cfg = NexarConfig::builder().world_size(3).join_timeout(Duration::from_secs(120)).build().unwrap();
    let seed = SeedNode::bind("127.0.0.1:0".parse().unwrap(), cfg.clone()).await.unwrap();
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (addr, token, cfg) = (seed.local_addr(), seed.token().to_string(), cfg.clone());
            tokio::spawn(async move { NexarClient::connect(addr, &token, cfg).await.map(|_| ()) })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seed.joined() < 2 {
        assert!(Instant::now() < deadline, "two workers did not join within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    seed.close("the job gave up on its third worker").await;
    drop(seed);
    for worker in workers {
        match worker.await.unwrap() {
            Err(NexarError::Cluster(ClusterError::SeedLost { reason, joined, world, .. })) => {
                assert_eq!((joined, world), (2, 3));
                assert_eq!(reason, "the job gave up on its third worker");
            }
            other => panic!("expected the seed's last words, got {other:?}"),
        }
    }
}

#[test]
fn a_world_readable_secret_file_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let file = std::env::temp_dir().join(format!("nexar-secret-{}", std::process::id()));
    std::fs::write(&file, SECRET).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut vars = torchrun_vars(0, free_port());
    vars.retain(|(k, _)| *k != "NEXAR_SECRET" && *k != "WORLD_SIZE");
    vars.extend([("WORLD_SIZE", "1".to_string()), ("NEXAR_SECRET_FILE", file.display().to_string())]);
    let out = wait(clean(launched(), &vars).spawn().unwrap(), "rank 0");
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("can be read by its group or by others") && err.contains("chmod 600"), "{err}");
    // Readable by its owner only, the same file works.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = wait(clean(launched(), &vars).spawn().unwrap(), "rank 0");
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn no_secret_under_a_launcher_is_refused_with_the_line_to_add() {
    let mut vars = torchrun_vars(0, free_port());
    vars.retain(|(k, _)| *k != "NEXAR_SECRET");
    let out = wait(clean(launched(), &vars).spawn().unwrap(), "rank 0");
    let err = text(&out.stderr);
    assert!(!out.status.success());
    for needle in ["torchrun launch detected", "NEXAR_SECRET", "sbatch", "mpirun -x NEXAR_SECRET", "secretKeyRef"] {
        assert!(err.contains(needle), "missing {needle:?} in: {err}");
    }
}

#[test]
fn a_duplicate_rank_and_a_disagreeing_world_size_are_refused_by_name() {
    let port = free_port();
    // Ranks 0, 1, 1 (a duplicate) and 2 with WORLD_SIZE=5 (a disagreement) in a world of 4.
    let outputs = run_ranks(|r| {
        let mut vars = torchrun_vars(r, port);
        vars.push(("NEXAR_JOIN_TIMEOUT_MS", "6000".into()));
        match r {
            2 => vars.push(("RANK", "1".into())),
            3 => vars.extend([("RANK", "2".into()), ("WORLD_SIZE", "5".into())]),
            _ => {}
        }
        vars
    });
    let all: String = outputs.iter().map(|o| text(&o.stderr)).collect();
    assert!(outputs.iter().all(|o| !o.status.success()), "no cluster can form: {all}");
    assert!(all.contains("rank 1 is taken twice") && all.contains("read RANK=1"), "{all}");
    assert!(all.contains("read WORLD_SIZE=5, but the cluster forms with 4 ranks"), "{all}");
    // Both sides: what the seed (on rank 0) read too.
    assert!(all.contains("the seed read WORLD_SIZE=4 on rank 0"), "{all}");
}

/// A seed that does not know the job's secret cannot get a worker to trust it, and learns no
/// proof from it; a seed started with a token refuses secret joins, saying how to join it.
#[tokio::test]
async fn a_fake_seed_is_refused_and_a_token_seed_says_how_to_join() {
    use nexar::cluster::{MismatchSide, SharedSecret};
    use nexar::{ClusterError, NexarClient, NexarConfig, NexarError, SeedNode};
    let cfg = NexarConfig::builder().world_size(2).build().unwrap();
    let real = SharedSecret::new(SECRET).unwrap();
    let other = SharedSecret::new("a different secret of the same length").unwrap();
    let fake = SeedNode::bind_with_secret("127.0.0.1:0".parse().unwrap(), cfg.clone(), other).await.unwrap();
    let err = NexarClient::connect_with_secret(fake.local_addr(), &real, cfg.clone()).await.unwrap_err();
    match &err {
        NexarError::Cluster(ClusterError::SecretMismatch { side: MismatchSide::Seed, .. }) => {}
        other => panic!("expected the worker to refuse the seed, got {other:?}"),
    }
    assert!(err.to_string().contains("sent nothing secret"), "{err}");

    let token_seed = SeedNode::bind("127.0.0.1:0".parse().unwrap(), cfg.clone()).await.unwrap();
    let err = NexarClient::connect_with_secret(token_seed.local_addr(), &real, cfg).await.unwrap_err();
    assert!(err.to_string().contains("started with a join token"), "{err}");
}

/// A rank that ends without `shutdown()` (an error returned with `?`, or a panic) tells its
/// peers at once: their pending all-reduce fails naming it and why, long before the heartbeat
/// timeout (set to 60 s here, so that only the prompt notice can explain a prompt failure).
fn a_rank_that_ends_early_fails_its_peers_at_once(var: &'static str) {
    let port = free_port();
    let outputs = run_ranks(|r| {
        let mut vars = torchrun_vars(r, port);
        vars.extend([(var, "1".to_string()), ("NEXAR_HEARTBEAT_TIMEOUT_MS", "60000".into())]);
        vars
    });
    assert!(!outputs[1].status.success());
    for r in [0, 2, 3] {
        let err = text(&outputs[r].stderr);
        assert!(!outputs[r].status.success(), "rank {r} should have failed: {err}");
        let line = err.lines().find(|l| l.starts_with(&format!("rank {r}: all_reduce failed after ")));
        let line = line.unwrap_or_else(|| panic!("rank {r} did not report its failed all_reduce: {err}"));
        assert!(line.contains("rank 1") && line.contains("without calling shutdown()"), "rank {r}: {line}");
        // Far below the 60 s heartbeat timeout (the issue asks for 1 s; the bound here is
        // generous for a busy machine, and the figure is printed).
        let ms: u64 = line["rank 0: all_reduce failed after ".len()..].split(' ').next().unwrap().parse().unwrap();
        eprintln!("rank {r}'s all_reduce failed {ms} ms after it started");
        assert!(ms < 30_000, "{line}");
    }
}

#[test]
fn a_rank_that_returns_an_error_without_shutdown_fails_its_peers_at_once() {
    a_rank_that_ends_early_fails_its_peers_at_once("LAUNCHED_QUIT_RANK");
}

#[test]
fn a_rank_that_panics_fails_its_peers_at_once() {
    a_rank_that_ends_early_fails_its_peers_at_once("LAUNCHED_PANIC_RANK");
}
