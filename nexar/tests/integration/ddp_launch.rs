//! `examples/ddp_candle` (candle MLP, `nexar_candle::Ddp`) as a user runs it: under `nexar
//! launch -n 2` and `-n 4`, with the plain, bf16 and PowerSGD hooks. Every run must reach its
//! target accuracy with identical weights on every rank (the example checks both and fails
//! otherwise), and PowerSGD must end within 2 points of the uncompressed accuracy. Then
//! `examples/ddp_burn` (burn MLP, `nexar_burn::Ddp`) under `-n 2` and `-n 4`, plain.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// Generous: these runs share two cores with the rest of the suite.
const RUN_LIMIT: Duration = Duration::from_secs(300);

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    let path = profile_dir.join("examples").join(name);
    assert!(path.exists(), "{} is missing: `cargo test --workspace` builds it", path.display());
    path
}

/// Runs `examples/ddp_candle` under `nexar launch -n ranks` with `DDP_HOOK=hook`; returns the
/// final test accuracy in percent.
fn launch(ranks: usize, hook: &str) -> f64 {
    let started = Instant::now();
    let accuracy = launch_example("ddp_candle", ranks, hook);
    assert!(started.elapsed() < RUN_LIMIT, "{ranks} ranks, {hook}: {:?}", started.elapsed());
    accuracy
}

/// Runs example `name` under `nexar launch -n ranks` with `DDP_HOOK=hook`; returns the final
/// test accuracy in percent from its summary line (`name: N ranks, … test accuracy A %, weights
/// identical on every rank`).
fn launch_example(name: &str, ranks: usize, hook: &str) -> f64 {
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_nexar"))
        .args(["launch", "-n", &ranks.to_string()])
        .arg(example(name))
        .env("DDP_HOOK", hook)
        .env_remove("NEXAR_SEED_ADDR")
        .output()
        .expect("start nexar launch");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}, {ranks} ranks, {hook}: {}\n{stdout}\n{stderr}", out.status);
    let summary = format!("{name}:");
    let last = stdout.lines().rev().find(|l| l.starts_with(&summary)).expect("the summary line");
    assert!(last.contains(&format!("{ranks} ranks")) && last.contains("weights identical on every rank"), "{last}");
    let accuracy: f64 = last
        .split("test accuracy ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {last}"));
    println!("{name}, {ranks} ranks, {hook}: {accuracy} % in {:?}", started.elapsed());
    accuracy
}

#[test]
fn the_candle_example_trains_under_nexar_launch_with_2_and_4_ranks() {
    assert!(launch(2, "plain") > 95.0);
    assert!(launch(4, "plain") > 95.0);
}

#[test]
fn powersgd_and_bf16_end_within_2_points_of_the_uncompressed_accuracy() {
    let plain = launch(2, "plain");
    let powersgd = launch(2, "powersgd");
    let bf16 = launch(2, "bf16");
    assert!(powersgd > plain - 2.0, "PowerSGD {powersgd} % against {plain} %");
    assert!(bf16 > plain - 2.0, "bf16 {bf16} % against {plain} %");
}

#[test]
fn the_burn_example_trains_under_nexar_launch_with_2_and_4_ranks() {
    assert!(launch_example("ddp_burn", 2, "plain") > 95.0);
    assert!(launch_example("ddp_burn", 4, "plain") > 95.0);
}
