//! A member of the cluster on the same host writes crafted groups into the shared-memory ring
//! it shares with an honest rank (`nexar::hostile`): the honest rank refuses what is crafted,
//! gives the link up with an error naming the peer, and carries on; nothing forged reaches a
//! caller's buffer, nothing hangs, no rank panics, and groups nobody asked for cost no more
//! memory than the configured limits (asserted from `/proc/self/status`, in a process of its
//! own).

use std::time::{Duration, Instant};

use bytes::Bytes;
use nexar::hostile::{HostileMember, take_collective_payload};
use nexar::{NexarClient, NexarConfig};

use crate::common::{TEST_LIMIT, alone};
use crate::hostile_common::{
    carries_on, coll_frames, segments_that_do_not_hold_together_are_refused, unasked_groups_cost_less_than,
};

/// Two ranks of one process (one host) linked through shared memory.
async fn two_ranks_in_shared_memory(cfg: NexarConfig) -> Vec<NexarClient> {
    let ranks =
        NexarClient::bootstrap_local_with(2, cfg.into_builder().shared_memory(true).build().unwrap()).await.unwrap();
    assert_eq!(HostileMember::new(&ranks[1]).bulk_channel(0).map(|l| l.name()), Some("shm"));
    ranks
}

/// Waits until rank 0 no longer uses its shared-memory link to rank 1, and rank 1 has heard
/// (a collective it started on the link before would fail on both sides, as it should).
async fn gives_the_link_up(ranks: &[NexarClient]) {
    let started = Instant::now();
    for (rank, peer) in [(0, 1), (1, 0)] {
        while HostileMember::new(&ranks[rank]).bulk_channel(peer).is_some_and(|l| l.usable()) {
            assert!(started.elapsed() < TEST_LIMIT, "rank {rank} kept the link");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The member writes a group that is not a collective message at all (junk where the message
/// frame should be): rank 0 refuses it, delivers nothing and gives the link up; the ranks'
/// later collectives move over the network and are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_junk_is_refused_and_the_link_given_up() {
    let ranks = two_ranks_in_shared_memory(NexarConfig::default()).await;
    let link = HostileMember::new(&ranks[1]).bulk_channel(0).unwrap();
    let junk = Bytes::from((0..64 << 10).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>());
    let _ = tokio::time::timeout(TEST_LIMIT, link.send(vec![junk])).await.unwrap();
    gives_the_link_up(&ranks).await;
    carries_on(&ranks).await;
}

/// A group longer than the rank's message limit allows is refused from its length word,
/// before anything is allocated for it; nothing of it is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_over_the_message_limit_is_refused_before_it_is_read() {
    let limit: u64 = 1 << 20;
    let ranks = two_ranks_in_shared_memory(NexarConfig::builder().max_message_bytes(limit).build().unwrap()).await;
    let comm = ranks[0].comm_id();
    let link = HostileMember::new(&ranks[1]).bulk_channel(0).unwrap();
    let len = 4 * limit;
    let sent = link.send(vec![coll_frames(comm, 1000, len), Bytes::from(vec![5u8; len as usize])]);
    let _ = tokio::time::timeout(TEST_LIMIT, sent).await.unwrap();
    let refused = take_collective_payload(&ranks[0], 1, 1000, len, Duration::from_secs(3)).await;
    assert!(refused.is_err(), "the oversized group was delivered");
    gives_the_link_up(&ranks).await;
    carries_on(&ranks).await;
}

/// A group whose frames announce a payload longer than the group itself: refused, the link
/// given up, nothing delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_that_announces_more_than_it_holds_is_refused() {
    let ranks = two_ranks_in_shared_memory(NexarConfig::default()).await;
    let comm = ranks[0].comm_id();
    let link = HostileMember::new(&ranks[1]).bulk_channel(0).unwrap();
    let sent = link.send(vec![coll_frames(comm, 1000, 1 << 20), Bytes::from(vec![5u8; 1000])]);
    let _ = tokio::time::timeout(TEST_LIMIT, sent).await.unwrap();
    let refused = take_collective_payload(&ranks[0], 1, 1000, 1 << 20, Duration::from_secs(3)).await;
    assert!(refused.is_err(), "the short group was delivered");
    gives_the_link_up(&ranks).await;
    carries_on(&ranks).await;
}

/// A member writes eight 32 MiB collective groups nobody asked for to a rank whose collective
/// store holds 16 MiB. The rank reads the first group's message frame, admits it (an empty
/// store takes any one message) and leaves the next in the ring, which fills, so the member
/// waits. Asked for, all eight arrive intact, and the cluster carries on.
#[test]
fn shm_groups_nobody_asked_for_cost_no_more_memory_than_the_limits() {
    alone(
        module_path!(),
        "shm_groups_nobody_asked_for_cost_no_more_memory_than_the_limits",
        shm_groups_nobody_asked_for_cost_no_more_memory_than_the_limits_body,
    );
}

async fn shm_groups_nobody_asked_for_cost_no_more_memory_than_the_limits_body() {
    let len: u64 = 32 << 20;
    let cfg = NexarConfig::builder().max_unmatched_bytes(16 << 20).max_message_bytes(len).build().unwrap();
    let ranks = two_ranks_in_shared_memory(cfg).await;
    let link = HostileMember::new(&ranks[1]).bulk_channel(0).unwrap();
    // This process is both ranks; the rings (2 x 4 MiB each way) were mapped before the
    // watch starts.
    unasked_groups_cost_less_than(&ranks, link, len, 2 * len + (16 << 20)).await;
}

/// The member sends point-to-point messages in segments that do not hold together through
/// the ring (see [`segments_that_do_not_hold_together_are_refused`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_segments_that_do_not_hold_together_are_refused() {
    let ranks = two_ranks_in_shared_memory(NexarConfig::default()).await;
    segments_that_do_not_hold_together_are_refused(&ranks).await;
}
