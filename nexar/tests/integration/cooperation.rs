//! A rank's operations give its runtime's other tasks their turn: a loop of receives whose
//! messages have all arrived (a sender far ahead) completes each at once, yet the rank's
//! heartbeats, lane readers and other tasks must still run, or its peers declare it dead.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use nexar::prelude::*;

/// Messages sent ahead of the receives: more than tokio's budget of 128 ready operations a
/// turn, well under the receiver's limit on unmatched messages.
const AHEAD: usize = 400;

/// Counts the turns a side task gets while `body` runs on this (single-threaded) runtime.
async fn turns_during<F: std::future::Future<Output = ()>>(body: F) -> usize {
    let turns = Arc::new(AtomicUsize::new(0));
    let counted = turns.clone();
    let side = tokio::spawn(async move {
        loop {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
        }
    });
    // Let the side task start before counting.
    tokio::task::yield_now().await;
    let before = turns.load(Ordering::SeqCst);
    body.await;
    let during = turns.load(Ordering::SeqCst) - before;
    side.abort();
    during
}

#[tokio::test(flavor = "current_thread")]
async fn a_loop_of_receives_that_are_ready_lets_the_other_tasks_run() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    for i in 0..AHEAD {
        ranks[0].send(&[i as u32][..], 1, 7).await.unwrap();
    }
    ranks[0].send(&[0u8][..], 1, 8).await.unwrap();
    // The marker comes after every message of tag 7; then give the readers time to take them all.
    let mut marker = [0u8];
    ranks[1].recv(&mut marker[..], 0, 8).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let turns = turns_during(async {
        for i in 0..AHEAD {
            let mut v = [0u32];
            ranks[1].recv(&mut v[..], 0, 7).await.unwrap();
            assert_eq!(v[0], i as u32);
        }
    })
    .await;
    assert!(turns > 0, "{AHEAD} ready receives in a row never let the runtime's other tasks run");
    for r in &ranks {
        r.shutdown().await;
    }
}
