//! What the tests of a hostile member's bulk channels share: the frames it crafts, the check
//! that groups nobody asked for cost no more memory than the limits allow, and the check that
//! the honest ranks carry on afterwards.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use nexar::NexarClient;
use nexar::hostile::take_collective_payload;
use nexar::proto::frame::{message_frame, raw_header};
use nexar::proto::message::{CollHeader, PeerMsg, encode};
use nexar::transport::bulk::BulkChannel;

use crate::common::{TEST_LIMIT, on_each, resident_bytes};

/// The frames of a `len`-byte broadcast message of collective `seq` (part 0), as the member
/// would send them before the payload.
pub fn coll_frames(comm: u64, seq: u64, len: u64) -> Bytes {
    let msg = PeerMsg::Coll {
        comm,
        seq,
        header: CollHeader {
            kind: 1,
            op: 1,
            dtype: nexar::DType::U8.to_wire(),
            root: 0,
            count: len,
            fingerprint: 0,
            segment: 0,
        },
        part: 0,
        len,
    };
    Bytes::from([message_frame(&encode(&msg).unwrap()), raw_header(len)].concat())
}

/// Every rank sums 4 MiB (enough to take a bulk channel where one still works): the result
/// is exact on every rank.
pub async fn carries_on(ranks: &[NexarClient]) {
    let n = ranks.len() as u32;
    let sums = on_each(ranks, |c| async move {
        let mut v = vec![c.rank() as u32 + 1; 1 << 20];
        tokio::time::timeout(TEST_LIMIT, c.all_reduce(&mut v[..], nexar::Sum)).await.unwrap().unwrap();
        v
    })
    .await;
    for (rank, v) in sums.iter().enumerate() {
        assert!(v.iter().all(|x| *x == n * (n + 1) / 2), "rank {rank}'s sum after the member's attempt");
    }
}

/// The frames of point-to-point segment `index` of message 77 (tag 5), before its payload.
fn segment_frames(comm: u64, index: u32, count: u64, total: u64) -> Bytes {
    let msg = PeerMsg::P2pSegment { comm, tag: 5, dtype: nexar::DType::U8.to_wire(), count, total, id: 77, index };
    Bytes::from([message_frame(&encode(&msg).unwrap()), raw_header(count)].concat())
}

/// The member (rank 1) sends point-to-point messages in segments that do not hold together
/// on its bulk channel to rank 0: a first segment that announces far more than the message
/// limit (refused before anything is allocated for it) and a later segment of another length
/// than announced. Each receive fails with an error naming the sender and what was wrong; the
/// ranks carry on.
pub async fn segments_that_do_not_hold_together_are_refused(ranks: &[NexarClient]) {
    let comm = ranks[0].comm_id();
    let link = nexar::hostile::HostileMember::new(&ranks[1]).bulk_channel(0).unwrap();
    let send = |frames: Bytes, payload: Vec<u8>| {
        let link = link.clone();
        async move { tokio::time::timeout(TEST_LIMIT, link.send(vec![frames, Bytes::from(payload)])).await.unwrap() }
    };
    send(segment_frames(comm, 0, 16, 1 << 50), vec![1; 16]).await.unwrap();
    let err = tokio::time::timeout(TEST_LIMIT, ranks[0].recv_vec::<u8>(1, 5)).await.unwrap().unwrap_err();
    assert!(matches!(err, nexar::P2pError::BadSegments { src: 1, .. }), "{err}");
    assert!(err.to_string().contains("message limit"), "{err}");
    send(segment_frames(comm, 0, 16, 40), vec![2; 16]).await.unwrap();
    send(segment_frames(comm, 1, 10, 0), vec![3; 10]).await.unwrap();
    let mut buf = [0u8; 40];
    let err = tokio::time::timeout(TEST_LIMIT, ranks[0].recv(&mut buf[..], 1, 5)).await.unwrap().unwrap_err();
    assert!(matches!(err, nexar::P2pError::BadSegments { src: 1, .. }), "{err}");
    assert!(err.to_string().contains("segment 1 as 10"), "{err}");
    carries_on(ranks).await;
}

/// Has `channel`, the member's bulk channel to rank 0, send eight `len`-byte groups of
/// collectives 1000–1007 that nobody asked for. Watches this process's resident memory for 3 s:
/// the member must stall (rank 0 leaves all but what its limits allow unread) and the memory
/// grow by less than `limit`. Then asks for every group, which must arrive whole, and checks
/// that the cluster carries on.
pub async fn unasked_groups_cost_less_than(ranks: &[NexarClient], channel: Arc<dyn BulkChannel>, len: u64, limit: u64) {
    let comm = ranks[0].comm_id();
    let payload = Bytes::from((0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let group = |seq: u64| vec![coll_frames(comm, seq, len), payload.clone()];
    let groups: Vec<Vec<Bytes>> = (1000..1008).map(group).collect();
    let before = resident_bytes();
    let writer = tokio::spawn(async move {
        for frames in groups {
            channel.send(frames).await.unwrap();
        }
    });
    // Watch the peak for a while: the member stalls once the second group waits unread.
    let mut peak = 0;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(resident_bytes().saturating_sub(before));
    }
    assert!(!writer.is_finished(), "all eight groups were read though nobody asked for them");
    assert!(
        peak < limit,
        "resident memory grew by {} MiB for groups of {} MiB that the limits allow one of",
        peak >> 20,
        len >> 20
    );
    for seq in 1000..1008u64 {
        let got = take_collective_payload(&ranks[0], 1, seq, len, Duration::from_secs(60)).await.unwrap();
        assert!(got.len() as u64 == len && got[..] == payload[..], "group {seq} arrived changed");
    }
    tokio::time::timeout(Duration::from_secs(60), writer).await.unwrap().unwrap();
    carries_on(ranks).await;
}
