//! Quick start: a 4-rank cluster in this process, connected by real encrypted QUIC on
//! 127.0.0.1. Every rank holds a "gradient" and the ranks pass partial sums around a ring with
//! typed send/recv until every rank has the total.
//!
//! ```text
//! cargo run --release --example quickstart
//! ```

use nexar::prelude::*;

const RANKS: usize = 4;
const LEN: usize = 1 << 20;

#[tokio::main]
async fn main() -> Result<(), NexarError> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let start = std::time::Instant::now();
    let ranks = NexarClient::bootstrap_local(RANKS).await?;
    println!(
        "formed a {RANKS}-rank cluster over QUIC in {:?}",
        start.elapsed()
    );

    let mut tasks = tokio::task::JoinSet::new();
    for comm in ranks {
        tasks.spawn(async move {
            let (me, world) = (comm.rank(), comm.world_size());
            // Rank r's gradient is r + 1 everywhere; the total is 1 + 2 + ... + world.
            let grads: Buf<f32> = Buf::from_vec(vec![(me + 1) as f32; LEN]);
            let mut total = grads.clone();
            let mut passing = grads;
            let mut incoming = Buf::<f32>::zeros(LEN);
            let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
            for step in 0..world - 1 {
                let tag = step as u64;
                let (sent, got) = tokio::join!(
                    comm.send(&passing, next, tag),
                    comm.recv(&mut incoming, prev, tag)
                );
                sent?;
                got?;
                for (t, x) in total.iter_mut().zip(incoming.iter()) {
                    *t += *x;
                }
                std::mem::swap(&mut passing, &mut incoming);
            }
            let rtt = comm.ping(next).await?;
            comm.shutdown().await;
            Ok::<_, NexarError>((me, total[0], total[LEN - 1], rtt))
        });
    }
    let expected = (RANKS * (RANKS + 1) / 2) as f32;
    let mut results = Vec::new();
    while let Some(done) = tasks.join_next().await {
        results.push(done.expect("rank task panicked")?);
    }
    results.sort_by_key(|r| r.0);
    for (rank, first, last, rtt) in results {
        assert_eq!((first, last), (expected, expected));
        println!(
            "rank {rank}: sum of {LEN} gradients = {first} (expected {expected}); ping to next rank {rtt:?}"
        );
    }
    println!("done in {:?}", start.elapsed());
    Ok(())
}
