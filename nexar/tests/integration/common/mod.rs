//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod p2p;

use std::time::Duration;

use nexar::Element;

/// Deterministic, element-type-agnostic test data: `len` elements whose bytes come from a
/// simple generator seeded by `seed`. Comparisons are done on bytes, so NaN bit patterns are fine.
pub fn pattern<T: Element>(len: usize, seed: u64) -> Vec<T> {
    let mut out = vec![T::zeroed(); len];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in bytes.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    out
}

/// Byte-wise equality of two element slices.
pub fn same_bytes<T: Element>(a: &[T], b: &[T]) -> bool {
    bytemuck::cast_slice::<T, u8>(a) == bytemuck::cast_slice::<T, u8>(b)
}

/// A generous limit for a whole test, so a slow shared machine does not make it flaky.
pub const TEST_LIMIT: Duration = Duration::from_secs(180);

/// Installs a log subscriber once (RUST_LOG controls it).
pub fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Runs `f` on every rank concurrently and returns the results by rank.
pub async fn on_each<T, F, Fut>(ranks: &[nexar::NexarClient], f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(nexar::NexarClient) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let tasks: Vec<_> = ranks.iter().cloned().map(|c| tokio::spawn(f(c))).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// The value rank `rank` contributes at index `i` in [`check_every_collective`].
pub fn value(rank: usize, i: usize) -> i64 {
    ((rank * 131 + i * 17) % 1000) as i64 - 500
}

/// Every collective, checked against a sequential reference, on one rank of the cluster.
pub async fn check_every_collective(c: &nexar::NexarClient, counts: &[usize]) {
    use nexar::prelude::*;
    let (r, w) = (c.rank(), c.world_size());
    for &count in counts {
        let sum: Vec<i64> = (0..count).map(|i| (0..w).map(|q| value(q, i)).sum()).collect();
        let mut buf: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
        c.all_reduce(&mut buf, Sum).await.unwrap();
        assert_eq!(buf, sum, "all_reduce, count {count}");
        let mut f: Vec<f32> = (0..count).map(|i| value(r, i) as f32).collect();
        c.all_reduce(&mut f, Sum).await.unwrap();
        assert!(f.iter().zip(&sum).all(|(a, b)| *a == *b as f32), "all_reduce f32, count {count}");

        let mut b: Vec<i64> = if r == w - 1 { (0..count).map(|i| value(w - 1, i)).collect() } else { vec![0; count] };
        c.broadcast(&mut b, w - 1).await.unwrap();
        assert!(b.iter().enumerate().all(|(i, v)| *v == value(w - 1, i)), "broadcast, count {count}");

        let mine: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
        let mut all = vec![0i64; count * w];
        c.all_gather(&mine, &mut all).await.unwrap();
        for q in 0..w {
            assert!(all[q * count..(q + 1) * count].iter().enumerate().all(|(i, v)| *v == value(q, i)));
        }

        let full: Vec<i64> = (0..count * w).map(|i| value(r, i)).collect();
        let mut part = vec![0i64; count];
        c.reduce_scatter(&full, &mut part, Sum).await.unwrap();
        let want: Vec<i64> = (0..count).map(|i| (0..w).map(|q| value(q, r * count + i)).sum()).collect();
        assert_eq!(part, want, "reduce_scatter, count {count}");

        let outgoing: Vec<i64> = (0..count * w).map(|i| (r * 1_000_000 + i) as i64).collect();
        let mut incoming = vec![0i64; count * w];
        c.all_to_all(&outgoing, &mut incoming).await.unwrap();
        for q in 0..w {
            let got = &incoming[q * count..(q + 1) * count];
            assert!(got.iter().enumerate().all(|(i, v)| *v == (q * 1_000_000 + r * count + i) as i64));
        }
    }
}

/// The name the test harness gives the test `name` of the module `module` (`module_path!()`):
/// the module's path without the crate's name, then the function's
/// (`hostile_member::messages_nobody_asked_for_cost_no_more_memory_than_the_limits`).
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_crate, within)) => format!("{within}::{name}"),
        None => name.to_string(),
    }
}

/// Runs the test `name` of the module `module` (`module_path!()`): its `body` in a process of
/// its own (this test binary, run again for that test alone), so that what it measures of the
/// process (its memory, its sockets, its threads) is its own and not that of the tests that
/// run beside it.
pub fn alone<F: std::future::Future<Output = ()>>(module: &str, name: &str, body: fn() -> F) {
    const ALONE: &str = "NEXAR_TEST_ALONE";
    if std::env::var_os(ALONE).is_some() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(body());
        return;
    }
    let test = test_path(module, name);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test.as_str(), "--exact", "--test-threads=1", "--nocapture"])
        .env(ALONE, "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("1 passed"), "{test} in its own process:\n{stdout}\n{stderr}");
}

/// [`alone`], in a network namespace of its own (`unshare --net`, with only `lo` up): what
/// the test reads of the host's network tables (`/proc/self/net/tcp`) is then its own
/// sockets, not those of every other process on a busy machine. Needs root (CI runs as
/// root); without it the test fails and says so.
pub fn alone_in_own_network<F: std::future::Future<Output = ()>>(module: &str, name: &str, body: fn() -> F) {
    const ALONE: &str = "NEXAR_TEST_ALONE";
    if std::env::var_os(ALONE).is_some() {
        return alone(module, name, body);
    }
    let test = test_path(module, name);
    let out = std::process::Command::new("unshare")
        .args(["--net", "sh", "-c", "ip link set lo up && exec \"$0\" \"$@\""])
        .arg(std::env::current_exe().unwrap())
        .args([test.as_str(), "--exact", "--test-threads=1", "--nocapture"])
        .env(ALONE, "1")
        .output()
        .expect("running `unshare` (util-linux) for a network namespace of the test's own");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{test} in its own process and network namespace (this needs root):\n{stdout}\n{stderr}"
    );
}

/// This process's resident memory, from `/proc/self/status` (`VmRSS`).
pub fn resident_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// This process's peak resident memory (`VmHWM`), since it started or since it was last reset
/// by writing `5` to `/proc/self/clear_refs`.
pub fn peak_resident_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// A size in `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    kib << 10
}

/// Five times: two ranks whose links go over `transport` all-reduce once, and rank 1 drops its
/// client at once, without `shutdown()`. Rank 0's allreduce must still complete with the right
/// sum, although rank 1's goodbye follows its part closely.
pub async fn leaver_completes_its_last_allreduce(cfg: nexar::NexarConfig, transport: &str) {
    for round in 0..5 {
        let mut ranks = nexar::NexarClient::bootstrap_local_with(2, cfg.clone()).await.unwrap();
        let leaver = ranks.pop().unwrap();
        let stayer = ranks.pop().unwrap();
        assert_eq!(stayer.bulk_transport(1), Some(transport));
        let leaving = tokio::spawn(async move {
            let mut x = vec![2.0f32; 4096];
            leaver.all_reduce(&mut x, nexar::Sum).await.unwrap();
            drop(leaver);
        });
        let mut x = vec![1.0f32; 4096];
        let result = stayer.all_reduce(&mut x, nexar::Sum).await;
        assert!(result.is_ok(), "round {round}: {:?}", result.err());
        assert!(x.iter().all(|v| *v == 3.0), "round {round}: a wrong sum");
        leaving.await.unwrap();
        stayer.shutdown().await;
    }
}
