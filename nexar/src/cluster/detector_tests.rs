use super::*;

fn settings() -> DetectorSettings {
    DetectorSettings {
        interval: Duration::from_secs(1),
        timeout: Duration::from_secs(5),
        probe_window: Duration::from_secs(1),
        period: Duration::from_millis(250),
    }
}

/// Runs checks every 250 ms from `from` to `to` (ms) while `peer` beats at the times `beats`
/// gives; returns the suspicions with the time each was raised.
fn run(d: &mut Detector, from: u64, to: u64, beats: impl Fn(u64) -> bool) -> Vec<(u64, Suspicion)> {
    let mut last = 0;
    let mut out = Vec::new();
    let mut t = from;
    while t <= to {
        if beats(t) {
            last = t;
        }
        for s in d.check(t, &[1], |_| last).suspicions {
            out.push((t, s));
        }
        t += 250;
    }
    out
}

#[test]
fn a_steady_peer_is_never_suspected_and_a_silent_one_is_within_the_timeout() {
    let mut d = Detector::new(settings());
    assert!(run(&mut d, 0, 60_000, |t| t % 1000 == 0).is_empty());
    // Steady beats a second apart: the mean, a beat of pause and 5.6 σ of a quarter beat.
    let allowed = d.allowed(1);
    assert!(allowed > Duration::from_millis(3250) && allowed < Duration::from_millis(3350), "{allowed:?}");
    assert!((d.phi(1, allowed) - PHI_THRESHOLD).abs() < 0.1, "φ {} at the silence allowed", d.phi(1, allowed));
    let found = run(&mut d, 60_250, 70_000, |_| false);
    assert_eq!(found.len(), 1, "one suspicion, not one per check: {found:?}");
    let (at, s) = &found[0];
    assert!(*at - 60_000 >= 3300 && *at - 60_000 <= 3600, "suspected after {} ms", at - 60_000);
    assert_eq!(s.peer, 1);
    assert!(d.phi(1, s.silent) > 1.0, "φ {}", d.phi(1, s.silent));
}

#[test]
fn an_irregular_peer_gets_a_longer_silence_up_to_the_timeout_less_the_probes() {
    let mut d = Detector::new(settings());
    // Beats 0.25 s to 3 s apart.
    let beats = [0u64, 250, 3250, 3500, 6250, 6500, 9500, 9750, 12750, 13000, 16000];
    run(&mut d, 0, 16_000, |t| beats.contains(&t));
    let allowed = d.allowed(1);
    assert!(allowed > Duration::from_millis(2500), "{allowed:?}");
    assert!(allowed <= Duration::from_secs(4), "{allowed:?}");
    let found = run(&mut d, 16_250, 30_000, |_| false);
    let (at, _) = found[0];
    assert!(at - 16_000 <= 4250, "a silent peer is suspected by the timeout less the probe window: {at}");
}

#[test]
fn time_this_rank_was_not_running_is_not_counted_as_silence() {
    let mut d = Detector::new(settings());
    run(&mut d, 0, 10_000, |t| t % 1000 == 0);
    // This rank's checks stop for 8 s (the process was starved), then resume.
    let c = d.check(18_000, &[1], |_| 10_000);
    assert_eq!(c.starved, Some(Duration::from_millis(7750)));
    assert!(c.suspicions.is_empty(), "8 s of own starvation is 0.5 s of evidence");
    // The peer is heard again on the next check: no suspicion at all.
    assert!(d.check(18_250, &[1], |_| 18_100).suspicions.is_empty());
    // Starved on every check (1 s late each time): silence still counts, more slowly.
    let mut t = 18_250;
    let mut found = None;
    while found.is_none() && t < 40_000 {
        t += 1250;
        found = d.check(t, &[1], |_| 18_100).suspicions.pop().map(|_| t);
    }
    let at = found.expect("a dead peer is still found when this rank runs late");
    assert!(at > 18_100 + 5000, "{at}");
}

#[test]
fn a_cleared_peer_starts_its_silence_again() {
    let mut d = Detector::new(settings());
    run(&mut d, 0, 5_000, |t| t % 1000 == 0);
    let found = run(&mut d, 5_250, 9_000, |_| false);
    assert_eq!(found.len(), 1);
    d.cleared(1);
    let mut t = 9_000;
    let mut again = None;
    while again.is_none() {
        t += 250;
        again = d.check(t, &[1], |_| 5_000).suspicions.pop().map(|_| t);
    }
    assert!(again.unwrap() >= 12_400, "{again:?}");
}

#[test]
fn each_rank_watches_three_successors_and_beats_to_three_predecessors() {
    let live: Vec<usize> = (0..10).collect();
    assert_eq!(watched(0, &live), [1, 2, 3]);
    assert_eq!(watched(8, &live), [9, 0, 1]);
    assert_eq!(watchers(0, &live), [9, 8, 7]);
    assert_eq!(watchers(5, &live), [4, 3, 2]);
    // Every rank is watched by exactly three others, and watchers are consistent.
    for r in 0..10 {
        let by: Vec<usize> = (0..10).filter(|&w| watched(w, &live).contains(&r)).collect();
        assert_eq!(by.len(), 3);
        let mut mine = watchers(r, &live);
        mine.sort();
        assert_eq!(by, mine);
    }
    // Dead ranks leave the ring; few ranks watch each other.
    assert_eq!(watched(3, &[0, 3, 7, 9, 12]), [7, 9, 12]);
    assert_eq!(watched(12, &[0, 3, 7, 9, 12]), [0, 3, 7]);
    assert_eq!(watched(1, &[0, 1, 2]), [0, 2]);
    assert_eq!(watched(4, &[0, 1, 2]), [0, 1, 2]);
}
