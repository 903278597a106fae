//! The soak: a long mixed workload (allreduce, broadcast, all-gather, ring send/recv, RPC) with
//! sizes drawn from a sequence every rank computes alike, every result checked. Rank 0 prints
//! throughput and resident memory once a second. With `--survive`, a failed rank is agreed on
//! and left out, and the survivors carry on.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nexar::prelude::*;

use super::{Args, echo};

/// Iterations between two control rounds (stop flag and memory figures).
const CONTROL_EVERY: u64 = 16;

/// splitmix64: the same pseudo-random draw on every rank for iteration `i`.
fn draw(i: u64, salt: u64) -> u64 {
    let mut z = i.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(salt.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_string))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn unix_ms(at: Instant) -> u128 {
    let ago = at.elapsed();
    SystemTime::now().checked_sub(ago).and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_millis())
}

/// The operations a soak mixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SoakOp {
    Allreduce,
    Broadcast,
    Allgather,
    Sendrecv,
    Rpc,
}

/// One iteration's operation; returns the payload bytes this rank moved.
async fn step(comm: &NexarClient, i: u64, max_bytes: usize, mix: &[SoakOp]) -> Result<usize, String> {
    let (r, w) = (comm.rank(), comm.world_size());
    let elems = 1 + (draw(i, 1) as usize) % (max_bytes / 4).max(1);
    let wrong = |what: &str| format!("rank {r} iteration {i}: wrong {what} result");
    let all = [SoakOp::Allreduce];
    let mix = if mix.is_empty() { &all[..] } else { mix };
    match mix[(draw(i, 2) % mix.len() as u64) as usize] {
        SoakOp::Allreduce => {
            let mut v: Vec<f32> = (0..elems).map(|k| ((k + r) % 5) as f32).collect();
            comm.all_reduce(&mut v, Sum).await.map_err(|e| e.to_string())?;
            let want = |k: usize| (0..w).map(|q| ((k + q) % 5) as f32).sum::<f32>();
            if v.iter().enumerate().any(|(k, x)| *x != want(k)) {
                return Err(wrong("allreduce"));
            }
            Ok(elems * 4)
        }
        SoakOp::Broadcast => {
            let root = (draw(i, 3) as usize) % w;
            let mut v: Vec<u32> =
                if r == root { (0..elems as u32).map(|k| k ^ i as u32).collect() } else { vec![0; elems] };
            comm.broadcast(&mut v, root).await.map_err(|e| e.to_string())?;
            if v.iter().enumerate().any(|(k, x)| *x != (k as u32) ^ i as u32) {
                return Err(wrong("broadcast"));
            }
            Ok(elems * 4)
        }
        SoakOp::Allgather => {
            let per = elems.div_ceil(w);
            let mut all = vec![0u16; per * w];
            comm.all_gather(&vec![r as u16; per], &mut all).await.map_err(|e| e.to_string())?;
            if all.iter().enumerate().any(|(k, x)| *x as usize != k / per) {
                return Err(wrong("all_gather"));
            }
            Ok(per * w * 2)
        }
        SoakOp::Sendrecv => {
            let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
            let out: Vec<u8> = (0..elems).map(|k| (k as u64 ^ i ^ r as u64) as u8).collect();
            let (sent, got) = tokio::join!(comm.send(&out, next, i), comm.recv_vec::<u8>(prev, i));
            sent.map_err(|e| e.to_string())?;
            let got = got.map_err(|e| e.to_string())?;
            if got.len() != elems || got.iter().enumerate().any(|(k, x)| *x != (k as u64 ^ i ^ prev as u64) as u8) {
                return Err(wrong("send/recv"));
            }
            Ok(elems)
        }
        SoakOp::Rpc => {
            let len = elems.min(1 << 16);
            let payload: Vec<u8> = (0..len).map(|k| (k as u64 ^ i) as u8).collect();
            let back = echo::call(comm, (r + 1) % w, payload.clone()).await.map_err(|e| e.to_string())?;
            if back != payload {
                return Err(wrong("rpc"));
            }
            // Every rank serves one call per RPC iteration, so all stay in step.
            comm.barrier().await.map_err(|e| e.to_string())?;
            Ok(2 * len)
        }
    }
}

/// Runs the soak on this rank until `args.seconds` pass (rank 0 decides, so every rank runs
/// the same iterations).
pub async fn run(mut comm: NexarClient, args: Args) -> Result<(), String> {
    let start = Instant::now();
    let (mut i, mut bytes, mut last_report, mut last_iters, mut last_bytes) = (0u64, 0usize, start, 0u64, 0usize);
    let mut first_rss: Option<u64> = None;
    let mut rss_range = (u64::MAX, 0u64);
    if comm.rank() == 0 {
        println!(
            "# soak: {} ranks, {} s, sizes up to {} B, survive failures: {}",
            comm.world_size(),
            args.seconds,
            args.max_bytes,
            args.survive
        );
        println!("#{:>7} {:>10} {:>10} {:>10} {:>9}", "t(s)", "iters/s", "MB/s", "rss(MiB)", "world");
    }
    loop {
        let outcome = async {
            bytes += step(&comm, i, args.max_bytes, &args.mix).await?;
            if (i + 1) % CONTROL_EVERY == 0 {
                let stop = u64::from(comm.rank() == 0 && start.elapsed() >= Duration::from_secs(args.seconds));
                let mut ctl = [stop, rss_kib()];
                comm.all_reduce(&mut ctl, Max).await.map_err(|e| e.to_string())?;
                return Ok::<_, String>(Some(ctl));
            }
            Ok(None)
        }
        .await;
        match outcome {
            Ok(ctl) => {
                i += 1;
                let Some([stop, rss]) = ctl else { continue };
                // The first second is warm-up: pools and caches fill.
                if start.elapsed() > Duration::from_secs(1) {
                    first_rss.get_or_insert(rss);
                    rss_range = (rss_range.0.min(rss), rss_range.1.max(rss));
                }
                if comm.rank() == 0 && (last_report.elapsed() >= Duration::from_secs(1) || stop == 1) {
                    let secs = last_report.elapsed().as_secs_f64();
                    println!(
                        " {:>7.1} {:>10.0} {:>10.1} {:>10.1} {:>9}",
                        start.elapsed().as_secs_f64(),
                        (i - last_iters) as f64 / secs,
                        (bytes - last_bytes) as f64 / secs / 1e6,
                        rss as f64 / 1024.0,
                        comm.world_size()
                    );
                    (last_report, last_iters, last_bytes) = (Instant::now(), i, bytes);
                }
                if stop == 1 {
                    break;
                }
            }
            Err(e) if args.survive => {
                let failed_at = Instant::now();
                eprintln!("rank {}: iteration {i} failed: {e}", comm.world_rank());
                comm = match comm.recover().await {
                    Ok(c) => c,
                    Err(RecoveryError::Excluded { reason, .. }) => {
                        println!("# excluded: {reason}");
                        return Ok(());
                    }
                    Err(e) => return Err(e.to_string()),
                };
                let rebuilt_in = failed_at.elapsed();
                // Carry on from the furthest iteration any survivor reached.
                let mut at = [i];
                comm.all_reduce(&mut at, Max).await.map_err(|e| e.to_string())?;
                i = at[0] + 1;
                for f in comm.failure_watch().failures() {
                    println!(
                        "# failure: world rank {} detected_unix_ms={} ({})",
                        f.rank,
                        unix_ms(f.detected_at),
                        f.reason
                    );
                }
                println!(
                    "# recovered: world rank {} is rank {} of {}; agreement and rebuild took {} ms",
                    comm.world_rank(),
                    comm.rank(),
                    comm.world_size(),
                    rebuilt_in.as_millis()
                );
            }
            Err(e) => return Err(e),
        }
    }
    if comm.rank() == 0 {
        let (lo, hi) = rss_range;
        println!(
            "# soak done: {i} iterations in {:.1} s, every result checked; RSS after warm-up {:.1} MiB, range {:.1}-{:.1} MiB (drift {:.1} MiB)",
            start.elapsed().as_secs_f64(),
            first_rss.unwrap_or(0) as f64 / 1024.0,
            lo.min(hi) as f64 / 1024.0,
            hi as f64 / 1024.0,
            hi.saturating_sub(lo.min(hi)) as f64 / 1024.0
        );
    }
    comm.shutdown().await;
    Ok(())
}
