//! Processes on separate network namespaces, each host with its own address: the seed and
//! workers forming a mesh (`tests/scripts/netns.sh`), two-level collectives between ranks on
//! two hosts (`tests/scripts/netns_hosts.sh`), and collectives longer than the failure
//! detector's timeouts over a rate-limited link (`tests/scripts/netns_slow_link.sh`). Where the
//! machine cannot create namespaces (not root, no `ip`), or its kernel cannot limit a link's
//! rate (no tbf), a script says so in its output, the test says NOT RUN on stderr and passes
//! without running it; CI runs as root, where all three run.

use std::process::Command;

/// Runs `tests/scripts/<script>` with `args`; it must succeed and print `<label>: passed` (or
/// `<label>: not run` where namespaces cannot be made).
fn run_script(script: &str, args: &[&str], label: &str) {
    let path = format!("{}/tests/scripts/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash").arg(&path).args(args).output().expect("run the script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("{label}: passed")) || stdout.contains(&format!("{label}: not run")), "{stdout}");
    if stdout.contains(&format!("{label}: not run")) {
        eprintln!("NOT RUN: {label} (see the script's output above); CI runs it as root");
    }
}

#[test]
fn seed_and_workers_form_a_mesh_across_network_namespaces() {
    run_script("netns.sh", &[env!("CARGO_BIN_EXE_nexar")], "netns test");
}

/// Four ranks on two namespace hosts (two each) run every two-level collective through
/// nexar-bench, which checks each element: shared memory within a host, TLS between, and the
/// hierarchical algorithm chosen.
#[test]
fn two_level_collectives_run_between_ranks_on_two_network_namespace_hosts() {
    run_script("netns_hosts.sh", &[env!("CARGO_BIN_EXE_nexar"), env!("CARGO_BIN_EXE_nexar-bench")], "netns hosts test");
}

/// Two ranks on two namespace hosts whose links a token-bucket filter holds to 100 Mbit/s: a
/// 64 MiB broadcast and allreduce each take about 5.6 s, longer than twice the ranks' heartbeat
/// timeout and their QUIC idle timeout (2.5 s each), and must finish with every element right
/// and no peer declared dead (heartbeats and keep-alives queue behind the lane's bytes).
#[test]
fn collectives_longer_than_the_failure_timeouts_finish_over_a_slow_link() {
    run_script(
        "netns_slow_link.sh",
        &[env!("CARGO_BIN_EXE_nexar"), env!("CARGO_BIN_EXE_nexar-bench")],
        "slow link test",
    );
}
