//! `--op simulate`: the liveness and formation models (`nexar::simulate`) at the world sizes
//! of `--sim-ranks`, printed as tables: steady liveness traffic, a kill's detection, ranks
//! that stall under load, and formation for a full mesh and the sparse topologies.

use std::time::{Duration, Instant};

use nexar::Topology;
use nexar::simulate::{FormationScenario, LivenessScenario, simulate_formation, simulate_liveness};

use super::Args;

fn secs(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), |d| format!("{:.2}", d.as_secs_f64()))
}

/// Prints the tables.
pub(super) fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let run_for = Duration::from_secs(args.seconds);
    println!(
        "# liveness: {} s simulated, heartbeat 1 s, timeout 5 s (the defaults); a rank killed at half time",
        args.seconds
    );
    println!("# stalls: each rank stops 2 times a minute for up to 3 s (a busy host)");
    println!(
        "{:>6} {:>10} {:>12} {:>10} {:>10} {:>10} {:>12} {:>12} {:>10}",
        "ranks", "msgs/s/rk", "after kill", "first (s)", "all (s)", "false", "stalled sus", "stalled dead", "model (s)"
    );
    for &n in &args.sim_ranks {
        let started = Instant::now();
        let mut kill = LivenessScenario::new(n);
        kill.run_for = run_for;
        kill.kill = Some((n / 3, run_for / 2));
        let killed = simulate_liveness(&kill);
        let mut busy = LivenessScenario::new(n);
        busy.run_for = run_for;
        busy.stalls_per_minute = 2.0;
        busy.longest_stall = Duration::from_secs(3);
        let stalled = simulate_liveness(&busy);
        println!(
            "{:>6} {:>10.2} {:>12.2} {:>10} {:>10} {:>10} {:>12} {:>12} {:>10.1}",
            n,
            killed.messages_per_rank_per_s,
            killed.messages_per_rank_per_s_after_kill.unwrap_or(0.0),
            secs(killed.first_detection),
            secs(killed.all_detected),
            killed.false_deaths,
            stalled.suspicions,
            stalled.false_deaths,
            started.elapsed().as_secs_f64(),
        );
    }
    println!();
    println!("# formation: 64 ranks and 64 cores a host, 2 ms a join at the seed (4 cores), 3.8 ms a connection end");
    println!(
        "{:>6} {:>12} {:>10} {:>10} {:>12} {:>10} {:>12}",
        "ranks", "topology", "links/rk", "seed (s)", "formed (s)", "links", "seed bytes"
    );
    for &n in &args.sim_ranks {
        for topology in [Topology::FullMesh, Topology::Hypercube, Topology::KRegular(8)] {
            let mut s = FormationScenario::new(n, 64);
            s.topology = topology;
            let out = simulate_formation(&s);
            let name = match topology {
                Topology::FullMesh => "full_mesh".to_string(),
                Topology::Hypercube => "hypercube".to_string(),
                Topology::KRegular(k) => format!("k_regular:{k}"),
            };
            println!(
                "{:>6} {:>12} {:>10} {:>10.2} {:>12.2} {:>10} {:>12}",
                n,
                name,
                out.most_links_per_rank,
                out.seed_done.as_secs_f64(),
                out.formed.as_secs_f64(),
                out.links,
                out.seed_bytes
            );
        }
    }
    Ok(())
}
