//! Tests of the verdicts on peers, with no cluster.

use super::*;

fn health() -> Health {
    Health::new(Arc::new(Liveness::new(5)))
}

fn failure(rank: usize) -> PeerFailure {
    PeerFailure { rank, reason: format!("rank {rank} went quiet"), detected_at: Instant::now() }
}

#[test]
fn long_reasons_are_cut_on_a_character_boundary() {
    assert_eq!(bounded("short".into()), "short");
    let long = "é".repeat(2000);
    let cut = bounded(long);
    assert!(cut.len() <= MAX_REASON + '…'.len_utf8());
    assert!(cut.ends_with('…'));
}

#[test]
fn a_rank_is_declared_dead_once_and_the_watchers_hear_each_failure_once() {
    let h = health();
    let mut watch = h.subscribe();
    assert!(h.declare_dead(failure(2)));
    let mut again = failure(2);
    again.reason = "a later report".into();
    assert!(!h.declare_dead(again), "already dead");
    assert!(!watch.has_changed().unwrap(), "the watchers hear once the rank has acted");
    h.publish(failure(2));
    assert!(h.declare_dead(failure(4)));
    h.publish(failure(4));
    assert!(watch.has_changed().unwrap());
    let seen: Vec<(usize, String)> = watch.borrow_and_update().iter().map(|f| (f.rank, f.reason.clone())).collect();
    assert_eq!(seen, vec![(2, "rank 2 went quiet".to_string()), (4, "rank 4 went quiet".to_string())]);
    assert_eq!(h.dead(), vec![2, 4]);
    assert_eq!(h.failure(2).unwrap().reason, "rank 2 went quiet", "the first reason is kept");
    assert!(h.is_dead(4) && !h.is_dead(1));
}

#[test]
fn one_peer_cutting_this_rank_is_not_a_majority_but_most_of_them_are() {
    let h = health();
    let linked = [1, 2, 3, 4];
    let first = h.cut_by(1, "rank 1 cut it", linked);
    assert_eq!(first, CutVotes { votes: 1, peers: 4 });
    assert!(!first.excludes());
    // This rank counts rank 1 as gone: its vote still counts among the peers.
    h.declare_dead(failure(1));
    assert!(!h.cut_by(2, "rank 2 cut it", linked).excludes(), "2 of 4 is not most");
    let third = h.cut_by(3, "rank 3 cut it", linked);
    assert_eq!(third, CutVotes { votes: 3, peers: 4 });
    assert!(third.excludes());
    assert_eq!(h.declared_me_dead().len(), 3);
}

#[test]
fn ranks_long_dead_have_no_say_in_excluding_this_one() {
    let h = health();
    for dead in [2, 3, 4] {
        h.declare_dead(failure(dead));
    }
    // Only rank 1 is left alive beside this rank: its cut is the majority.
    let votes = h.cut_by(1, "rank 1 cut it", [1, 2, 3, 4]);
    assert_eq!(votes, CutVotes { votes: 1, peers: 1 });
    assert!(votes.excludes());
}

#[test]
fn exclusion_keeps_its_first_reason() {
    let h = health();
    let mut watch = h.subscribe();
    watch.borrow_and_update();
    assert!(h.exclude("most peers cut it"));
    assert!(!h.exclude("a later reason"));
    assert_eq!(h.excluded().as_deref(), Some("most peers cut it"));
    h.wake();
    assert!(watch.has_changed().unwrap());
}

#[test]
fn a_goodbye_or_a_shutdown_makes_a_link_end_in_order() {
    let h = health();
    assert!(!h.ends_in_order(3));
    h.said_goodbye(3);
    assert!(h.ends_in_order(3) && !h.ends_in_order(2));
    h.begin_shutdown();
    assert!(h.ends_in_order(2) && h.is_shutting_down());
}

#[test]
fn one_check_per_reported_peer_at_a_time() {
    let h = health();
    assert!(h.start_check(2));
    assert!(!h.start_check(2), "a check of rank 2 is running");
    assert!(h.start_check(3));
    h.end_check(2);
    assert!(h.start_check(2));
}

#[test]
fn a_peer_counted_gone_for_cutting_this_rank_is_told_apart_from_one_seen_dead() {
    let h = health();
    // Rank 1 cut this rank first; this rank then counts it as gone.
    h.cut_by(1, "rank 1 cut it", [1, 2, 3, 4]);
    h.declare_dead(failure(1));
    // Rank 2 went quiet here first, and cut this rank later.
    h.declare_dead(failure(2));
    h.cut_by(2, "rank 2 cut it", [1, 2, 3, 4]);
    assert!(h.gone_for_cutting(1));
    assert!(!h.gone_for_cutting(2), "this rank saw it die before it was cut");
    assert!(!h.gone_for_cutting(3), "not dead at all");
}
