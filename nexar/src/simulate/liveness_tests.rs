use super::*;

fn scenario(ranks: usize, secs: u64) -> LivenessScenario {
    let mut s = LivenessScenario::new(ranks);
    s.run_for = Duration::from_secs(secs);
    s
}

#[test]
fn steady_traffic_per_rank_is_the_same_at_16_and_512_ranks() {
    let small = simulate_liveness(&scenario(16, 20));
    let large = simulate_liveness(&scenario(512, 20));
    for out in [&small, &large] {
        assert_eq!(out.false_deaths, 0, "{out:?}");
        assert_eq!(out.suspicions, 0, "{out:?}");
        // Three heartbeats a second (one to each watcher), give or take the first tick.
        assert!((2.8..=3.1).contains(&out.messages_per_rank_per_s), "{out:?}");
    }
    assert!((small.messages_per_rank_per_s - large.messages_per_rank_per_s).abs() < 0.1);
}

#[test]
fn a_killed_rank_is_declared_within_the_timeout_and_a_second_and_by_everyone_soon_after() {
    let mut s = scenario(256, 30);
    s.kill = Some((100, Duration::from_secs(10)));
    let out = simulate_liveness(&s);
    assert_eq!(out.false_deaths, 0, "{out:?}");
    let first = out.first_detection.expect("someone declared the killed rank");
    assert!(first <= s.heartbeat_timeout + Duration::from_secs(1), "{out:?}");
    assert!(first >= s.heartbeat_timeout / 2, "declared before any silence could count: {out:?}");
    let all = out.all_detected.expect("every rank declared the killed rank");
    assert!(all <= first + Duration::from_secs(3), "{out:?}");
    // The death costs each rank a few messages (a report from each watcher, a ping and
    // probes of its own, the answers), not one from every rank.
    let after = out.messages_per_rank_per_s_after_kill.unwrap();
    assert!(after < out.messages_per_rank_per_s + 2.0, "{out:?}");
}

/// `ranks` ranks for `secs`, each stalling `per_minute` times a minute for up to `longest`.
fn stalling(ranks: usize, secs: u64, per_minute: f64, longest: Duration) -> LivenessScenario {
    let mut s = scenario(ranks, secs);
    s.stalls_per_minute = per_minute;
    s.longest_stall = longest;
    s
}

#[test]
fn ranks_stalled_for_up_to_three_seconds_are_never_declared_dead() {
    let out = simulate_liveness(&stalling(128, 120, 2.0, Duration::from_secs(3)));
    assert!(out.suspicions > 0, "stalls this long must raise suspicions: {out:?}");
    assert_eq!(out.false_deaths, 0, "{out:?}");
}

#[test]
fn a_rank_stalled_past_the_timeout_is_declared_and_the_same_seed_gives_the_same_outcome() {
    let s = stalling(64, 60, 1.0, Duration::from_secs(30));
    let out = simulate_liveness(&s);
    assert!(out.false_deaths > 0, "a rank silent for far longer than the timeout is dead to the others: {out:?}");
    assert_eq!(simulate_liveness(&s), out);
}
