//! In-process clusters over real QUIC on 127.0.0.1: typed messages of many dtypes and sizes,
//! tag matching, and every error case of send/recv.

use std::time::Duration;

use nexar::prelude::*;
use nexar::{ClusterError, P2pError, bf16, f16};

use crate::common::{TEST_LIMIT, logs, pattern, same_bytes};

const MIB: usize = 1 << 20;

/// One message of a test: its element type and length, produced by `send` and checked by `recv`.
#[derive(Clone, Copy, Debug)]
enum Case {
    F32(usize),
    F64(usize),
    F16(usize),
    BF16(usize),
    I8(usize),
    I32(usize),
    I64(usize),
    U8(usize),
    U16(usize),
    U64(usize),
}

fn seed(src: usize, dst: usize, tag: u64) -> u64 {
    (src as u64) << 40 | (dst as u64) << 20 | tag
}

macro_rules! each_case {
    ($case:expr, $len:ident, $t:ident => $body:expr) => {
        match $case {
            Case::F32($len) => {
                type $t = f32;
                $body
            }
            Case::F64($len) => {
                type $t = f64;
                $body
            }
            Case::F16($len) => {
                type $t = f16;
                $body
            }
            Case::BF16($len) => {
                type $t = bf16;
                $body
            }
            Case::I8($len) => {
                type $t = i8;
                $body
            }
            Case::I32($len) => {
                type $t = i32;
                $body
            }
            Case::I64($len) => {
                type $t = i64;
                $body
            }
            Case::U8($len) => {
                type $t = u8;
                $body
            }
            Case::U16($len) => {
                type $t = u16;
                $body
            }
            Case::U64($len) => {
                type $t = u64;
                $body
            }
        }
    };
}

async fn send_case(c: &NexarClient, case: Case, dst: usize, tag: u64) -> Result<(), NexarError> {
    let src = c.rank();
    each_case!(case, len, T => {
        let data: Vec<T> = pattern(len, seed(src, dst, tag));
        c.send(&data, dst, tag).await?;
    });
    Ok(())
}

async fn recv_case(c: &NexarClient, case: Case, src: usize, tag: u64) -> Result<(), NexarError> {
    let dst = c.rank();
    each_case!(case, len, T => {
        let mut got = Buf::<T>::zeros(len);
        c.recv(&mut got, src, tag).await?;
        let want: Vec<T> = pattern(len, seed(src, dst, tag));
        assert!(same_bytes(&got, &want), "rank {dst}: {case:?} from rank {src} tag {tag} corrupted");
    });
    Ok(())
}

/// Every rank sends every case to each peer in `pairs(rank)`, and receives them back in reverse
/// tag order, so each message must wait for its own `recv`.
async fn exchange(ranks: Vec<NexarClient>, cases: Vec<Case>, peers: fn(usize, usize) -> Vec<usize>) {
    let world = ranks.len();
    let mut tasks = tokio::task::JoinSet::new();
    for c in ranks {
        let cases = cases.clone();
        tasks.spawn(async move {
            let me = c.rank();
            let to = peers(me, world);
            let from: Vec<usize> = (0..world).filter(|r| peers(*r, world).contains(&me)).collect();
            let sends = async {
                for &dst in &to {
                    for (tag, case) in cases.iter().enumerate() {
                        send_case(&c, *case, dst, tag as u64).await?;
                    }
                }
                Ok::<_, NexarError>(())
            };
            let recvs = async {
                for &src in &from {
                    for (tag, case) in cases.iter().enumerate().rev() {
                        recv_case(&c, *case, src, tag as u64).await?;
                    }
                }
                Ok::<_, NexarError>(())
            };
            let (s, r) = tokio::join!(sends, recvs);
            s.and(r).map(|_| c)
        });
    }
    let mut done = Vec::new();
    while let Some(r) = tasks.join_next().await {
        done.push(r.expect("rank task panicked").expect("exchange failed"));
    }
    shutdown_all(done).await;
}

/// Shuts every rank down at once: `shutdown` waits for every peer's goodbye, so ranks of one
/// process must not do it one after another.
async fn shutdown_all(ranks: Vec<NexarClient>) {
    let mut set = tokio::task::JoinSet::new();
    for c in ranks {
        set.spawn(async move { c.shutdown().await });
    }
    while set.join_next().await.is_some() {}
}

fn all_others(me: usize, world: usize) -> Vec<usize> {
    (0..world).filter(|r| *r != me).collect()
}

fn ring_next(me: usize, world: usize) -> Vec<usize> {
    vec![(me + 1) % world]
}

fn small_and_medium() -> Vec<Case> {
    vec![
        Case::F32(0),
        Case::U8(1),
        Case::I8(3),
        Case::F16(17),
        Case::BF16(1000),
        Case::U16(4097),
        Case::I32(65_537),
        Case::F64(100_000),
        Case::I64(MIB / 8 + 1),
        Case::U64(MIB / 4),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_exchange_every_dtype_from_0_bytes_to_64_mib() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(2).await.unwrap();
        let mut cases = small_and_medium();
        cases.push(Case::F32(16 * MIB)); // 64 MiB
        exchange(ranks, cases, all_others).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_ranks_exchange_all_pairs_and_64_mib_around_a_ring() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(3).await.unwrap();
        exchange(ranks.clone(), small_and_medium(), all_others).await;
        let ranks = NexarClient::bootstrap_local(3).await.unwrap();
        exchange(ranks, vec![Case::U8(64 * MIB)], ring_next).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_ranks_exchange_all_pairs_and_64_mib_around_a_ring() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(8).await.unwrap();
        let cases = vec![Case::F32(0), Case::U8(1), Case::BF16(333), Case::F64(10_000), Case::I32(65_536)];
        exchange(ranks, cases, all_others).await;
        let ranks = NexarClient::bootstrap_local(8).await.unwrap();
        exchange(ranks, vec![Case::F64(8 * MIB)], ring_next).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tags_are_matched_out_of_order_and_same_tag_messages_keep_their_order() {
    logs();
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let (a, b) = (&ranks[0], &ranks[1]);
    for tag in [1u64, 2, 3, u64::MAX] {
        a.send(&[tag as u32; 4], 1, tag).await.unwrap();
    }
    for i in 0..100u32 {
        a.send(&[i], 1, 50).await.unwrap();
    }
    let mut buf = [0u32; 4];
    for tag in [u64::MAX, 3, 1, 2] {
        b.recv(&mut buf, 0, tag).await.unwrap();
        assert_eq!(buf, [tag as u32; 4]);
    }
    for i in 0..100u32 {
        let mut one = [0u32];
        b.recv(&mut one, 0, 50).await.unwrap();
        assert_eq!(one[0], i, "same-tag messages overtook each other");
    }
    // Concurrent receives on different tags from one sender.
    let waiters = tokio::spawn({
        let b = b.clone();
        async move {
            let (x, y) = tokio::join!(b.recv_vec::<i64>(0, 11), b.recv_vec::<i64>(0, 10));
            (x.unwrap(), y.unwrap())
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    a.send(&vec![10i64; 3], 1, 10).await.unwrap();
    a.send(&vec![11i64; 5], 1, 11).await.unwrap();
    let (x, y) = waiters.await.unwrap();
    assert_eq!((x, y), (vec![11; 5], vec![10; 3]));
    shutdown_all(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_rank_cluster_sends_to_itself_and_zero_ranks_is_an_error() {
    let err = NexarClient::bootstrap_local(0).await.unwrap_err();
    assert!(matches!(err, NexarError::Cluster(ClusterError::InvalidWorldSize(0))), "{err}");
    let ranks = NexarClient::bootstrap_local(1).await.unwrap();
    let me = &ranks[0];
    assert_eq!((me.rank(), me.world_size()), (0, 1));
    me.send(&Buf::from_vec(vec![1.5f32, -2.0]), 0, 9).await.unwrap();
    let mut back = [0f32; 2];
    me.recv(&mut back, 0, 9).await.unwrap();
    assert_eq!(back, [1.5, -2.0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatches_are_clear_errors_and_keep_the_message() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let (a, b) = (&ranks[0], &ranks[1]);

    let e = a.send(&[1u8], 2, 0).await.unwrap_err();
    assert_eq!(e, P2pError::InvalidRank { rank: 0, op: "send", peer: 2, world: 2 });
    assert!(e.to_string().contains("peer rank 2 does not exist (world size 2)"), "{e}");
    let e = b.recv(&mut [0u8], 7, 0).await.unwrap_err();
    assert!(matches!(e, P2pError::InvalidRank { op: "recv", peer: 7, .. }), "{e}");

    a.send(&vec![7i32; 10], 1, 5).await.unwrap();
    let e = b.recv(&mut vec![0i32; 9], 0, 5).await.unwrap_err();
    assert_eq!(e, P2pError::LengthMismatch { rank: 1, src: 0, tag: 5, expected: 9, got: 10 });
    let e = b.recv(&mut vec![0f32; 10], 0, 5).await.unwrap_err();
    assert_eq!(e, P2pError::DTypeMismatch { rank: 1, src: 0, tag: 5, expected: DType::F32, got: DType::I32 });
    assert!(e.to_string().contains("the message holds i32 elements, the buffer is f32"), "{e}");
    let e = b.recv_vec::<u64>(0, 5).await.unwrap_err();
    assert!(matches!(e, P2pError::DTypeMismatch { expected: DType::U64, .. }), "{e}");
    // Nothing was lost: the right receive still gets the message.
    let mut right = vec![0i32; 10];
    b.recv(&mut right, 0, 5).await.unwrap();
    assert_eq!(right, vec![7; 10]);

    let cfg = NexarConfig::builder().max_message_bytes(1024).build().unwrap();
    let small = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    let e = small[0].send(&vec![0u64; 129], 1, 0).await.unwrap_err();
    assert!(matches!(e, P2pError::TooLarge { bytes: 1032, limit: 1024, .. }), "{e}");
    small[0].send(&vec![0u64; 128], 1, 0).await.unwrap();
    assert_eq!(small[1].recv_vec::<u64>(0, 0).await.unwrap().len(), 128);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_messages_are_bounded_and_none_is_lost() {
    let cfg = NexarConfig::builder().max_unmatched_messages(4).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    let (a, b) = (&ranks[0], &ranks[1]);
    for tag in 0..6u64 {
        a.send(&[tag as u16; 8], 1, tag).await.unwrap();
    }
    // Four are held, the fifth waits at the limit: a receive that none of them matches fails
    // promptly with a clear error instead of waiting for its timeout.
    let e = tokio::time::timeout(Duration::from_secs(30), b.recv(&mut [0u16; 8], 0, 99))
        .await
        .expect("an unmatchable receive at the limit must fail, not wait")
        .unwrap_err();
    assert!(matches!(e, P2pError::TooManyUnmatched { rank: 1, src: 0, tag: 99, held: 4, limit: 4, .. }), "{e}");
    // The error names both limits with their values (the bytes' is the default, 1 GiB).
    let text = e.to_string();
    assert!(text.contains("NEXAR_MAX_UNMATCHED_MESSAGES 4"), "{e}");
    assert!(text.contains("NEXAR_MAX_UNMATCHED_BYTES 1073741824"), "{e}");
    // Receiving a held message makes room; the paused lane resumes and every message is
    // still there, in any order the receiver likes.
    for tag in [0u64, 5, 4, 3, 2, 1] {
        let mut got = [0u16; 8];
        b.recv(&mut got, 0, tag).await.unwrap();
        assert_eq!(got, [tag as u16; 8]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_cancelled_receives_lose_nothing() {
    let cfg = NexarConfig::builder().op_timeout(Duration::from_millis(300)).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    let (a, b) = (&ranks[0], &ranks[1]);
    let e = b.recv(&mut [0u8; 4], 0, 1).await.unwrap_err();
    assert!(matches!(e, P2pError::Timeout { rank: 1, op: "recv", peer: 0, tag: 1, .. }), "{e}");
    // A receive abandoned half-way (its future dropped) gives its message back.
    let abandoned = tokio::time::timeout(Duration::from_millis(20), b.recv_vec::<u8>(0, 2)).await;
    assert!(abandoned.is_err());
    a.send(&[4u8, 5, 6], 1, 2).await.unwrap();
    assert_eq!(b.recv_vec::<u8>(0, 2).await.unwrap(), vec![4, 5, 6]);
    // Many receives cancelled while messages are arriving: every message still arrives once.
    for round in 0..50u32 {
        let b2 = b.clone();
        let racer =
            tokio::spawn(
                async move { tokio::time::timeout(Duration::from_micros(200), b2.recv_vec::<u32>(0, 3)).await },
            );
        a.send(&[round], 1, 3).await.unwrap();
        match racer.await.unwrap() {
            Ok(got) => assert_eq!(got.unwrap(), vec![round]),
            Err(_) => assert_eq!(b.recv_vec::<u32>(0, 3).await.unwrap(), vec![round]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_answer_pings_and_config_is_validated() {
    let ranks = NexarClient::bootstrap_local(3).await.unwrap();
    for c in &ranks {
        for p in 0..3 {
            if p != c.rank() {
                c.ping(p).await.unwrap();
            }
        }
    }
    // The builder refuses it; a config assigned field by field is checked when the cluster forms.
    let built = NexarConfig::builder().max_message_bytes(0).build().unwrap_err();
    assert!(built.to_string().contains("NEXAR_MAX_MESSAGE_BYTES"), "{built}");
    let mut cfg = NexarConfig::default();
    cfg.max_message_bytes = 0;
    let err = NexarClient::bootstrap_local_with(2, cfg).await.unwrap_err();
    assert!(err.to_string().contains("NEXAR_MAX_MESSAGE_BYTES"), "{err}");
}
