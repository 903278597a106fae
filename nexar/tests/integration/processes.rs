//! A seed and worker **processes** (the `nexar` binary) form a mesh over loopback and exchange
//! typed messages; a worker process with a wrong token is refused; a worker process joins the
//! running cluster and the communicator grows; killed workers are detected and survived.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::common::TEST_LIMIT;

const NEXAR: &str = env!("CARGO_BIN_EXE_nexar");

struct Seed {
    child: Child,
    addr: String,
    token: String,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

async fn start_seed(world: usize) -> Seed {
    start_seed_with(world, &[], &["--exit-when-done"]).await
}

async fn start_seed_with(world: usize, env: &[(&str, &str)], args: &[&str]) -> Seed {
    let mut child = Command::new(NEXAR)
        .args(["seed", "--bind", "127.0.0.1:0", "--world-size", &world.to_string()])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the seed");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut addr, mut token) = (None, None);
    while addr.is_none() || token.is_none() {
        let line = lines.next_line().await.unwrap().expect("the seed exited before printing its token");
        if let Some(a) = line.strip_prefix("listening: ") {
            addr = Some(a.to_string());
        }
        if let Some(t) = line.strip_prefix("token: ") {
            token = Some(t.to_string());
        }
    }
    Seed { child, addr: addr.unwrap(), token: token.unwrap(), lines }
}

fn worker(seed: &str, token: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(NEXAR);
    cmd.args(["check", "--seed", seed, "--listen", "127.0.0.1:0"])
        .args(extra)
        .env("NEXAR_TOKEN", token)
        .env("NEXAR_LOG", "warn")
        .kill_on_drop(true);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_and_three_worker_processes_form_a_mesh_and_exchange_messages() {
    tokio::time::timeout(TEST_LIMIT, async {
        let mut seed = start_seed(3).await;

        // A worker process holding a token with the right CA but a wrong secret is refused.
        let mut wrong = seed.token.clone();
        let flip = if wrong.as_bytes()[7] == b'0' { "1" } else { "0" };
        wrong.replace_range(7..8, flip);
        let out = worker(&seed.addr, &wrong, &[]).output().await.unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("refused the join: invalid join token"), "{stderr}");

        let workers: Vec<_> = (0..3)
            .map(|_| {
                let mut cmd = worker(&seed.addr, &seed.token, &["--big-mib", "8"]);
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
                cmd.spawn().expect("spawn a worker")
            })
            .collect();
        let mut ranks_seen = Vec::new();
        for w in workers {
            let out = w.wait_with_output().await.unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "worker failed:\n{stdout}\n{stderr}");
            let passed = stdout.lines().find(|l| l.contains("mesh check passed")).unwrap_or_else(|| panic!("{stdout}"));
            // "rank R/3: mesh check passed (14 messages verified)": 7 cases from each of 2 peers.
            assert!(passed.contains("/3: mesh check passed (14 messages verified)"), "{passed}");
            ranks_seen.push(passed.split('/').next().unwrap().trim_start_matches("rank ").to_string());
        }
        ranks_seen.sort();
        assert_eq!(ranks_seen, ["0", "1", "2"]);

        let mut seed_out = Vec::new();
        while let Some(line) = seed.lines.next_line().await.unwrap() {
            seed_out.push(line);
        }
        let status = tokio::time::timeout(Duration::from_secs(30), seed.child.wait()).await.unwrap().unwrap();
        assert!(status.success());
        assert!(seed_out.iter().any(|l| l == "formed: 3 ranks"), "{seed_out:?}");
        assert!(seed_out.iter().any(|l| l.starts_with("done")), "{seed_out:?}");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmark_runs_every_operation_across_processes_and_checks_results() {
    let dir = std::env::temp_dir().join(format!("nexar-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for op in [
        "allreduce",
        "broadcast",
        "allgather",
        "reduce_scatter",
        "alltoall",
        "reduce",
        "gather",
        "scatter",
        "barrier",
        "sendrecv",
        "pingpong",
        "rpc",
        "plan",
    ] {
        let json = dir.join(format!("{op}.json"));
        let out = tokio::time::timeout(
            TEST_LIMIT,
            Command::new(env!("CARGO_BIN_EXE_nexar-bench"))
                .args(["-b", "1K", "-e", "256K", "-f", "16", "--np", "3", "-n", "3", "-w", "1", "--op", op])
                .arg("--json")
                .arg(&json)
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("benchmark timed out")
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{op}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("#wrong"), "{stdout}");
        // The footer scripts written for nccl-tests look for.
        assert!(stdout.contains("# wrong results       : 0 OK"), "{op}: {stdout}");
        assert!(stdout.contains("# Avg bus bandwidth   : "), "{op}: {stdout}");
        let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(!rows.is_empty(), "{stdout}");
        for row in rows {
            assert_eq!(row.split_whitespace().last(), Some("0"), "{op}: wrong elements in {row}");
        }
        let written = std::fs::read_to_string(&json).unwrap();
        assert!(written.trim_start().starts_with('[') && written.contains("\"wrong\": 0"), "{written}");
    }
    // The same tool with its ranks in one process.
    let out = Command::new(env!("CARGO_BIN_EXE_nexar-bench"))
        .args(["--inproc", "-b", "1K", "-e", "64K", "-f", "8", "--np", "3", "-n", "3", "-w", "1", "--json"])
        .arg(dir.join("inproc.json"))
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("one process"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Times across ranks (-a) and the plot, with the OpenMPI reference series beside it.
    let svg = dir.join("busbw.svg");
    let reference = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/reference/openmpi_tcp_np2_allreduce.json");
    let plot = |with: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_nexar-bench"))
            .args(["-a", "-b", "4K", "-e", "64K", "-f", "4", "--np", "2", "-n", "3", "-w", "1", "--json"])
            .arg(dir.join("plot.json"))
            .arg("--plot")
            .arg(&svg)
            .arg("--plot-with")
            .arg(with)
            .kill_on_drop(true)
            .output()
    };
    let out = tokio::time::timeout(TEST_LIMIT, plot(reference.as_ref())).await.expect("timed out").unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("rank-min(us)") && stdout.contains("rank-max(us)"), "{stdout}");
    let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 3, "4K, 16K, 64K: {stdout}");
    for row in rows {
        let cols: Vec<f64> = row.split_whitespace().map(|c| c.parse().unwrap()).collect();
        let (time, low, avg, high) = (cols[2], cols[6], cols[7], cols[8]);
        assert!(low <= avg && avg <= high && high <= time * 1.000_001 + 0.1, "min <= avg <= max <= slowest: {row}");
    }
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(drawn.starts_with("<svg") && drawn.trim_end().ends_with("</svg>"), "{drawn}");
    assert!(drawn.contains("nexar allreduce f32 np2") && drawn.contains("OpenMPI 4.1 TCP np2"), "{drawn}");
    assert!(drawn.matches("<polyline").count() >= 2, "a line for each series: {drawn}");
    // A reference that is not JSON is named with the reason.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "op size median").unwrap();
    let out = tokio::time::timeout(TEST_LIMIT, plot(&bad)).await.expect("timed out").unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}");
    assert!(format!("{stdout}{stderr}").contains("bad.json: not JSON"), "{stdout}\n{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_process_mid_allreduce_fails_the_others_naming_it() {
    tokio::time::timeout(TEST_LIMIT, async {
        let mut seed = start_seed(3).await;
        let spawn_worker = || {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_nexar-bench"));
            cmd.args(["--worker", "--seed", &seed.addr])
                .env("NEXAR_TOKEN", &seed.token)
                .args(["-b", "4M", "-e", "4M", "--op", "allreduce", "-n", "1000000", "-w", "0", "--json", "/dev/null"])
                .env("NEXAR_IDLE_TIMEOUT_MS", "2000")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .kill_on_drop(true);
            cmd.spawn().expect("spawn a bench worker")
        };
        let mut workers: Vec<_> = (0..3).map(|_| spawn_worker()).collect();
        // Let the cluster form and the allreduce loop run.
        while seed.lines.next_line().await.unwrap().is_some_and(|l| !l.starts_with("formed")) {}
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut victim = workers.remove(1);
        victim.start_kill().unwrap(); // SIGKILL: no goodbye, no close frame
        let killed_at = std::time::Instant::now();
        victim.wait().await.unwrap();
        for w in workers {
            let out = w.wait_with_output().await.unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "a survivor finished an allreduce with a dead member:\n{stderr}");
            assert!(killed_at.elapsed() < Duration::from_secs(30), "survivors took {:?}", killed_at.elapsed());
            // Whichever of its operations notices first (a receive, a send, or an abort from the
            // other survivor), the error says the peer is gone.
            assert!(stderr.contains("is gone") || stderr.contains("aborted") || stderr.contains("lost"), "{stderr}");
            assert!(stderr.contains("rank "), "{stderr}");
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_of_a_killed_worker_detect_it_rebuild_and_carry_on() {
    survive_a_killed_worker("quic", "off").await;
}

/// The same with collective payloads in shared memory (the workers share this host): the
/// rings to the dead rank end with its socket, the survivors' rings carry the rebuilt
/// communicator, and the death is detected as fast as over the network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_of_a_killed_worker_in_shared_memory_detect_it_rebuild_and_carry_on() {
    survive_a_killed_worker("tcp", "on").await;
}

/// The same with collective payloads on TCP lanes: the lanes to the dead rank fail with it,
/// the survivors' lanes carry the rebuilt communicator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_of_a_killed_worker_on_tcp_lanes_detect_it_rebuild_and_carry_on() {
    survive_a_killed_worker("tcp", "off").await;
}

async fn survive_a_killed_worker(bulk_transport: &str, shm: &str) {
    tokio::time::timeout(TEST_LIMIT, async {
        let mut seed = start_seed(4).await;
        let spawn_worker = || {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_nexar-bench"));
            cmd.args(["--worker", "--seed", &seed.addr])
                .env("NEXAR_TOKEN", &seed.token)
                .args(["--op", "soak", "--seconds", "8", "--survive", "-e", "4M", "--mix", "allreduce"])
                .env("NEXAR_HEARTBEAT_TIMEOUT_MS", "2000")
                .env("NEXAR_HEARTBEAT_INTERVAL_MS", "200")
                .env("NEXAR_BULK_TRANSPORT", bulk_transport)
                .env("NEXAR_SHM", shm)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true);
            cmd.spawn().expect("spawn a soak worker")
        };
        let mut workers: Vec<_> = (0..4).map(|_| spawn_worker()).collect();
        while seed.lines.next_line().await.unwrap().is_some_and(|l| !l.starts_with("formed")) {}
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut victim = workers.remove(2);
        victim.start_kill().unwrap(); // SIGKILL: no goodbye, no close frame
        let killed_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
        victim.wait().await.unwrap();
        let mut finished = 0;
        for w in workers {
            let out = w.wait_with_output().await.unwrap();
            let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "a survivor failed:\n{stdout}\n{stderr}");
            println!("survivor (killed at unix ms {killed_ms}):\n{stdout}");
            assert!(stdout.contains("# recovered:") && stdout.contains("of 3;"), "{stdout}\n{stderr}");
            let detected: u128 = stdout
                .lines()
                .find_map(|l| l.split("detected_unix_ms=").nth(1))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no detection time reported:\n{stdout}"));
            // Heartbeat timeout 2 s; the slack is for a loaded machine, far below QUIC's 30 s.
            assert!(
                detected.saturating_sub(killed_ms) < 2000 + 4000,
                "detected {} ms after the kill",
                detected - killed_ms
            );
            finished += usize::from(stdout.contains("# soak done"));
        }
        assert_eq!(finished, 1, "the rebuilt communicator's rank 0 reports the end of the soak");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_joins_the_running_cluster_and_the_communicator_grows() {
    tokio::time::timeout(TEST_LIMIT, async {
        // The seed stays up after the cluster is done: the last joiner below may come after
        // the others have finished and left, and must still hear why it is refused.
        let mut seed = start_seed_with(2, &[("NEXAR_MAX_WORLD_SIZE", "3")], &[]).await;
        let members: Vec<_> = (0..2)
            .map(|_| {
                let mut cmd = worker(&seed.addr, &seed.token, &["--grow", "1"]);
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
                cmd.spawn().expect("spawn a member")
            })
            .collect();
        while seed.lines.next_line().await.unwrap().is_some_and(|l| !l.starts_with("formed")) {}

        // Joining a running cluster still takes the token's secret.
        let mut wrong = seed.token.clone();
        let flip = if wrong.as_bytes()[7] == b'0' { "1" } else { "0" };
        wrong.replace_range(7..8, flip);
        let out = worker(&seed.addr, &wrong, &["--join-running"]).output().await.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("invalid join token"), "{stderr}");

        let mut joiner = worker(&seed.addr, &seed.token, &["--join-running"]);
        let mut joiner = joiner.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut joiner_lines = BufReader::new(joiner.stdout.take().unwrap()).lines();
        let first = joiner_lines.next_line().await.unwrap().unwrap_or_default();
        assert!(first.starts_with("world rank 2: joined"), "{first}");

        // The cluster is now at NEXAR_MAX_WORLD_SIZE: one more is refused.
        let out = worker(&seed.addr, &seed.token, &["--join-running"]).output().await.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("maximum size of 3 ranks"), "{stderr}");

        let mut passed = Vec::new();
        for m in members {
            let out = m.wait_with_output().await.unwrap();
            let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "member failed:\n{stdout}\n{stderr}");
            passed.extend(stdout.lines().filter(|l| l.contains("mesh check passed")).map(str::to_string));
        }
        let mut rest = Vec::new();
        while let Some(l) = joiner_lines.next_line().await.unwrap() {
            rest.push(l);
        }
        let status = joiner.wait().await.unwrap();
        assert!(status.success(), "joiner failed: {rest:?}");
        passed.extend(rest.into_iter().filter(|l| l.contains("mesh check passed")));
        passed.sort();
        // Members checked the 2-rank world and then the grown one; the joiner the grown one.
        assert_eq!(passed.len(), 3, "{passed:?}");
        for (rank, line) in passed.iter().enumerate() {
            assert!(line.starts_with(&format!("rank {rank}/3: mesh check passed")), "{line}");
        }
    })
    .await
    .expect("test timed out");
}
