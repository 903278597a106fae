//! A member of the cluster, holding valid credentials and its own TCP lanes' keys, sends
//! crafted groups on them (`nexar::hostile`), and a stranger trickles handshakes into a rank's
//! lane listener while the cluster forms: the honest ranks refuse what is crafted and carry on.
//! Nothing forged reaches a caller's buffer, nothing hangs, no rank panics, and resident memory
//! stays within the configured limits (asserted from `/proc/self/status`, in a process of its
//! own).

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nexar::hostile::{HostileMember, LaneTamper, take_collective_payload};
use nexar::{LaneAes, LaneCipher, NetChaos, NexarClient, NexarConfig};

use crate::common::{TEST_LIMIT, alone, alone_in_own_network, on_each};
use crate::hostile_common::{
    carries_on, coll_frames, segments_that_do_not_hold_together_are_refused, unasked_groups_cost_less_than,
};

/// Two ranks whose collectives of any size take the TCP lane: on one host (every core runs a
/// rank, so their runtimes do all the lane's I/O), or each on a fake host of its own (cores to
/// spare, so a thread of the lane reads large groups' records), rank 0 with aws-lc's AES-GCM on
/// one host and ring's on the other.
async fn two_ranks_on_tcp_lanes(host: Host, cipher: LaneCipher) -> Vec<NexarClient> {
    let cfg = NexarConfig::builder()
        .bulk_transport(nexar::BulkTransport::Tcp)
        .bulk_min_bytes(0)
        .shared_memory(false)
        .lane_cipher(cipher)
        .build()
        .unwrap();
    // The two AES-GCM implementations read a payload differently (aws-lc leaves its records
    // sealed for the receive to open into its buffer, ring opens them as they arrive), and the
    // ranks need not agree: rank 0, the receiver in these tests, uses each in one of the hosts
    // (where the cipher is AES-128-GCM; AEGIS-128X2 has one implementation).
    let aes = match host {
        Host::Shared => [LaneAes::AwsLc, LaneAes::Ring],
        Host::OwnEach => [LaneAes::Ring, LaneAes::AwsLc],
    };
    let configs = (0..2)
        .map(|rank| {
            let cfg = cfg.clone().into_builder().lane_aes(aes[rank]);
            match host {
                Host::Shared => cfg.build().unwrap(),
                Host::OwnEach => cfg.host_id(format!("hostile-lane-host-{rank}")).build().unwrap(),
            }
        })
        .collect();
    let ranks = NexarClient::bootstrap_local_each(configs).await.unwrap();
    assert_eq!(HostileMember::new(&ranks[1]).bulk_channel(0).map(|l| l.name()), Some("tcp-tls"));
    ranks
}

/// Where the two ranks of [`two_ranks_on_tcp_lanes`] are, and which cipher seals their lanes:
/// each cipher on each kind of host.
const CASES: [(Host, LaneCipher); 4] = [
    (Host::Shared, LaneCipher::Aes128Gcm),
    (Host::OwnEach, LaneCipher::Aes128Gcm),
    (Host::Shared, LaneCipher::Aegis128X2),
    (Host::OwnEach, LaneCipher::Aegis128X2),
];

/// Where the two ranks of [`two_ranks_on_tcp_lanes`] are.
#[derive(Clone, Copy, Debug)]
enum Host {
    Shared,
    OwnEach,
}

/// Rank 0's and the root's (rank 1's) broadcast of `sent` into an `old`-filled buffer: both
/// outcomes, and rank 0's buffer.
async fn broadcast_from_1(
    ranks: &[NexarClient],
    sent: &[u8],
    old: u8,
) -> (Result<(), String>, Result<(), String>, Vec<u8>) {
    let (rank0, rank1) = (ranks[0].clone(), ranks[1].clone());
    let mut root = sent.to_vec();
    let root = tokio::spawn(async move { rank1.broadcast(&mut root[..], 1).await });
    let mut buf = vec![old; sent.len()];
    let got =
        tokio::time::timeout(TEST_LIMIT, rank0.broadcast(&mut buf[..], 1)).await.expect("rank 0's broadcast ended");
    let root = tokio::time::timeout(TEST_LIMIT, root).await.expect("the root's broadcast ended").unwrap();
    (got.map_err(|e| e.to_string()), root.map_err(|e| e.to_string()), buf)
}

/// The member sends point-to-point messages in segments that do not hold together on its
/// lane, which carries point-to-point messages (see
/// [`segments_that_do_not_hold_together_are_refused`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_segments_that_do_not_hold_together_are_refused() {
    for (host, cipher) in CASES {
        segments_that_do_not_hold_together_are_refused(&two_ranks_on_tcp_lanes(host, cipher).await).await;
    }
}

/// The member (rank 1, the root of a 4 MiB broadcast) flips one bit of the payload's
/// ciphertext on its TCP lane, which it holds the keys of. AES-GCM and AEGIS decrypt before
/// they check the tag, and the payload's records are opened straight into rank 0's buffer
/// (aws-lc's AES-GCM, AEGIS) or as they arrive, a forged one zeroed (ring's AES-GCM, AEGIS): the broadcast fails there naming the altered
/// record (and rank 0 tells the root, whose broadcast or next call says so), and
/// each byte of the buffer holds its old
/// value, the root's byte or zero, never the altered byte. The next broadcast, untampered,
/// arrives exactly, and the cluster carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_payload_never_reaches_the_receivers_buffer() {
    for (host, cipher) in CASES {
        tampered_payload(host, cipher).await;
    }
}

async fn tampered_payload(host: Host, cipher: LaneCipher) {
    let ranks = two_ranks_on_tcp_lanes(host, cipher).await;
    let sent: Vec<u8> = (0..4usize << 20).map(|i| 0x80 | (i % 113) as u8).collect();
    let old = 0x11;
    let flip = 1000;
    let member = HostileMember::new(&ranks[1]);
    member.tamper_next_group(0, LaneTamper { flip_lead_byte: Some(flip), ..Default::default() }).unwrap();
    let (got, root, buf) = broadcast_from_1(&ranks, &sent, old).await;
    let err = got.expect_err("a broadcast with an altered record failed");
    assert!(err.contains("rank 1") && err.contains("failed authentication"), "{err}");
    assert_ne!(buf[flip], sent[flip] ^ 1, "the altered byte reached the buffer");
    let stray = (0..buf.len()).find(|&i| ![old, sent[i], 0].contains(&buf[i]));
    assert_eq!(stray, None, "a byte that is neither old, sent nor cleared");

    let root_first = root;
    let (got, root, buf) = broadcast_from_1(&ranks, &sent, old).await;
    got.unwrap();
    assert!(buf == sent, "the next broadcast arrived changed");
    // Rank 0 tells the root why the broadcast failed there, once: in the root's broadcast, or,
    // when the root had returned (it only sends), in its next call, which completed.
    let told = match (root_first, root) {
        (Err(told), Ok(())) => told,
        (Ok(()), Err(told)) => {
            assert!(told.contains("completed, but the earlier broadcast"), "{told}");
            told
        }
        other => panic!("the root must hear of rank 0's failure once: {other:?}"),
    };
    assert!(told.contains("rank 0") && told.contains("failed authentication"), "{told}");
    carries_on(&ranks).await;
}

/// The member's placement hint (`lead`) says where its group's payload starts; from there on
/// the receiver leaves records sealed for the reader of the payload. A hint at the group's
/// start or past its end changes nothing the receiver trusts: it parses the frames only from
/// records it opened itself, so both broadcasts arrive exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crafted_placement_hint_changes_nothing_the_receiver_trusts() {
    for (host, cipher) in CASES {
        crafted_placement_hint(host, cipher).await;
    }
}

async fn crafted_placement_hint(host: Host, cipher: LaneCipher) {
    let ranks = two_ranks_on_tcp_lanes(host, cipher).await;
    let sent: Vec<u8> = (0..1usize << 20).map(|i| (i % 241) as u8).collect();
    let member = HostileMember::new(&ranks[1]);
    for lead in [0, 3, u64::MAX] {
        member.tamper_next_group(0, LaneTamper { lead: Some(lead), ..Default::default() }).unwrap();
        let (got, root, buf) = broadcast_from_1(&ranks, &sent, 0).await;
        got.and(root).unwrap_or_else(|e| panic!("{host:?}, {cipher}, lead {lead}: {e}"));
        assert!(buf == sent, "lead {lead}: the broadcast arrived changed");
    }
    carries_on(&ranks).await;
}

/// The member sends a group whose message frame lies in a record large enough to be left
/// sealed (frames and payload as one part, so the header's hint says the payload starts at
/// byte 0). The receiver never parses frames from a record it has not opened: it refuses the
/// group and gives the lane up (naming rank 1 in its log). Nothing of that collective is
/// delivered; the ranks' later collectives move over QUIC and are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_in_a_record_left_sealed_are_refused_and_the_lane_given_up() {
    for (host, cipher) in CASES {
        frames_in_a_sealed_record(host, cipher).await;
    }
}

async fn frames_in_a_sealed_record(host: Host, cipher: LaneCipher) {
    let ranks = two_ranks_on_tcp_lanes(host, cipher).await;
    let len: u64 = 1 << 20;
    let comm = ranks[0].comm_id();
    let lane = HostileMember::new(&ranks[1]).bulk_channel(0).unwrap();
    let one_part = Bytes::from([coll_frames(comm, 1000, len), Bytes::from(vec![9u8; len as usize])].concat());
    // The member's send may or may not see the lane go down before it is written.
    let _ = tokio::time::timeout(TEST_LIMIT, lane.send(vec![one_part])).await.unwrap();
    let refused = take_collective_payload(&ranks[0], 1, 1000, len, Duration::from_secs(3)).await;
    assert!(refused.is_err(), "the group with frames in a sealed record was delivered");
    let started = Instant::now();
    while HostileMember::new(&ranks[0]).bulk_channel(1).is_some_and(|l| l.usable()) {
        assert!(started.elapsed() < TEST_LIMIT, "rank 0 kept the lane");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    carries_on(&ranks).await;
}

/// The member sends a group whose message announces an 8-byte payload and whose header
/// record announces 192 MiB: the payload, then padding. The mailbox admits 8 bytes; the
/// receiver refuses the group from its first record, gives the lane up and reads none of the
/// padding (before, it read all 192 MiB into a buffer, then refused the group). Its resident
/// memory stays far below the padding (the padding is zeros the member never touched, so its
/// side holds little either), and the cluster carries on over QUIC.
#[test]
fn a_group_padded_far_past_its_payload_is_refused_before_its_padding_is_read() {
    alone(
        module_path!(),
        "a_group_padded_far_past_its_payload_is_refused_before_its_padding_is_read",
        a_group_padded_far_past_its_payload_is_refused_before_its_padding_is_read_body,
    );
}

async fn a_group_padded_far_past_its_payload_is_refused_before_its_padding_is_read_body() {
    let padding = 192usize << 20;
    let ranks = two_ranks_on_tcp_lanes(Host::Shared, LaneCipher::Aegis128X2).await;
    let comm = ranks[0].comm_id();
    let lane = HostileMember::new(&ranks[1]).bulk_channel(0).unwrap();
    // The peak is counted from here (writing 5 to `clear_refs` resets `VmHWM` to `VmRSS`).
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting the resident peak");
    let before = crate::common::resident_bytes();
    let parts = vec![coll_frames(comm, 1000, 8), Bytes::from(vec![5u8; 8]), Bytes::from(vec![0u8; padding])];
    let sending = tokio::spawn(async move { lane.send(parts).await });
    let refused = take_collective_payload(&ranks[0], 1, 1000, 8, Duration::from_secs(3)).await;
    assert!(refused.is_err(), "the padded group was delivered");
    let started = Instant::now();
    while HostileMember::new(&ranks[0]).bulk_channel(1).is_some_and(|l| l.usable()) {
        assert!(started.elapsed() < TEST_LIMIT, "rank 0 kept the lane");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The member's send fails once the lane is down (or may have been written whole into
    // the sockets first); either way it ends.
    let _ = tokio::time::timeout(TEST_LIMIT, sending).await.expect("the member's send ended");
    let grown = crate::common::peak_resident_bytes().saturating_sub(before);
    assert!(
        grown < (padding as u64) / 3,
        "resident memory grew by {} MiB for a group that announced an 8-byte payload",
        grown >> 20
    );
    carries_on(&ranks).await;
}

/// The same over the TCP lane: a member sends eight 32 MiB collective groups nobody asked for
/// to a rank whose collective store holds 32 MiB. The rank reads the first group's frames,
/// admits it (an empty store takes any one message) and leaves the next unread after its first
/// record, so TCP holds the member; before, the lane's reader read every group whole and queued
/// them, past the limits. Asked for, all eight arrive intact, and the cluster carries on.
#[test]
fn tcp_lane_groups_nobody_asked_for_cost_no_more_memory_than_the_limits() {
    alone(
        module_path!(),
        "tcp_lane_groups_nobody_asked_for_cost_no_more_memory_than_the_limits",
        tcp_lane_groups_nobody_asked_for_cost_no_more_memory_than_the_limits_body,
    );
}

async fn tcp_lane_groups_nobody_asked_for_cost_no_more_memory_than_the_limits_body() {
    let len: u64 = 32 << 20;
    let cfg = NexarConfig::builder()
        .bulk_transport(nexar::BulkTransport::Tcp)
        .bulk_min_bytes(0)
        .max_unmatched_bytes(16 << 20)
        .max_message_bytes(len)
        .shared_memory(false)
        .build()
        .unwrap();
    let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    let lane = HostileMember::new(&ranks[1]).bulk_channel(0).expect("a tcp lane to rank 0");
    assert_eq!(lane.name(), "tcp-tls");
    // This process is both ranks: the member's side holds the group it is writing (sealed).
    // Read whole and queued, the groups took over 200 MiB here.
    unasked_groups_cost_less_than(&ranks, lane, len, 4 * len + (16 << 20)).await;
}

/// A stranger (any process that can reach the port) opens connections to every lane listener
/// of the forming cluster and trickles a byte every 50 ms into each: a TLS record header that
/// promises a long ClientHello. A per-read timeout would hold each of them open for ever; the
/// handshake's single deadline cuts them all, the cluster forms (its lanes up, or on QUIC where
/// the stranger took their place) and its collectives are exact. The listeners are found in
/// `/proc`'s TCP table, so the test runs in a process and a network namespace of its own.
#[test]
fn a_slowloris_at_the_lane_listener_is_cut_at_the_handshake_deadline() {
    // Its own network namespace: every listener in the TCP table it polls is its own, and the
    // table stays small on a machine with thousands of other sockets.
    alone_in_own_network(
        module_path!(),
        "a_slowloris_at_the_lane_listener_is_cut_at_the_handshake_deadline",
        a_slowloris_at_the_lane_listener_is_cut_at_the_handshake_deadline_body,
    );
}

async fn a_slowloris_at_the_lane_listener_is_cut_at_the_handshake_deadline_body() {
    const FORMATIONS: usize = 50;
    let cfg = NexarConfig::builder().connect_timeout(Duration::from_secs(5)).shared_memory(false).build().unwrap();
    // The listeners live only while the lanes form: a few milliseconds where every rank gets
    // there at once. Rank 0's datagrams take 50 ms (it keeps QUIC, being faulty): ranks 1 and
    // 2 finish joining the mesh (its acceptance reaches them late) and learn the host table
    // later than it does, and keep listening until its answer arrives, while their own lane
    // forms. Form clusters until the stranger has caught a listener (the first nearly always;
    // a formation that missed costs a fraction of a second).
    let slow = NetChaos { reorder: 1.0, delay: Duration::from_millis(50), ..NetChaos::default() };
    let configs = vec![cfg.clone().into_builder().chaos(slow).build().unwrap(), cfg.clone(), cfg];
    for attempt in 1..=FORMATIONS {
        let forming = Arc::new(AtomicBool::new(true));
        let stranger = {
            let forming = forming.clone();
            std::thread::spawn(move || slowloris_while(&forming))
        };
        let ranks = tokio::time::timeout(TEST_LIMIT, NexarClient::bootstrap_local_each(configs.clone()))
            .await
            .expect("the cluster formed")
            .expect("the cluster formed");
        forming.store(false, Ordering::SeqCst);
        let caught = tokio::task::spawn_blocking(move || stranger.join().unwrap()).await.unwrap();
        if caught > 0 {
            carries_on(&ranks).await;
            eprintln!("attempt {attempt}: {caught} trickling connections, all cut");
            return;
        }
        on_each(&ranks, |c| async move { c.shutdown().await }).await;
    }
    panic!("no lane listener was caught in {FORMATIONS} formations");
}

/// Trickles into every lane listener this process opens while `forming` holds, then keeps
/// trickling until every connection is cut; returns how many there were.
fn slowloris_while(forming: &AtomicBool) -> usize {
    let mut seen = std::collections::HashSet::new();
    let mut conns: Vec<TcpStream> = Vec::new();
    while forming.load(Ordering::SeqCst) {
        for port in own_tcp_listeners() {
            if seen.insert(port) {
                for _ in 0..12 {
                    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { break };
                    if s.write_all(&[0x16, 3, 1, 0x3f, 0xff]).is_ok() {
                        conns.push(s);
                    }
                }
            }
        }
        std::thread::yield_now();
    }
    let caught = conns.len();
    let started = Instant::now();
    while !conns.is_empty() {
        assert!(started.elapsed() < TEST_LIMIT, "{} trickling connections still open", conns.len());
        conns.retain_mut(|s| s.write_all(&[0]).is_ok());
        std::thread::sleep(Duration::from_millis(50));
    }
    caught
}

/// The ports of the TCP sockets listening in this network namespace (IPv4), from `/proc`:
/// the test runs in a namespace of its own, so they are this process's. One small read, so
/// the stranger sees a listener within the few milliseconds it lives.
fn own_tcp_listeners() -> Vec<u16> {
    let table = std::fs::read_to_string("/proc/self/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let port = f.get(1)?.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok())?;
            (f.get(3) == Some(&"0A")).then_some(port)
        })
        .collect()
}
