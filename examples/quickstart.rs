//! Quick start: a 4-rank cluster in this process, connected by real encrypted QUIC on
//! 127.0.0.1. Every rank holds a "gradient" and all-reduces it, broadcasts a learning rate
//! from rank 0, and meets the others at a barrier.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use nexar::prelude::*;

const RANKS: usize = 4;
const LEN: usize = 1 << 20;

#[tokio::main]
async fn main() -> Result<(), NexarError> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let start = std::time::Instant::now();
    // ANCHOR: form
    let ranks = NexarClient::bootstrap_local(RANKS).await?;
    println!("formed a {RANKS}-rank cluster over QUIC in {:?}", start.elapsed());
    // ANCHOR_END: form

    let mut tasks = tokio::task::JoinSet::new();
    for comm in ranks {
        tasks.spawn(async move {
            let me = comm.rank();
            // Rank r's gradient is r + 1 everywhere; the sum is 1 + 2 + ... + world.
            // ANCHOR: collectives
            let mut grads: Buf<f32> = Buf::from_vec(vec![(me + 1) as f32; LEN]);
            let t = std::time::Instant::now();
            comm.all_reduce(&mut grads, Sum).await?;
            let took = t.elapsed();

            let mut lr = [if me == 0 { 0.01f64 } else { 0.0 }];
            comm.broadcast(&mut lr, 0).await?;
            comm.barrier().await?;
            // ANCHOR_END: collectives
            let rtt = comm.ping((me + 1) % RANKS).await?;
            comm.shutdown().await;
            Ok::<_, NexarError>((me, grads[0], grads[LEN - 1], lr[0], took, rtt))
        });
    }
    let expected = (RANKS * (RANKS + 1) / 2) as f32;
    let mut results = Vec::new();
    while let Some(done) = tasks.join_next().await {
        results.push(done.expect("rank task panicked")?);
    }
    results.sort_by_key(|r| r.0);
    for (rank, first, last, lr, took, rtt) in results {
        assert_eq!((first, last, lr), (expected, expected, 0.01));
        println!(
            "rank {rank}: all_reduce of {LEN} f32 = {first} (expected {expected}) in {took:?}; lr = {lr}; ping {rtt:?}"
        );
    }
    println!("done in {:?}", start.elapsed());
    Ok(())
}
