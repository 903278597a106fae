//! Reading and writing frames on QUIC streams, with limits checked before allocation.

use bytes::Bytes;
use quinn::{ReadExactError, RecvStream, SendStream};

use crate::proto::frame::{FrameError, FrameHeader, FrameKind, HEADER_LEN, message_frame};
use crate::proto::message;

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadFrameError {
    /// The stream ended or was reset.
    #[error("stream closed: {0}")]
    Closed(String),
    /// The bytes are not a valid frame.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

fn closed(e: impl std::fmt::Display) -> ReadFrameError {
    ReadFrameError::Closed(e.to_string())
}

/// Reads a frame header; `Ok(None)` when the stream ends cleanly between frames.
pub async fn read_header(recv: &mut RecvStream, limit: u64) -> Result<Option<FrameHeader>, ReadFrameError> {
    let mut buf = [0u8; HEADER_LEN];
    match recv.read_exact(&mut buf).await {
        Ok(()) => Ok(Some(FrameHeader::decode(&buf, limit)?)),
        Err(ReadExactError::FinishedEarly(0)) => Ok(None),
        Err(e) => Err(closed(e)),
    }
}

/// Reads a body of `len` bytes (already checked against a limit) into one buffer.
pub async fn read_body(recv: &mut RecvStream, len: u64) -> Result<Vec<u8>, ReadFrameError> {
    let len = usize::try_from(len).map_err(|_| FrameError::TooLong { len, limit: usize::MAX as u64 })?;
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await.map_err(closed)?;
    Ok(body)
}

/// Reads the next frame, which must be a message no longer than `limit`, and decodes it.
/// `Ok(None)` when the stream ends cleanly.
pub async fn read_message<M>(recv: &mut RecvStream, limit: u64) -> Result<Option<M>, ReadFrameError>
where
    M: rkyv::Archive,
    M::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<M, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    let Some(header) = read_header(recv, limit).await? else {
        return Ok(None);
    };
    header.expect(FrameKind::Message)?;
    let body = read_body(recv, header.len).await?;
    Ok(Some(message::decode(&body)?))
}

/// Encodes and writes one message frame.
pub async fn write_message<M>(send: &mut SendStream, msg: &M) -> Result<(), ReadFrameError>
where
    M: for<'a> rkyv::Serialize<
            rkyv::api::high::HighSerializer<
                rkyv::util::AlignedVec,
                rkyv::ser::allocator::ArenaHandle<'a>,
                rkyv::rancor::Error,
            >,
        >,
{
    let body = message::encode(msg)?;
    send.write_chunk(message_frame(&body)).await.map_err(closed)
}

/// Words in the staging buffer of [`Payload::for_each_block`] (4 KiB).
const STAGE_WORDS: usize = 512;
/// The shortest aligned run [`Payload::for_each_block`] passes on without staging it.
pub const DIRECT_BYTES: usize = 4096;

/// Raw payload bytes as they arrived: a list of chunks, copied once into their destination.
#[derive(Clone, Debug, Default)]
pub struct Payload {
    chunks: Vec<Bytes>,
    len: usize,
}

impl Payload {
    /// A payload of one buffer.
    pub fn from_bytes(bytes: Bytes) -> Self {
        let len = bytes.len();
        Payload { chunks: vec![bytes], len }
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The payload's chunks, in order (for passing it on without a copy).
    pub fn chunks(&self) -> &[Bytes] {
        &self.chunks
    }

    /// Copies the payload into `dst`, which must be exactly [`len`](Self::len) bytes.
    pub fn copy_to(&self, dst: &mut [u8]) {
        debug_assert_eq!(dst.len(), self.len);
        let mut at = 0;
        for c in &self.chunks {
            let end = (at + c.len()).min(dst.len());
            dst[at..end].copy_from_slice(&c[..end - at]);
            at = end;
        }
    }

    /// Calls `f` with the payload as consecutive blocks of `T`. Runs of at least
    /// [`DIRECT_BYTES`] that lie aligned in one chunk (a TCP lane's group, usually) are passed
    /// as they are; the rest is staged through an aligned 4 KiB buffer that stays in L1 cache.
    /// The payload length must be a multiple of `size_of::<T>()` (the router checked it) and `T`
    /// at most 8-byte aligned.
    pub fn for_each_block<T: bytemuck::Pod, E>(&self, mut f: impl FnMut(&[T]) -> Result<(), E>) -> Result<(), E> {
        let mut stage = [0u64; STAGE_WORDS];
        let elem = size_of::<T>().max(1);
        let cap = (STAGE_WORDS * 8 / elem) * elem;
        let mut filled = 0;
        for chunk in &self.chunks {
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                let whole = rest.len() / elem * elem;
                if filled == 0
                    && whole >= DIRECT_BYTES
                    && let Ok(direct) = bytemuck::try_cast_slice::<u8, T>(&rest[..whole])
                {
                    f(direct)?;
                    rest = &rest[whole..];
                    continue;
                }
                let n = (cap - filled).min(rest.len());
                bytemuck::cast_slice_mut::<u64, u8>(&mut stage)[filled..filled + n].copy_from_slice(&rest[..n]);
                filled += n;
                rest = &rest[n..];
                if filled == cap {
                    f(bytemuck::cast_slice(&bytemuck::cast_slice::<u64, u8>(&stage)[..cap]))?;
                    filled = 0;
                }
            }
        }
        if filled >= elem {
            let whole = filled / elem * elem;
            f(bytemuck::cast_slice(&bytemuck::cast_slice::<u64, u8>(&stage)[..whole]))?;
        }
        Ok(())
    }

    /// Reads exactly `len` bytes (already checked against a limit) as chunks, without an extra
    /// copy.
    pub async fn read(recv: &mut RecvStream, len: u64) -> Result<Payload, ReadFrameError> {
        let len = usize::try_from(len).map_err(|_| FrameError::TooLong { len, limit: usize::MAX as u64 })?;
        let mut chunks = Vec::new();
        let mut got = 0usize;
        while got < len {
            match recv.read_chunk(len - got, true).await.map_err(closed)? {
                Some(chunk) => {
                    got += chunk.bytes.len();
                    chunks.push(chunk.bytes);
                }
                None => {
                    return Err(closed(format!("stream ended {got} bytes into a {len}-byte payload")));
                }
            }
        }
        Ok(Payload { chunks, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_payloads_split_at_odd_chunk_boundaries() {
        let values: Vec<u32> = (0..5000).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&values);
        // Chunks that split elements in the middle.
        let chunks: Vec<Bytes> = bytes.chunks(1001).map(Bytes::copy_from_slice).collect();
        let payload = Payload { len: bytes.len(), chunks };
        let mut seen = Vec::new();
        payload
            .for_each_block::<u32, ()>(|b| {
                seen.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, values);
        let mut copied = vec![0u8; bytes.len()];
        payload.copy_to(&mut copied);
        assert_eq!(copied, bytes);
    }

    #[test]
    fn aligned_runs_pass_unstaged_and_misaligned_ones_are_staged() {
        let values: Vec<u32> = (0..20_000).collect();
        let whole = Bytes::copy_from_slice(bytemuck::cast_slice(&values));
        // An aligned chunk, one that starts mid-element, one that starts misaligned by an
        // element's width, and a short tail.
        let cuts = [0, 24_000, 24_002, 50_001, 79_990, whole.len()];
        let chunks: Vec<Bytes> = cuts.windows(2).map(|w| whole.slice(w[0]..w[1])).collect();
        let payload = Payload { len: whole.len(), chunks };
        let (mut seen, mut direct) = (Vec::new(), 0);
        payload
            .for_each_block::<u32, ()>(|b| {
                if b.len() > STAGE_WORDS * 2 {
                    direct += 1;
                }
                seen.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, values);
        assert!(direct >= 1, "the aligned first chunk went unstaged");
    }
}
