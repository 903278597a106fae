//! All-reduce bandwidth with collective payloads on RDMA where the host has a NIC (QUIC
//! otherwise), in the nccl-tests layout. Ranks are in this process; each has its own QUIC
//! endpoint and its own queue pairs.
//!
//! ```sh
//! cargo run --release -p nexar-rdma --example rdma_allreduce            # verbs, or QUIC without a NIC
//! NEXAR_RDMA_FABRIC=emulated cargo run --release -p nexar-rdma --example rdma_allreduce
//! ```
//! `NEXAR_RDMA_*` settings apply (see `RdmaConfig::from_env`); `RANKS` sets the rank count (2).

use std::time::Instant;

use nexar::prelude::*;
use nexar_rdma::{RdmaConfig, attach};

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::var("RANKS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let cfg = RdmaConfig::from_env()?;
    // RDMA takes links whose collective payloads are on QUIC (a TCP lane or, between these
    // ranks of one host, shared memory would hold them).
    let quic = NexarConfig::builder().bulk_transport(nexar::BulkTransport::Quic).shared_memory(false).build()?;
    let ranks = NexarClient::bootstrap_local_with(n, quic).await?;
    let mut tasks = Vec::new();
    for c in ranks {
        let cfg = cfg.clone();
        tasks.push(tokio::spawn(async move { run_rank(c, cfg).await.map_err(|e| e.to_string()) }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

async fn run_rank(c: NexarClient, cfg: RdmaConfig) -> Result<(), Box<dyn std::error::Error>> {
    let report = attach(&c, &cfg).await?;
    let w = c.world_size();
    if c.rank() == 0 {
        println!("# {} ranks, fabric {:?}, links from rank 0: {:?}", w, cfg.fabric, report.links);
        println!(
            "# {:>12} {:>12} {:>10} {:>8} {:>8} {:>7}",
            "size(B)", "count", "time(us)", "algbw", "busbw", "#wrong"
        );
    }
    let mut size = 4usize << 10;
    while size <= 64 << 20 {
        let count = size / 4;
        let mut buf = vec![1.0f32; count];
        c.all_reduce(&mut buf, Sum).await?;
        let iters = if size >= 16 << 20 { 5 } else { 20 };
        let start = Instant::now();
        for _ in 0..iters {
            buf.fill(1.0);
            c.all_reduce(&mut buf, Sum).await?;
        }
        let secs = start.elapsed().as_secs_f64() / iters as f64;
        let wrong = buf.iter().filter(|v| **v != w as f32).count();
        if c.rank() == 0 {
            let algbw = size as f64 / secs / 1e9;
            let busbw = algbw * 2.0 * (w - 1) as f64 / w as f64;
            println!("  {size:>12} {count:>12} {:>10.1} {algbw:>8.2} {busbw:>8.2} {wrong:>7}", secs * 1e6);
        }
        size *= 4;
    }
    c.shutdown().await;
    Ok(())
}
