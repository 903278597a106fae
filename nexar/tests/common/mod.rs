//! Helpers shared by the integration tests.
#![allow(dead_code)]

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
