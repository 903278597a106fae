//! RPC handlers that take the call's context (`RpcContext`: who called, a client to call back
//! with) and application state each rank provides (`State<T>`), over real QUIC.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use nexar::RpcError;
use nexar::prelude::*;
use nexar::rpc::{RpcContext, State};

use crate::common::{TEST_LIMIT, logs};

/// The caller's rank and the serving rank, from the context taken by reference.
#[nexar::rpc]
async fn who_calls(ctx: &RpcContext) -> (usize, usize) {
    (ctx.caller(), ctx.client().rank())
}

/// The same with the context taken by value, after an argument.
#[nexar::rpc]
fn who_calls_by_value(tag: u64, ctx: RpcContext) -> (u64, usize) {
    (tag, ctx.caller())
}

#[nexar::rpc]
fn double(x: u64) -> u64 {
    2 * x
}

/// Calls the caller back, through the context's client.
#[nexar::rpc]
async fn ask_back(ctx: &RpcContext, x: u64) -> Result<u64, String> {
    double::call(ctx.client(), ctx.caller(), x).await.map(|d| d + 1).map_err(|e| e.to_string())
}

/// A rank's counter, provided once, shared by every call.
struct Counter(AtomicU64);

/// Adds `by` to the serving rank's counter; returns the new total and the caller.
#[nexar::rpc]
async fn bump(ctx: &RpcContext, counter: State<Counter>, by: u64) -> (u64, usize) {
    (counter.0.fetch_add(by, Ordering::SeqCst) + by, ctx.caller())
}

/// Two kinds of state and an argument, in any order.
#[nexar::rpc]
fn label(prefix: State<String>, n: u64, seen: State<Mutex<Vec<u64>>>) -> String {
    seen.lock().unwrap().push(n);
    format!("{}-{n}", *prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_learn_who_called_and_can_call_back() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(3).await.unwrap();
        assert_eq!(who_calls::call(&ranks[1], 2).await.unwrap(), (1, 2));
        assert_eq!(who_calls::call(&ranks[0], 0).await.unwrap(), (0, 0), "a call to oneself");
        assert_eq!(who_calls_by_value::call(&ranks[2], 0, 9).await.unwrap(), (9, 2));
        let all = who_calls::call_all(&ranks[1]).await;
        let all: Vec<(usize, usize)> = all.into_iter().map(Result::unwrap).collect();
        assert_eq!(all, vec![(1, 0), (1, 1), (1, 2)]);
        // Rank 0 asks rank 2, whose handler asks rank 0 back.
        assert_eq!(ask_back::call(&ranks[0], 2, 20).await.unwrap(), Ok(41));
        // The context is not part of what a caller sends: the id is the argument-less one's.
        assert_eq!(who_calls::SIGNATURE, "fn()->(usize,usize)");
        assert_eq!(bump::SIGNATURE, "fn(u64)->(u64,usize)");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_share_the_state_their_rank_provides_and_a_rank_without_it_refuses() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local(3).await.unwrap();
        assert!(ranks[0].provide_state(Counter(AtomicU64::new(100))).is_none());
        // 50 concurrent calls from two ranks share rank 0's one counter.
        let mut calls = Vec::new();
        for i in 0..50u64 {
            let c = ranks[1 + (i % 2) as usize].clone();
            calls.push(tokio::spawn(async move { bump::call(&c, 0, 1).await }));
        }
        let mut totals = Vec::new();
        for call in calls {
            let (total, caller) = call.await.unwrap().unwrap();
            assert!(caller == 1 || caller == 2);
            totals.push(total);
        }
        totals.sort_unstable();
        assert_eq!(totals, (101..=150).collect::<Vec<u64>>(), "every call saw the one shared counter");

        // Rank 2 provides no counter: the call is refused, naming the rank and the type.
        match bump::call(&ranks[0], 2, 1).await {
            Err(RpcError::Refused { peer: 2, why, .. }) => {
                assert!(why.contains("rank 2") && why.contains("Counter"), "{why}");
            }
            other => panic!("a call needing state rank 2 lacks: {other:?}"),
        }
        // Provided later, it is there for the next call; replacing returns the old value.
        ranks[2].provide_state(Counter(AtomicU64::new(7)));
        assert_eq!(bump::call(&ranks[0], 2, 1).await.unwrap(), (8, 0));
        let old = ranks[2].provide_state(Counter(AtomicU64::new(0))).expect("the counter provided before");
        assert_eq!(old.0.load(Ordering::SeqCst), 8);

        for r in &ranks {
            r.provide_state(format!("rank{}", r.rank()));
            r.provide_state(Mutex::new(Vec::<u64>::new()));
        }
        assert_eq!(label::call(&ranks[0], 1, 5).await.unwrap(), "rank1-5");
        assert_eq!(label::call(&ranks[1], 1, 6).await.unwrap(), "rank1-6");
        let seen = ranks[1].provide_state(Mutex::new(Vec::<u64>::new())).unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![5, 6]);
    })
    .await
    .expect("test timed out");
}
