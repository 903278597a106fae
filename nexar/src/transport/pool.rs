//! A pool of reusable buffers, so that sending and receiving do not allocate (and fault in
//! fresh pages) per message.
//!
//! Buffers are `Vec<u64>` (8-byte aligned, so any element type can be viewed in them) in
//! power-of-two size classes. A buffer taken from the pool keeps whatever it held before: it is
//! meant to be overwritten, and is never zero-filled again.

use std::sync::Arc;

use bytes::Bytes;
use crossbeam_queue::ArrayQueue;

/// Buffers kept per size class.
const PER_CLASS: usize = 8;
/// Largest pooled buffer: 2^24 words (128 MiB); larger ones are allocated and freed directly.
const MAX_CLASS: usize = 24;

/// A lock-free pool of aligned buffers.
#[derive(Debug)]
pub struct BufferPool {
    classes: Vec<ArrayQueue<Vec<u64>>>,
}

impl Default for BufferPool {
    fn default() -> Self {
        BufferPool { classes: (0..=MAX_CLASS).map(|_| ArrayQueue::new(PER_CLASS)).collect() }
    }
}

fn class_of(words: usize) -> usize {
    words.max(1).next_power_of_two().trailing_zeros() as usize
}

impl BufferPool {
    /// A buffer of at least `bytes` bytes. Its contents are unspecified.
    pub fn take(&self, bytes: usize) -> Vec<u64> {
        if bytes == 0 {
            // Nothing to lend (a barrier's scratch space): no trip through the pool's queues,
            // and `give` drops the empty vector.
            return Vec::new();
        }
        let words = bytes.div_ceil(8);
        let class = class_of(words);
        if let Some(v) = self.classes.get(class).and_then(ArrayQueue::pop) {
            return v;
        }
        // A fresh buffer's pages are zero and mapped lazily by the OS: no fill pass.
        vec![0u64; if class <= MAX_CLASS { 1 << class } else { words }]
    }

    /// A buffer of at least `bytes` bytes that goes back to the pool when the loan is dropped,
    /// however its user ends (an early error included). Its contents are unspecified.
    pub fn lend(&self, bytes: usize) -> Lent<'_> {
        Lent { buf: self.take(bytes), pool: self }
    }

    /// Returns a buffer for reuse (dropped if its class is full or it is not pooled).
    pub fn give(&self, v: Vec<u64>) {
        let words = v.len();
        if words.is_power_of_two() {
            let class = words.trailing_zeros() as usize;
            if let Some(q) = self.classes.get(class) {
                let _ = q.push(v);
            }
        }
    }
}

/// A pooled buffer on loan ([`BufferPool::lend`]), viewed as any plain element type.
pub struct Lent<'a> {
    buf: Vec<u64>,
    pool: &'a BufferPool,
}

impl Lent<'_> {
    /// The first `len` elements of the buffer as `T` (`len` within what was asked for).
    pub fn slice_mut<T: bytemuck::Pod>(&mut self, len: usize) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.buf)[..len]
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// Bytes backed by a pooled buffer; the buffer goes back to the pool when the last reference
/// is dropped (after QUIC has sent and no longer needs it).
struct PooledBytes {
    buf: Vec<u64>,
    len: usize,
    pool: Arc<BufferPool>,
}

impl AsRef<[u8]> for PooledBytes {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.buf)[..self.len]
    }
}

impl Drop for PooledBytes {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// Copies `data` into a pooled buffer and returns it as `Bytes`.
pub fn pooled_copy(pool: &Arc<BufferPool>, data: &[u8]) -> Bytes {
    pooled_gather(pool, &[data])
}

/// Copies the concatenation of `parts` into one pooled buffer and returns it as `Bytes`.
pub fn pooled_gather(pool: &Arc<BufferPool>, parts: &[&[u8]]) -> Bytes {
    let len = parts.iter().map(|p| p.len()).sum();
    let mut buf = pool.take(len);
    let mut at = 0;
    for part in parts {
        crate::transport::copy::copy_bytes(
            &mut bytemuck::cast_slice_mut::<u64, u8>(&mut buf)[at..at + part.len()],
            part,
        );
        at += part.len();
    }
    Bytes::from_owner(PooledBytes { buf, len, pool: pool.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_bytes_return_them() {
        let pool = Arc::new(BufferPool::default());
        let b = pooled_copy(&pool, &[1, 2, 3]);
        assert_eq!(&b[..], &[1, 2, 3]);
        let ptr = b.as_ptr();
        drop(b);
        let again = pooled_copy(&pool, &[9; 5]);
        assert_eq!(&pooled_gather(&pool, &[&[1, 2], &[], &[3]])[..], &[1, 2, 3]);
        assert_eq!(again.as_ptr(), ptr);
        assert_eq!(&again[..], &[9; 5]);
        assert!(pool.take(0).is_empty(), "an empty loan takes nothing from the pool");
        let big = pool.take(1000);
        assert!(big.len() * 8 >= 1000);
        pool.give(big);
    }
}
