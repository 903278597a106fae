//! `#[nexar::collective_plan]`: a training step's collectives as one fused plan, on a 3-rank
//! in-process cluster. Prints the plan and checks it gives what the separate calls give.
//!
//! ```text
//! cargo run --example plan
//! ```

use nexar::prelude::*;

// ANCHOR: plan
/// One step: average two gradient tensors, share the learning rate and step count from rank 0.
#[nexar::collective_plan]
async fn step(comm: &NexarClient, w1: &mut Buf<f32>, w2: &mut Buf<f32>, lr: &mut Buf<f32>, steps: &mut Buf<u64>) {
    all_reduce(w1, Sum); // w1 and w2 travel as one bucket
    all_reduce(w2, Sum);
    broadcast(lr, 0);
    all_reduce(steps, Max);
}
// ANCHOR_END: plan

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let ranks = NexarClient::bootstrap_local(3).await?;
    let mut tasks = tokio::task::JoinSet::new();
    for comm in ranks {
        tasks.spawn(async move {
            let r = comm.rank();
            let mut w1 = Buf::from_vec(vec![r as f32; 100_000]);
            let mut w2 = Buf::from_vec(vec![1.0f32; 2_000]);
            let mut lr = Buf::from_vec(vec![if r == 0 { 0.1f32 } else { 0.0 }]);
            let mut steps = Buf::from_vec(vec![r as u64 * 10]);
            // ANCHOR: run
            if r == 0 {
                println!("{}", step::explain(&w1, &w2, &lr, &steps, comm.world_size()));
            }
            // ANCHOR_END: run
            for _ in 0..3 {
                step(&comm, &mut w1, &mut w2, &mut lr, &mut steps).await?;
                // The same result as the separate calls would give, every iteration.
                anyhow::ensure!(w2.iter().all(|v| *v == 3.0), "w2 of rank {r}");
                w2.fill(1.0);
            }
            anyhow::ensure!(lr[0] == 0.1 && steps[0] == 20, "lr/steps of rank {r}");
            anyhow::ensure!(w1[0] == 27.0, "w1 of rank {r}: {}", w1[0]); // 0+1+2, then times 3 twice
            comm.shutdown().await;
            Ok::<_, anyhow::Error>(r)
        });
    }
    while let Some(done) = tasks.join_next().await {
        println!("rank {} ran the plan three times: ok", done??);
    }
    Ok(())
}
