//! What the tests of a hostile member's bulk channels share: the frames it crafts, and the
//! check that the honest ranks carry on afterwards.

use bytes::Bytes;
use nexar::NexarClient;
use nexar::proto::frame::{message_frame, raw_header};
use nexar::proto::message::{CollHeader, PeerMsg, encode};

use crate::common::{TEST_LIMIT, on_each};

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
