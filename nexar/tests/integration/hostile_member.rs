//! A member of the cluster, holding valid credentials, sends crafted messages on its links
//! (`nexar::hostile`): the honest ranks refuse them and carry on, or cut the member with a
//! clear error. Nothing is forged, nothing hangs, no rank panics, and resident memory stays
//! within the configured limits (asserted from `/proc/self/status`, each such test in a process
//! of its own).

use std::time::Duration;

use bytes::Bytes;
use nexar::hostile::{HostileMember, RelaySealing};
use nexar::proto::frame::{message_frame, raw_header};
use nexar::proto::message::{PeerMsg, encode};
use nexar::transport::link::Lane;
use nexar::{NexarClient, NexarConfig};

use crate::common::{alone, resident_bytes};

fn u32_bytes(values: &[u32]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(values))
}

/// Rank 2 relays a point-to-point message to rank 0 "from rank 1" (on a full mesh, where rank 1
/// has its own link to rank 0): rank 0 drops it, and rank 1's real message arrives intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_forges_its_sender_is_refused() {
    let ranks = NexarClient::bootstrap_local(3).await.unwrap();
    let tag = 7;
    let forged = [0xdead_beefu32; 4];
    let msg = PeerMsg::P2p { comm: ranks[0].comm_id(), tag, dtype: nexar::DType::U32.to_wire(), count: 4 };
    let member = HostileMember::new(&ranks[2]);
    // Claiming to be rank 1, then the receiver itself, then wrapping its own message.
    for src in [1, 0, 2] {
        member.relay(0, src, 0, &msg, Some(u32_bytes(&forged)), RelaySealing::Unsealed).await.unwrap();
    }

    let mut got = [0u32; 4];
    let early = tokio::time::timeout(Duration::from_millis(500), ranks[0].recv(&mut got[..], 1, tag)).await;
    assert!(early.is_err(), "rank 0 took a forged message as rank 1's: {got:?}");
    let early = tokio::time::timeout(Duration::from_millis(200), ranks[0].recv(&mut got[..], 2, tag)).await;
    assert!(early.is_err(), "rank 0 took a relayed copy of rank 2's own message: {got:?}");

    let real = [1u32, 2, 3, 4];
    let (sent, received) = tokio::join!(ranks[1].send(&real[..], 0, tag), ranks[0].recv(&mut got[..], 1, tag));
    sent.unwrap();
    received.unwrap();
    assert_eq!(got, real);
    // The cluster carries on: every rank all-reduces correctly.
    let sums = futures_all(&ranks).await;
    assert!(sums.iter().all(|s| *s == 6), "{sums:?}");
}

/// On a ring of 5 (`k_regular:2`), rank 2 reaches rank 0 only through a relay. Rank 1, a relay
/// on that route, cannot pass off a message as rank 2's: not unsealed, not sealed under its own
/// keys, not by replaying an envelope rank 2 really sealed. Rank 2's real messages still arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cannot_forge_or_replay_a_message_from_a_rank_it_relays_for() {
    let cfg = NexarConfig::builder().topology(nexar::Topology::KRegular(2)).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(5, cfg).await.unwrap();
    let (honest, relay) = (HostileMember::new(&ranks[2]), HostileMember::new(&ranks[1]));
    assert!(honest.link(0).is_none(), "rank 2 has no direct link to rank 0 on this ring");
    let tag = 9;
    let msg = PeerMsg::P2p { comm: ranks[0].comm_id(), tag, dtype: nexar::DType::U32.to_wire(), count: 4 };
    let forged = [0xbad0_cafeu32; 4];
    for sealing in [RelaySealing::Unsealed, RelaySealing::OwnKeys] {
        relay.relay(0, 2, 0, &msg, Some(u32_bytes(&forged)), sealing).await.unwrap();
    }
    let mut got = [0u32; 4];
    let early = tokio::time::timeout(Duration::from_millis(500), ranks[0].recv(&mut got[..], 2, tag)).await;
    assert!(early.is_err(), "rank 0 took a relay's forgery as rank 2's message: {got:?}");

    // An envelope rank 2 sealed, delivered once and then replayed by the relay.
    let genuine = [1u32, 2, 3, 4];
    let (envelope, body) = honest.sealed_envelope(0, &msg, Some(u32_bytes(&genuine))).unwrap();
    let via = relay.link(0).expect("rank 1 links to rank 0");
    for _ in 0..2 {
        via.send_queued_parts(&envelope, vec![body.clone()]).await.unwrap().await.unwrap().unwrap();
    }
    tokio::time::timeout(Duration::from_secs(30), ranks[0].recv(&mut got[..], 2, tag)).await.unwrap().unwrap();
    assert_eq!(got, genuine, "the genuine envelope arrives once");
    let early = tokio::time::timeout(Duration::from_millis(500), ranks[0].recv(&mut got[..], 2, tag)).await;
    assert!(early.is_err(), "rank 0 took a replayed envelope a second time: {got:?}");

    // Rank 2's own messages, relayed honestly, still arrive, and the ring still all-reduces.
    let real = [5u32, 6, 7, 8];
    let (sent, received) = tokio::join!(ranks[2].send(&real[..], 0, tag), ranks[0].recv(&mut got[..], 2, tag));
    sent.unwrap();
    received.unwrap();
    assert_eq!(got, real);
    let sums = futures_all(&ranks).await;
    assert!(sums.iter().all(|s| *s == 15), "{sums:?}");
}

async fn futures_all(ranks: &[NexarClient]) -> Vec<u64> {
    let mut tasks = Vec::new();
    for comm in ranks {
        let comm = comm.clone();
        tasks.push(tokio::spawn(async move {
            let mut v = [comm.rank() as u64 + 1];
            comm.all_reduce(&mut v[..], nexar::Sum).await.unwrap();
            v[0]
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Answers after `ms` milliseconds.
#[nexar::rpc]
async fn answer_after(ms: u64) -> u64 {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    ms
}

/// Rank 0 calls rank 1, which answers slowly; meanwhile rank 2 sends rank 0 answers for the
/// first request ids (the ones a call gets): they are dropped, and rank 1's own answer
/// completes the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpc_response_from_the_wrong_rank_is_refused() {
    let ranks = NexarClient::bootstrap_local(3).await.unwrap();
    let caller = ranks[0].clone();
    let call = tokio::spawn(async move { answer_after::call(&caller, 1, 1500).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let to_0 = HostileMember::new(&ranks[2]);
    let to_0 = to_0.link(0).unwrap();
    for req in 0..8 {
        let forged = PeerMsg::RpcResponse { req, status: 0, len: 8 };
        to_0.send(&forged, Some(Bytes::copy_from_slice(&7u64.to_le_bytes()))).await.unwrap();
    }
    let answer = tokio::time::timeout(Duration::from_secs(30), call).await.unwrap().unwrap();
    assert_eq!(answer.unwrap(), 1500, "the call took rank 2's answer to a call made to rank 1");
    let sums = futures_all(&ranks).await;
    assert!(sums.iter().all(|s| *s == 6), "{sums:?}");
}

/// Rank 2 tells rank 0 that rank 1 is dead, and that rank 0 itself is: rank 0 checks rank 1
/// for itself (it answers) and ignores the report about itself; nobody is evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_cannot_evict_another_or_the_receiver_with_a_suspect() {
    // Default heartbeats: the check waits up to 2 s for rank 1's answer, which a busy machine
    // needs (a shorter window could take a slow answer for a dead rank).
    let ranks = NexarClient::bootstrap_local(3).await.unwrap();
    let member = HostileMember::new(&ranks[2]);
    let to_0 = member.link(0).unwrap();
    for rank in [1, 0] {
        let lie = PeerMsg::Suspect { rank, reason: "a lie".into() };
        to_0.send(&lie, None).await.unwrap();
    }
    // Longer than the check takes (two heartbeat intervals).
    tokio::time::sleep(Duration::from_millis(3000)).await;
    for c in &ranks {
        assert!(c.failed_ranks().is_empty(), "rank {} now counts {:?} dead", c.rank(), c.failed_ranks());
    }
    let sums = futures_all(&ranks).await;
    assert!(sums.iter().all(|s| *s == 6), "{sums:?}");
}

/// On a ring of 5, rank 1 tells rank 0 that rank 3, which has no direct link to rank 0, is
/// dead. Rank 0 hears nothing from rank 3 directly anyway, so silence is no evidence: it pings
/// rank 3 through the relays, gets an answer, and evicts nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_member_cannot_evict_a_rank_that_has_no_direct_link_to_the_receiver() {
    let cfg = NexarConfig::builder().topology(nexar::Topology::KRegular(2)).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(5, cfg).await.unwrap();
    assert!(HostileMember::new(&ranks[0]).link(3).is_none(), "rank 3 is not a neighbour of rank 0");
    // Long enough that rank 0 has heard nothing from rank 3 for longer than the check's window.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let lie = PeerMsg::Suspect { rank: 3, reason: "a lie".into() };
    HostileMember::new(&ranks[1]).link(0).unwrap().send(&lie, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3000)).await;
    for c in &ranks {
        assert!(c.failed_ranks().is_empty(), "rank {} now counts {:?} dead", c.rank(), c.failed_ranks());
    }
    let sums = futures_all(&ranks).await;
    assert!(sums.iter().all(|s| *s == 15), "{sums:?}");
}

/// Rank 3 cuts its link to rank 0 with the "declared dead" code: one member's word does not
/// exclude rank 0, which counts rank 3 as gone and carries on with ranks 1 and 2 (who check
/// rank 3 for themselves and keep it). When most of rank 0's peers have cut it, it leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_member_declaring_a_rank_dead_does_not_exclude_it_but_most_of_its_peers_do() {
    let ranks = NexarClient::bootstrap_local(4).await.unwrap();
    let watch = ranks[0].failure_watch();
    HostileMember::new(&ranks[3]).declare_dead(0, "rank 3 declared rank 0 dead: a lie").unwrap();
    let limit = Duration::from_secs(30);
    tokio::time::timeout(limit, async {
        while ranks[0].failed_ranks() != [3] {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("rank 0 counts rank 3 as gone");
    // Longer than the others' check of rank 3 takes (two heartbeat intervals).
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert_eq!(watch.excluded(), None, "one member excluded rank 0");
    for c in &ranks[1..3] {
        assert!(c.failed_ranks().is_empty(), "rank {} now counts {:?} dead", c.rank(), c.failed_ranks());
    }
    let (tag, sent) = (9, [5u32, 6, 7]);
    let mut got = [0u32; 3];
    let (s, r) = tokio::join!(ranks[1].send(&sent[..], 0, tag), ranks[0].recv(&mut got[..], 1, tag));
    s.unwrap();
    r.unwrap();
    assert_eq!(got, sent);

    // Rank 1 cuts rank 0 as well: two of its three peers, a majority, and rank 0 leaves.
    HostileMember::new(&ranks[1]).declare_dead(0, "rank 1 declared rank 0 dead: silent").unwrap();
    tokio::time::timeout(limit, async {
        while watch.excluded().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("rank 0 leaves once most of its peers cut it");
    let why = watch.excluded().unwrap();
    assert!(why.contains("2 of this rank's 3 peers cut it"), "{why}");
}

/// A member may open only a few streams towards a rank at once (a link uses one per lane), so
/// it cannot push many messages at once into the rank's memory, each up to the message limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cannot_open_more_streams_than_a_link_uses() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let conn = HostileMember::new(&ranks[1]).link(0).unwrap().connection().clone();
    let mut opened = Vec::new();
    let limit = 2 * Lane::COUNT;
    for _ in 0..limit + 4 {
        match tokio::time::timeout(Duration::from_millis(300), conn.open_uni()).await {
            // The peer's limit is known here: opening past it waits for credit.
            Ok(Ok(s)) => opened.push(s),
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => break,
        }
    }
    assert!(opened.len() <= limit, "{} streams opened at once", opened.len());
    assert!(tokio::time::timeout(Duration::from_millis(300), conn.open_bi()).await.is_err(), "a bidirectional stream");
}

/// A member announces two 40 MiB messages on the data lane over two streams of its own: the
/// first is read as it comes; the second is not read until the first is handed over (the
/// lane's 64 MiB in-flight budget), so QUIC's flow control holds the member instead of this
/// rank's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_messages_in_flight_on_a_lane_stay_within_its_budget() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let conn = HostileMember::new(&ranks[1]).link(0).unwrap().connection().clone();
    let len: u64 = 40 << 20;
    let msg = PeerMsg::P2p { comm: ranks[0].comm_id(), tag: 77, dtype: nexar::DType::U8.to_wire(), count: len };
    let head = [message_frame(&encode(&msg).unwrap()).to_vec(), raw_header(len).to_vec()].concat();
    let chunk = vec![7u8; 1 << 20];
    let mut streams = Vec::new();
    for _ in 0..2 {
        let mut s = conn.open_uni().await.unwrap();
        s.write_all(&head).await.unwrap();
        streams.push(s);
    }
    // Whichever stream the receiver takes first holds 40 MiB of the lane's budget and is read
    // as its bytes come; the other waits for the budget, is not read, and its writer stalls.
    let mut writers = tokio::task::JoinSet::new();
    for (i, mut s) in streams.into_iter().enumerate() {
        let chunk = chunk.clone();
        writers.spawn(async move {
            for _ in 0..8 {
                s.write_all(&chunk).await.unwrap();
            }
            (i, s)
        });
    }
    let first = tokio::time::timeout(Duration::from_secs(60), writers.join_next()).await;
    assert!(first.is_ok(), "neither message was read as it came");
    let second = tokio::time::timeout(Duration::from_secs(2), writers.join_next()).await;
    assert!(second.is_err(), "a second 40 MiB message was read beside the first: over the lane's budget");
}

/// A member sends four 64 MiB messages nobody asked for, on one stream, to a rank whose
/// unmatched-message limit is 16 MiB. The rank reads the first (an empty store takes any one
/// message) and leaves the others unread until they are asked for, so its resident memory
/// grows by one message, not more (before, a second was read and parked). Asked for, all four
/// arrive intact, and the cluster carries on.
#[test]
fn messages_nobody_asked_for_cost_no_more_memory_than_the_limits() {
    alone(
        module_path!(),
        "messages_nobody_asked_for_cost_no_more_memory_than_the_limits",
        messages_nobody_asked_for_cost_no_more_memory_than_the_limits_body,
    );
}

/// Two ranks whose unmatched-message limit is 16 MiB, and rank 1's connection to rank 0.
async fn two_ranks_with_16_mib_limits() -> (Vec<NexarClient>, quinn::Connection) {
    let cfg = NexarConfig::builder().max_unmatched_bytes(16 << 20).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    let conn = HostileMember::new(&ranks[1]).link(0).unwrap().connection().clone();
    (ranks, conn)
}

/// The frames that announce a point-to-point message of `len` payload bytes of `dtype`.
fn p2p_head(comm: u64, tag: u64, dtype: nexar::DType, len: u64) -> Bytes {
    let count = len / dtype.size() as u64;
    let msg = PeerMsg::P2p { comm, tag, dtype: dtype.to_wire(), count };
    Bytes::from([message_frame(&encode(&msg).unwrap()), raw_header(len)].concat())
}

async fn messages_nobody_asked_for_cost_no_more_memory_than_the_limits_body() {
    let (ranks, conn) = two_ranks_with_16_mib_limits().await;
    let len: u64 = 64 << 20;
    let chunk = Bytes::from(vec![7u8; 1 << 20]);
    let comm = ranks[0].comm_id();
    let before = resident_bytes();
    let mut stream = conn.open_uni().await.unwrap();
    let writer = tokio::spawn(async move {
        for tag in 1..=4u64 {
            stream.write_all(&p2p_head(comm, tag, nexar::DType::U8, len)).await.unwrap();
            for _ in 0..len >> 20 {
                stream.write_chunk(chunk.clone()).await.unwrap();
            }
        }
        stream
    });
    // Watch the peak for a while: the writer stalls once the second message waits unread.
    let mut peak = 0;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(resident_bytes().saturating_sub(before));
    }
    assert!(!writer.is_finished(), "all four messages were read though nobody asked for them");
    let mib = |b: u64| b >> 20;
    assert!(
        peak < len + (32 << 20),
        "resident memory grew by {} MiB for one {} MiB message the limits allow",
        mib(peak),
        mib(len)
    );
    for tag in 1..=4u64 {
        let got =
            tokio::time::timeout(Duration::from_secs(60), ranks[0].recv_vec::<u8>(1, tag)).await.unwrap().unwrap();
        assert!(got.len() as u64 == len && got.iter().all(|b| *b == 7), "message {tag}");
    }
    drop(writer.await.unwrap());
    let sums = futures_all(&ranks).await;
    assert!(sums.iter().all(|s| *s == 3), "{sums:?}");
}

/// A member sends a 64 MiB message on a key a receive waits on for 4 bytes, while the
/// unmatched-message limits are full: it is not read for that receive (which asked for 4
/// bytes), so it waits unread, the member's link pauses, the receive fails with the limits'
/// error, and the rank's memory stays put.
#[test]
fn a_waiting_receive_admits_no_more_than_it_asked_for() {
    alone(
        module_path!(),
        "a_waiting_receive_admits_no_more_than_it_asked_for",
        a_waiting_receive_admits_no_more_than_it_asked_for_body,
    );
}

async fn a_waiting_receive_admits_no_more_than_it_asked_for_body() {
    let (ranks, conn) = two_ranks_with_16_mib_limits().await;
    let comm = ranks[0].comm_id();
    // Fill the store first: one 16 MiB message nobody asks for.
    let filler = vec![1u8; 16 << 20];
    ranks[1].send(&filler[..], 0, 1).await.unwrap();
    let receiver = ranks[0].clone();
    let mut small = [0u32; 1];
    let recv =
        tokio::spawn(
            async move { tokio::time::timeout(Duration::from_secs(3), receiver.recv(&mut small[..], 1, 2)).await },
        );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = resident_bytes();
    let len: u64 = 64 << 20;
    let head = p2p_head(comm, 2, nexar::DType::U32, len);
    let mut stream = conn.open_uni().await.unwrap();
    let writer = tokio::spawn(async move {
        stream.write_all(&head).await.unwrap();
        let chunk = Bytes::from(vec![9u8; 1 << 20]);
        for _ in 0..len >> 20 {
            if stream.write_chunk(chunk.clone()).await.is_err() {
                break;
            }
        }
    });
    match recv.await.unwrap() {
        Ok(Err(nexar::P2pError::TooManyUnmatched { .. })) | Err(_) => {}
        other => panic!("a 4-byte receive should not take a 64 MiB message: {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = resident_bytes().saturating_sub(before);
    assert!(grown < 32 << 20, "resident memory grew by {} MiB for a message nobody could take", grown >> 20);
    assert!(!writer.is_finished(), "the 64 MiB message was read");
    writer.abort();
}

/// A member announces an RPC request larger than the rank's RPC limit: the rank reads none of
/// it, cuts the member with an error that names the length and the limit, and the member sees
/// its link closed for that reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpc_request_over_the_limit_cuts_the_member_that_sent_it() {
    let cfg = NexarConfig::builder().max_rpc_bytes(1 << 20).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    let mut watch = ranks[0].failure_watch();
    let member = HostileMember::new(&ranks[1]);
    let link = member.link(0).unwrap();
    let huge = PeerMsg::RpcRequest { req: 1, func: 1, sig: 1, len: 2 << 20 };
    let _ = link.send(&huge, Some(Bytes::from(vec![0u8; 2 << 20]))).await;
    let closed = tokio::time::timeout(Duration::from_secs(30), link.connection().closed()).await.unwrap();
    let text = closed.to_string();
    let (len, limit) = ((2u64 << 20).to_string(), (1u64 << 20).to_string());
    assert!(text.contains(&len) && text.contains(&limit), "{text}");
    // The failure the cutting rank reports (and tells the others) names the violation too, not
    // only that the connection was closed.
    let failure = tokio::time::timeout(Duration::from_secs(30), watch.next()).await.unwrap().expect("a failure");
    assert_eq!(failure.rank, 1);
    let why = &failure.reason;
    assert!(why.contains("breaking the wire protocol") && why.contains(&len) && why.contains(&limit), "{why}");
}

/// Among few survivors the majority is of those still alive: rank 0 has counted ranks 2 and
/// 3 as dead, so when rank 1, its one live peer, cuts it, rank 0 leaves (rather than both
/// sides carrying on alone, each counting the other as gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_majority_that_excludes_a_rank_counts_only_its_live_peers() {
    let ranks = NexarClient::bootstrap_local(4).await.unwrap();
    let watch = ranks[0].failure_watch();
    for dead in [2, 3] {
        ranks[0].report_failure(dead, "gone, for the test").unwrap();
    }
    HostileMember::new(&ranks[1]).declare_dead(0, "rank 1 declared rank 0 dead: silent").unwrap();
    tokio::time::timeout(Duration::from_secs(30), async {
        while watch.excluded().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("rank 0 leaves when its only live peer cuts it");
    let why = watch.excluded().unwrap();
    assert!(why.contains("1 of this rank's 1 peers cut it"), "{why}");
}

/// Rank 2 floods rank 0 with 1 MiB messages nobody asked for, past the unmatched-message
/// limits (16 MiB: 4 MiB reserved for each sender, 8 MiB of pool). It fills its own share and
/// the pool, and then only its own link pauses: rank 1's message on a tag rank 0 has not asked
/// for yet is still held (in rank 1's share), so rank 0 can take rank 1's later message first.
/// Every flooded message arrives intact once asked for, and the cluster carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unmatched_messages_pauses_only_the_member_that_sent_it() {
    let cfg = NexarConfig::builder().max_unmatched_bytes(16 << 20).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
    let mib = |v: u32| vec![v; 1 << 18];
    let flooding = {
        let member = ranks[2].clone();
        tokio::spawn(async move {
            for tag in 100..140u64 {
                member.send(&mib(tag as u32)[..], 0, tag).await.unwrap();
            }
        })
    };
    // Let the flood fill what rank 2 may hold.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!flooding.is_finished(), "40 MiB of unmatched messages were all taken");
    let honest = ranks[1].clone();
    let sent = tokio::spawn(async move {
        honest.send(&mib(7)[..], 0, 7).await.unwrap();
        honest.send(&mib(8)[..], 0, 8).await.unwrap();
    });
    let limit = Duration::from_secs(60);
    let eight = tokio::time::timeout(limit, ranks[0].recv_vec::<u32>(1, 8)).await.unwrap().unwrap();
    let seven = tokio::time::timeout(limit, ranks[0].recv_vec::<u32>(1, 7)).await.unwrap().unwrap();
    assert!(eight == mib(8) && seven == mib(7), "rank 1's messages arrived changed");
    sent.await.unwrap();
    for tag in 100..140u64 {
        let got = tokio::time::timeout(limit, ranks[0].recv_vec::<u32>(2, tag)).await.unwrap().unwrap();
        assert!(got == mib(tag as u32), "flooded message {tag}");
    }
    flooding.await.unwrap();
    let sums = futures_all(&ranks).await;
    assert!(sums.iter().all(|s| *s == 6), "{sums:?}");
}

/// Rank 2 announces a 3 GiB point-to-point message to rank 0 (within the message limit, far
/// over the 16 MiB unmatched-message limits), sends 8 MiB of it and stalls. Rank 0, whose store
/// was empty, admits it and reads what comes (no more: nothing allocates 3 GiB), and charges it
/// to rank 2's share and the pool only. Rank 2's link is the one that pauses: its next message,
/// which nobody asked for, is not taken, and a receive from it on another tag fails with the
/// limits' error (which names both limits). Rank 1's messages on tags 50 and 51 are still taken
/// in its own share, so rank 0 receives 51 first and then 50 (before, 50 waited unread behind
/// the 3 GiB, and the receive of 51 failed with that error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_oversized_message_pauses_only_the_member_that_announced_it() {
    let unmatched: u64 = 16 << 20;
    let cfg = NexarConfig::builder()
        .max_unmatched_bytes(unmatched)
        .max_message_bytes(nexar::proto::frame::MAX_FRAME_LEN)
        .build()
        .unwrap();
    let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
    let limit = Duration::from_secs(60);
    let comm = ranks[0].comm_id();
    let conn = HostileMember::new(&ranks[2]).link(0).unwrap().connection().clone();
    let mut stream = conn.open_uni().await.unwrap();
    stream.write_all(&p2p_head(comm, 1, nexar::DType::U8, 3 << 30)).await.unwrap();
    // More than QUIC's windows hold unread: these writes finish only once rank 0 reads them,
    // that is once it has admitted the 3 GiB message.
    let chunk = Bytes::from(vec![3u8; 1 << 20]);
    tokio::time::timeout(limit, async {
        for _ in 0..8 {
            stream.write_chunk(chunk.clone()).await.unwrap();
        }
    })
    .await
    .expect("rank 0 did not admit the 3 GiB message its empty store may take");

    // Rank 2's next message finds its share and the pool taken: its link pauses, and a receive
    // from it on another tag fails at once.
    ranks[2].send(&[2u32][..], 0, 2).await.unwrap();
    let mut one = [0u32; 1];
    match tokio::time::timeout(limit, ranks[0].recv(&mut one[..], 2, 3)).await.unwrap() {
        Err(e @ nexar::P2pError::TooManyUnmatched { rank: 0, src: 2, tag: 3, .. }) => {
            let text = e.to_string();
            assert!(text.contains(&format!("NEXAR_MAX_UNMATCHED_BYTES {unmatched}")), "{text}");
            assert!(text.contains("NEXAR_MAX_UNMATCHED_MESSAGES 1024"), "{text}");
        }
        other => panic!("a receive from the paused member should fail with the limits' error: {other:?}"),
    }

    // Rank 1 sends tags 50 and 51; rank 0 asks for 51 first, so 50 is held meanwhile.
    let honest = ranks[1].clone();
    let (fifty, fifty_one) = (vec![50u32; 1 << 16], vec![51u32; 1 << 16]);
    let sent = {
        let (fifty, fifty_one) = (fifty.clone(), fifty_one.clone());
        tokio::spawn(async move {
            honest.send(&fifty[..], 0, 50).await.unwrap();
            honest.send(&fifty_one[..], 0, 51).await.unwrap();
        })
    };
    let got = tokio::time::timeout(limit, ranks[0].recv_vec::<u32>(1, 51)).await.unwrap();
    assert_eq!(got.expect("rank 1's tag 51, while rank 2's 3 GiB message hangs"), fifty_one);
    let got = tokio::time::timeout(limit, ranks[0].recv_vec::<u32>(1, 50)).await.unwrap();
    assert_eq!(got.expect("rank 1's tag 50, held while 51 was received"), fifty);
    tokio::time::timeout(limit, sent).await.unwrap().unwrap();

    // Asked for, rank 2's parked message comes.
    tokio::time::timeout(limit, ranks[0].recv(&mut one[..], 2, 2)).await.unwrap().unwrap();
    assert_eq!(one, [2]);
    // Cut rank 2's stalled stream rather than wait out its 3 GiB.
    drop(stream);
}
