//! `#[nexar::rpc]` over real QUIC: typed calls and typed handler errors, plain and async
//! functions, self-calls, `call_all`, 10,000 concurrent calls, and every `RpcError` case.

use std::time::Duration;

use nexar::RpcError;
use nexar::prelude::*;

use crate::common::{TEST_LIMIT, logs};

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq)]
pub enum ShardError {
    Missing(u32),
}

/// Loads `offset` bytes of shard `id` (the test's stand-in for real work).
#[nexar::rpc]
async fn load_shard(id: u32, offset: u64) -> Result<Vec<u8>, ShardError> {
    if id == 404 { Err(ShardError::Missing(id)) } else { Ok(vec![id as u8; offset as usize]) }
}

/// A plain (non-async) function.
#[nexar::rpc]
fn add(a: i64, b: i64) -> i64 {
    a + b
}

#[nexar::rpc]
async fn whoami(tag: String) -> String {
    format!("{tag}:{}", std::process::id())
}

#[nexar::rpc]
async fn explode(message: String) -> u32 {
    panic!("{message}")
}

#[nexar::rpc]
async fn sleepy(ms: u64) -> u64 {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    ms
}

/// Arguments named like the stubs' own locals (`world`, `peer`, `client`, `parts`).
#[nexar::rpc]
async fn echo_names(world: u64, peer: u64, client: u64, parts: u64) -> (u64, u64, u64, u64) {
    (world, peer, client, parts)
}

#[nexar::rpc(id = 4242)]
async fn pinned() -> u64 {
    7
}

async fn shutdown_all(ranks: Vec<NexarClient>) {
    let tasks: Vec<_> = ranks.into_iter().map(|c| tokio::spawn(async move { c.shutdown().await })).collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_calls_return_typed_results_and_typed_errors() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(3).await.unwrap();
        let c = &ranks[0];
        assert_eq!(load_shard::call(c, 1, 7, 3).await.unwrap(), Ok(vec![7u8; 3]));
        assert_eq!(load_shard::call(c, 2, 404, 0).await.unwrap(), Err(ShardError::Missing(404)));
        assert_eq!(add::call(c, 2, 40, 2).await.unwrap(), 42);
        assert_eq!(add::call(c, 0, 1, 1).await.unwrap(), 2, "a call to oneself");
        assert_eq!(pinned::call(c, 1).await.unwrap(), 7);
        assert_eq!(pinned::ID, 4242);
        // Sent as given: not the world size, the peer, or anything else the stub holds.
        assert_eq!(echo_names::call(c, 1, 70, 71, 72, 73).await.unwrap(), (70, 71, 72, 73));
        for echoed in echo_names::call_all(c, 80, 81, 82, 83).await {
            assert_eq!(echoed.unwrap(), (80, 81, 82, 83));
        }
        let all = add::call_all(&ranks[1], 5, 5).await;
        assert_eq!(all.len(), 3);
        assert!(all.iter().all(|r| r.as_ref().ok() == Some(&10)));
        let names = whoami::call_all(c, "x".into()).await;
        assert!(names.iter().all(|n| n.as_ref().unwrap().starts_with("x:")));
        shutdown_all(ranks).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_concurrent_calls_are_all_matched() {
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(2).await.unwrap();
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..10_000i64 {
            let c = ranks[(i % 2) as usize].clone();
            let peer = 1 - (i % 2) as usize;
            calls.spawn(async move { (i, add::call(&c, peer, i, 1_000_000).await) });
        }
        let mut seen = 0;
        while let Some(done) = calls.join_next().await {
            let (i, r) = done.unwrap();
            assert_eq!(r.unwrap(), i + 1_000_000, "call {i} got another call's answer");
            seen += 1;
        }
        assert_eq!(seen, 10_000);
        shutdown_all(ranks).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_is_a_distinct_rpc_error_and_the_server_keeps_serving() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        // Long enough for a panicking handler's first backtrace on a busy machine, short
        // enough for the sleepy call below to time out quickly.
        let cfg = NexarConfig::builder().op_timeout(Duration::from_secs(5)).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
        let c = &ranks[0];

        let e = explode::call(c, 1, "boom".into()).await.unwrap_err();
        assert!(matches!(&e, RpcError::HandlerPanicked { peer: 1, message, .. } if message == "boom"), "{e}");
        assert_eq!(add::call(c, 1, 2, 3).await.unwrap(), 5, "the server keeps serving after a panic");

        let e = sleepy::call(c, 1, 120_000).await.unwrap_err();
        assert!(matches!(e, RpcError::Timeout { peer: 1, .. }), "{e}");

        let e = add::call(c, 9, 1, 1).await.unwrap_err();
        assert!(matches!(e, RpcError::InvalidPeer { peer: 9, world: 3, .. }), "{e}");

        // An id nobody serves, and a known id with another signature, as a caller built from
        // other code would send them.
        let args = nexar::__private::encode(&(1i64, 2i64)).unwrap();
        let e = c.__rpc_call(1, 0xdead_beef, 1, "gone", "fn()", args.clone()).await.unwrap_err();
        assert_eq!(e, RpcError::UnknownFunction { rank: 0, peer: 1, name: "gone" });
        assert!(e.to_string().contains("rank 1 has no `gone`"), "{e}");
        let e = c.__rpc_call(1, add::ID, add::SIG_HASH ^ 1, add::NAME, "fn(i32) -> i32", args).await.unwrap_err();
        assert!(matches!(e, RpcError::SignatureMismatch { peer: 1, .. }), "{e}");
        assert!(e.to_string().contains("with this signature"), "{e}");
        // Arguments that do not decode as the function's.
        let junk = nexar::__private::Bytes::from_static(b"not an archive");
        let e = c.__rpc_call(2, add::ID, add::SIG_HASH, add::NAME, add::SIGNATURE, junk).await.unwrap_err();
        assert!(matches!(e, RpcError::Codec { peer: 2, .. }), "{e}");

        // A peer that has left.
        let gone = ranks[2].clone();
        gone.shutdown().await;
        let e = add::call(c, 2, 1, 1).await.unwrap_err();
        assert!(matches!(e, RpcError::PeerLost { peer: 2, .. } | RpcError::Timeout { peer: 2, .. }), "{e}");
        assert_eq!(add::call(c, 1, 1, 1).await.unwrap(), 2);
    })
    .await
    .expect("test timed out");
}

#[test]
fn ids_are_stable_and_depend_on_path_name_and_signature() {
    assert_eq!(
        load_shard::ID,
        nexar::stable_id(&[concat!(module_path!(), "::load_shard"), "fn(u32,u64)->Result<Vec<u8>,ShardError>"])
    );
    assert_ne!(load_shard::ID, add::ID);
    assert_eq!(add::SIGNATURE, "fn(i64,i64)->i64");
    assert_eq!(load_shard::SIGNATURE, "fn(u32,u64)->Result<Vec<u8>,ShardError>");
    assert!(load_shard::NAME.ends_with("::load_shard"));
}

#[nexar::rpc]
async fn byte_count(data: Vec<u8>) -> u64 {
    data.len() as u64
}

/// `NEXAR_MAX_RPC_BYTES` bounds what one call carries: arguments over it fail at once with
/// `TooLarge`, an answer over it fails the call with the limit named, and calls within it
/// (many at once, more than the budget holds together) all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_bounded_by_the_rpc_byte_limit() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().max_rpc_bytes(1 << 20).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
        let big = vec![1u8; 2 << 20];
        match byte_count::call(&ranks[0], 1, big).await {
            Err(RpcError::TooLarge { peer: 1, limit, len, .. }) => assert!(limit == 1 << 20 && len > limit),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        match load_shard::call(&ranks[0], 1, 7, 2 << 20).await {
            Err(RpcError::Codec { what, .. }) => assert!(what.contains("NEXAR_MAX_RPC_BYTES"), "{what}"),
            other => panic!("expected the answer to be refused, got {other:?}"),
        }
        // 16 calls of 600 KiB at once: the budget holds one at a time, and all get through.
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..16 {
            let c = ranks[0].clone();
            calls.spawn(async move { byte_count::call(&c, 1, vec![2u8; 600 << 10]).await });
        }
        while let Some(got) = calls.join_next().await {
            assert_eq!(got.unwrap().unwrap(), 600 << 10);
        }
        assert_eq!(load_shard::call(&ranks[1], 0, 3, 1000).await.unwrap(), Ok(vec![3u8; 1000]));
        shutdown_all(ranks).await;
    })
    .await
    .expect("test timed out");
}
