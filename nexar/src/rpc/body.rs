//! An RPC's bytes: a request's arguments packed into one body, and the aligned buffers both
//! sides read requests and answers from.
//!
//! A request body is
//!
//! ```text
//! count: u32 LE | 0: u32 | count × len: u64 LE | zeros to 16 | part 0 | zeros to 16 | part 1 | …
//! ```
//!
//! and ends where its last part ends. Each part is one argument's rkyv archive, written
//! straight into the body at a 16-byte boundary ([`BodyWriter`]), so the serving rank, whose
//! copy of the body is 16-byte aligned too ([`RpcBytes`]), validates and reads every argument
//! where it lies. An answer is one archive, read the same way.
//!
//! Before 2026-11-28 each argument was archived on its own, copied out of its archive twice,
//! and the list of them archived again; the serving rank then copied the body twice more to
//! align and read it, and the answer took the same road back: a 16 MiB argument crossed memory
//! 18 times in one call, most of them into freshly mapped pages.

use std::ops::Deref;

use bytes::Bytes;
use rkyv::util::AlignedVec;

use crate::__private::RpcValue;
use crate::transport::framed::{Payload, PayloadError};

/// Where each archive starts: rkyv's archives need no more (its `AlignedVec` default).
const ALIGN: usize = 16;

/// Bytes before the first part of a body of `count` arguments.
fn header_len(count: usize) -> usize {
    count.saturating_mul(8).saturating_add(8).next_multiple_of(ALIGN)
}

/// Builds a request body, one argument at a time, each serialised once, straight into it.
///
/// ```
/// use nexar::__private::{BodyWriter, decode, decode_parts};
///
/// let mut body = BodyWriter::new(2);
/// body.part(&7u32).unwrap();
/// body.part(&vec![1u8, 2, 3]).unwrap();
/// let bytes = body.finish().unwrap();
/// let mut parts = decode_parts(&bytes, 2).unwrap();
/// assert_eq!(decode::<u32>(parts.next().unwrap()).unwrap(), 7);
/// assert_eq!(decode::<Vec<u8>>(parts.next().unwrap()).unwrap(), vec![1, 2, 3]);
/// ```
#[derive(Debug)]
pub struct BodyWriter {
    buf: AlignedVec,
    count: usize,
    written: usize,
}

impl BodyWriter {
    /// A body for `count` arguments.
    pub fn new(count: usize) -> Self {
        let header = header_len(count);
        let mut buf = AlignedVec::with_capacity(header.max(256));
        buf.resize(header, 0);
        buf[..4].copy_from_slice(&(count as u32).to_le_bytes());
        Self { buf, count, written: 0 }
    }

    /// Serialises the next argument into the body.
    pub fn part<T: RpcValue>(&mut self, value: &T) -> Result<(), String> {
        if self.written == self.count {
            return Err(format!("a body for {} arguments was given another", self.count));
        }
        let start = self.buf.len().next_multiple_of(ALIGN);
        self.buf.resize(start, 0);
        self.buf = value.append_to(std::mem::take(&mut self.buf))?;
        let len = (self.buf.len() - start) as u64;
        let at = 8 + 8 * self.written;
        self.buf[at..at + 8].copy_from_slice(&len.to_le_bytes());
        self.written += 1;
        Ok(())
    }

    /// The body, once every argument is in (no copy: the bytes go on the wire from here).
    pub fn finish(self) -> Result<Bytes, String> {
        if self.written != self.count {
            return Err(format!("a body for {} arguments was given {}", self.count, self.written));
        }
        Ok(Bytes::from_owner(self.buf))
    }
}

/// Splits a request body into exactly `expected` parts, checking every length against the
/// body before it is used: a body from the network is untrusted.
pub fn decode_parts(body: &[u8], expected: usize) -> Result<std::vec::IntoIter<&[u8]>, String> {
    let word = |at: usize, n: usize| body.get(at..at + n);
    let count = word(0, 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or_else(|| format!("the request body is {} bytes, shorter than its header", body.len()))?;
    if count != expected {
        return Err(format!("the request carries {count} arguments, the function takes {expected}"));
    }
    let header = header_len(count);
    if body.len() < header {
        return Err(format!("the request body is {} bytes, shorter than its header of {header}", body.len()));
    }
    let mut parts = Vec::with_capacity(count);
    let mut end = header;
    for i in 0..count {
        let mut len = [0u8; 8];
        len.copy_from_slice(&body[8 + 8 * i..16 + 8 * i]);
        let len = u64::from_le_bytes(len);
        let start = end.next_multiple_of(ALIGN);
        let room = body.len().saturating_sub(start) as u64;
        if start > body.len() || len > room {
            return Err(format!(
                "argument {i} claims {len} bytes at offset {start}, but the request body has {}",
                body.len()
            ));
        }
        end = start + len as usize;
        parts.push(&body[start..end]);
    }
    if end != body.len() {
        return Err(format!("the request body has {} bytes after its last argument", body.len() - end));
    }
    Ok(parts.into_iter())
}

/// Bytes received for an RPC, held at a 16-byte boundary so that the archives in them are
/// validated and read where they lie.
///
/// ```
/// use nexar::__private::RpcBytes;
///
/// let bytes = RpcBytes::copy_of(b"abc");
/// assert_eq!(&*bytes, b"abc");
/// assert_eq!(bytes.as_ptr() as usize % 16, 0);
/// ```
#[derive(Debug, Clone)]
pub struct RpcBytes {
    /// Whole 16-byte words: `u128` is 16-byte aligned where nexar runs, and a zeroed vector of
    /// them comes from the allocator's zeroed pages (no pass of its own before the copy).
    words: Vec<u128>,
    len: usize,
}

impl RpcBytes {
    /// `len` zero bytes.
    fn zeroed(len: usize) -> Self {
        Self { words: vec![0u128; len.div_ceil(size_of::<u128>())], len }
    }

    /// An aligned copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> Self {
        let mut out = Self::zeroed(bytes.len());
        out.bytes_mut().copy_from_slice(bytes);
        out
    }

    /// An aligned copy of a received payload (its one copy on this side).
    pub(crate) fn of_payload(payload: &Payload) -> Result<Self, PayloadError> {
        let mut out = Self::zeroed(payload.len());
        payload.copy_to(out.bytes_mut())?;
        Ok(out)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

impl Deref for RpcBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

/// Whether an archive in `bytes` can be validated where it lies.
pub(crate) fn aligned(bytes: &[u8]) -> bool {
    (bytes.as_ptr() as usize).is_multiple_of(ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::__private::decode;

    fn body_of_three() -> Bytes {
        let mut body = BodyWriter::new(3);
        body.part(&42u64).unwrap();
        body.part(&vec![9u8; 1001]).unwrap();
        body.part(&String::from("tail")).unwrap();
        body.finish().unwrap()
    }

    #[test]
    fn parts_come_back_as_written_each_at_a_16_byte_boundary() {
        let body = RpcBytes::copy_of(&body_of_three());
        let parts: Vec<&[u8]> = decode_parts(&body, 3).unwrap().collect();
        assert!(parts.iter().all(|p| aligned(p)), "every part starts on a 16-byte boundary");
        assert_eq!(decode::<u64>(parts[0]).unwrap(), 42);
        assert_eq!(decode::<Vec<u8>>(parts[1]).unwrap(), vec![9u8; 1001]);
        assert_eq!(decode::<String>(parts[2]).unwrap(), "tail");
    }

    #[test]
    fn every_truncation_and_every_extension_of_a_body_is_refused_without_a_panic() {
        let body = body_of_three();
        for len in 0..body.len() {
            assert!(decode_parts(&body[..len], 3).is_err(), "a body cut to {len} bytes was accepted");
        }
        let mut longer = body.to_vec();
        longer.push(0);
        let e = decode_parts(&longer, 3).unwrap_err();
        assert!(e.contains("1 bytes after its last argument"), "{e}");
    }

    #[test]
    fn lengths_and_counts_that_do_not_fit_the_body_are_refused() {
        let mut body = body_of_three().to_vec();
        let e = decode_parts(&body, 2).unwrap_err();
        assert!(e.contains("carries 3 arguments, the function takes 2"), "{e}");
        for huge in [u64::MAX, u64::MAX - 15, body.len() as u64] {
            body[16..24].copy_from_slice(&huge.to_le_bytes());
            let e = decode_parts(&body, 3).unwrap_err();
            assert!(e.contains("argument 1 claims"), "{e}");
        }
        let e = decode_parts(&u32::MAX.to_le_bytes(), u32::MAX as usize).unwrap_err();
        assert!(e.contains("shorter than its header"), "{e}");
    }

    #[test]
    fn a_writer_takes_exactly_its_count_of_arguments() {
        let mut body = BodyWriter::new(1);
        assert!(BodyWriter::new(1).finish().is_err());
        body.part(&1u8).unwrap();
        assert!(body.part(&2u8).is_err());
        assert_eq!(decode_parts(&body.finish().unwrap(), 1).unwrap().count(), 1);
        let empty = BodyWriter::new(0).finish().unwrap();
        assert_eq!(decode_parts(&empty, 0).unwrap().count(), 0);
    }

    #[test]
    fn received_bytes_are_aligned_whatever_their_length() {
        for len in [0, 1, 15, 16, 17, 4096 + 3] {
            let src: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let b = RpcBytes::copy_of(&src);
            assert_eq!(&*b, &src[..]);
            assert!(aligned(&b));
        }
    }
}
