//! Reading and writing frames on QUIC streams, with limits checked before allocation, and the
//! payloads that arrive on them (or on a TCP lane).

use std::marker::PhantomData;

use bytes::Bytes;
use quinn::{ReadExactError, RecvStream, SendStream};

use crate::proto::frame::{FrameError, FrameHeader, FrameKind, HEADER_LEN, message_frame};
use crate::proto::message;
use crate::transport::tcp_lane::{Deferred, Kept, SealedRecord};

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

/// Why a payload's bytes could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// A record of the payload failed authentication: its bytes were altered on the way.
    #[error("a {len}-byte record of the payload failed authentication: it was altered after it was sealed")]
    Forged {
        /// The record's length.
        len: usize,
    },
    /// The first bytes of the payload were received straight into the buffer of the receive
    /// that waited for it, which is not the buffer it is now read into.
    #[error("{bytes} bytes of the payload were received straight into another buffer than this one")]
    Elsewhere {
        /// The bytes received there.
        bytes: usize,
    },
    /// The destination is not as long as the payload.
    #[error("a {len}-byte payload cannot fill a {dst}-byte destination")]
    Length {
        /// The payload's length.
        len: usize,
        /// The destination's length.
        dst: usize,
    },
}

/// Why [`Payload::for_each_block`] stopped.
#[derive(Debug)]
pub enum BlockError<E> {
    /// The payload's bytes could not be read.
    Payload(PayloadError),
    /// The visitor said so.
    Visit(E),
}

/// Payload bytes left where they arrived (a same-host peer's ring) until nexar copies them
/// where they are wanted: one copy instead of two. The bytes are the peer's, as untrusted as
/// any it sends; they are only ever copied out.
pub(crate) trait LentBytes: std::fmt::Debug + Send + Sync {
    /// Their length.
    fn len(&self) -> usize;
    /// Copies the bytes from `offset` into `dst` (`offset + dst.len()` at most [`len`](Self::len)).
    fn copy_out(&self, offset: usize, dst: &mut [u8]);
    /// Shows `f` the bytes in order, a piece at a time: as they lie where they are this
    /// process's own memory, else copied through `stage` a stage at a time. Stops when `f`
    /// returns `false`.
    fn each_piece(&self, stage: &mut [u8], f: &mut dyn FnMut(&[u8]) -> bool);
}

/// How much of a lent piece is staged at a time where it is read by block (in cache).
const LENT_STAGE: usize = 64 << 10;

/// One piece of a payload: bytes as they arrived, a record of a TCP lane that its reader
/// left sealed so that it is decrypted once, straight where the bytes are wanted, or bytes
/// still in a same-host peer's ring; or a record that failed authentication as it arrived
/// (its length), which fails whoever reads it.
#[derive(Clone, Debug)]
enum Piece {
    Plain(Bytes),
    Sealed(Bytes, SealedRecord),
    Lent(std::sync::Arc<dyn LentBytes>),
    Forged(usize),
    /// The rest of a sealed record whose first `in_dst` bytes of ciphertext lie in the
    /// payload's destination already, just before where this piece's bytes go ([`Landed`]).
    Straddled {
        in_dst: usize,
        rest: Bytes,
        record: SealedRecord,
    },
}

impl Piece {
    fn len(&self) -> usize {
        match self {
            Piece::Plain(b) | Piece::Sealed(b, _) | Piece::Straddled { rest: b, .. } => b.len(),
            Piece::Lent(lent) => lent.len(),
            Piece::Forged(len) => *len,
        }
    }

    /// The piece's plaintext into `out`, as long as the piece. A sealed record is decrypted
    /// straight into `out`, and AES-GCM decrypts before it checks the tag: a record that fails
    /// leaves `out` zeroed, never holding bytes that an attacker chose.
    fn write_to(&self, out: &mut [u8]) -> Result<(), PayloadError> {
        match self {
            Piece::Plain(b) => crate::transport::copy::copy_bytes(out, b),
            Piece::Lent(lent) => lent.copy_out(0, out),
            Piece::Forged(len) => {
                out.fill(0);
                return Err(PayloadError::Forged { len: *len });
            }
            // Only its destination holds its first bytes ([`Payload::copy_to`]).
            Piece::Straddled { in_dst, .. } => return Err(PayloadError::Elsewhere { bytes: *in_dst }),
            Piece::Sealed(cipher, record) => {
                if record.open_into(cipher, out).is_err() {
                    out.fill(0);
                    return Err(PayloadError::Forged { len: cipher.len() });
                }
            }
        }
        Ok(())
    }
}

thread_local! {
    /// Where [`Payload::for_each_block`] opens sealed records (one at a time, at most a
    /// record's length), so their plaintext is read from cache rather than memory.
    static OPENED: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Raw payload bytes as they arrived: a list of pieces, each copied (or opened) once into its
/// destination.
#[derive(Clone, Debug, Default)]
pub struct Payload {
    pieces: Vec<Piece>,
    len: usize,
    /// The payload's first bytes, already in the receive's destination (its pieces are the
    /// rest).
    landed: Option<Landed>,
}

/// The first bytes of a payload that a TCP lane read straight into the destination its
/// receive lent ([`crate::transport::lent`]): where that destination starts, and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Landed {
    /// The destination's address (only ever compared, never read through).
    pub at: usize,
    /// Bytes written there: opened records, and the first bytes of a record still sealed
    /// whose rest is the payload's first piece ([`Piece::Straddled`]).
    pub bytes: usize,
    /// A record opened there that failed authentication (its length; its bytes are zeros).
    pub forged: Option<usize>,
}

impl Payload {
    /// A payload of one buffer.
    pub fn from_bytes(bytes: Bytes) -> Self {
        let len = bytes.len();
        Payload { pieces: vec![Piece::Plain(bytes)], len, landed: None }
    }

    /// The bytes `range` of a TCP lane's `group`, of which the records in `deferred` (in
    /// order) are still sealed or failed authentication as they arrived ([`Kept`]). Every
    /// record listed must lie inside `range`.
    pub(crate) fn from_group(
        group: &Bytes,
        range: std::ops::Range<usize>,
        deferred: &[Deferred],
    ) -> Result<Self, FrameError> {
        let mut pieces = Vec::with_capacity(deferred.len() + 1);
        let mut at = range.start;
        for d in deferred {
            if d.at < at || d.at + d.len > range.end {
                return Err(FrameError::InvalidMessage(format!(
                    "a sealed record at bytes {}..{} of a group whose payload is bytes {}..{}",
                    d.at,
                    d.at + d.len,
                    range.start,
                    range.end
                )));
            }
            let piece = match &d.kept {
                Kept::Sealed(sealed) => Piece::Sealed(group.slice(d.at..d.at + d.len), sealed.clone()),
                Kept::Forged => Piece::Forged(d.len),
                // Opened where it arrived: plaintext like the bytes around it.
                Kept::Opened => continue,
            };
            if d.at > at {
                pieces.push(Piece::Plain(group.slice(at..d.at)));
            }
            pieces.push(piece);
            at = d.at + d.len;
        }
        if at < range.end || pieces.is_empty() {
            pieces.push(Piece::Plain(group.slice(at..range.end)));
        }
        Ok(Payload { pieces, len: range.len(), landed: None })
    }

    /// A payload whose bytes stay where they arrived until they are copied out.
    pub(crate) fn from_lent(lent: std::sync::Arc<dyn LentBytes>) -> Self {
        let len = lent.len();
        Payload { pieces: vec![Piece::Lent(lent)], len, landed: None }
    }

    /// A payload whose first `landed.bytes` are in its receive's destination already, and
    /// whose other bytes are `rest`'s.
    pub(crate) fn from_landed(landed: Landed, rest: Payload) -> Self {
        Payload { pieces: rest.pieces, len: landed.bytes + rest.len, landed: Some(landed) }
    }

    /// This payload after the `rest` of a sealed `record` whose first `in_dst` bytes of
    /// ciphertext are in the destination already (the payload is then
    /// [`from_landed`](Self::from_landed) with those bytes counted as landed).
    pub(crate) fn after_straddled(mut self, in_dst: usize, rest: Bytes, record: SealedRecord) -> Self {
        self.len += rest.len();
        self.pieces.insert(0, Piece::Straddled { in_dst, rest, record });
        self
    }

    /// An error if part of the payload was received into a destination (it can only be read
    /// into that one, with [`copy_to`](Self::copy_to)).
    fn whole_here(&self) -> Result<(), PayloadError> {
        match self.landed {
            Some(Landed { bytes, .. }) if bytes > 0 => Err(PayloadError::Elsewhere { bytes }),
            _ => Ok(()),
        }
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` for an empty payload.
    #[cfg(feature = "unstable-internals")]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The payload as plaintext buffers, in order, for passing it on: bytes as they arrived are
    /// shared, not copied; sealed records are opened into new buffers.
    pub fn to_chunks(&self) -> Result<Vec<Bytes>, PayloadError> {
        self.whole_here()?;
        self.pieces
            .iter()
            .map(|p| match p {
                Piece::Plain(b) => Ok(b.clone()),
                Piece::Sealed(..) | Piece::Lent(_) | Piece::Forged(_) | Piece::Straddled { .. } => {
                    let mut out = vec![0u8; p.len()];
                    p.write_to(&mut out)?;
                    Ok(Bytes::from(out))
                }
            })
            .collect()
    }

    /// The payload in a new vector (see [`copy_to`](Self::copy_to)).
    pub fn to_vec(&self) -> Result<Vec<u8>, PayloadError> {
        let mut out = vec![0u8; self.len];
        self.copy_to(&mut out)?;
        Ok(out)
    }

    /// Writes the payload into `dst`, which must be exactly [`len`](Self::len) bytes: a copy
    /// of the bytes as they arrived, or sealed records decrypted straight into `dst`. After a
    /// [`PayloadError::Forged`], each byte of `dst` holds the payload's authenticated byte, its
    /// old value or zero (the record that failed): never a byte the sender did not seal.
    /// Where the payload's first bytes were received straight into its receive's buffer, `dst`
    /// must be that buffer ([`PayloadError::Elsewhere`] otherwise), and only the rest is
    /// written.
    pub fn copy_to(&self, dst: &mut [u8]) -> Result<(), PayloadError> {
        if dst.len() != self.len {
            return Err(PayloadError::Length { len: self.len, dst: dst.len() });
        }
        let mut at = match self.landed {
            None => 0,
            Some(Landed { forged: Some(len), .. }) => return Err(PayloadError::Forged { len }),
            Some(landed) if landed.at == dst.as_ptr() as usize => landed.bytes,
            Some(landed) => return Err(PayloadError::Elsewhere { bytes: landed.bytes }),
        };
        for p in &self.pieces {
            match p {
                Piece::Straddled { in_dst, rest, record } => {
                    let start = at.checked_sub(*in_dst).ok_or(PayloadError::Elsewhere { bytes: *in_dst })?;
                    let body = &mut dst[start..at + rest.len()];
                    crate::transport::copy::copy_bytes(&mut body[*in_dst..], rest);
                    record.open_in_place(body).map_err(|_| PayloadError::Forged { len: body.len() })?;
                }
                _ => p.write_to(&mut dst[at..at + p.len()])?,
            }
            at += p.len();
        }
        Ok(())
    }

    /// Writes the payload into `dsts`, one after the other; their lengths must add up to
    /// [`len`](Self::len). Pieces that fall inside one destination are copied or decrypted
    /// straight into it; a sealed record that straddles two is opened into a cached buffer
    /// first. After an error, as with [`copy_to`](Self::copy_to), no destination holds a byte
    /// that failed authentication.
    pub fn copy_to_parts(&self, dsts: &mut [&mut [u8]]) -> Result<(), PayloadError> {
        self.whole_here()?;
        let total = dsts.iter().map(|d| d.len()).sum();
        if total != self.len {
            return Err(PayloadError::Length { len: self.len, dst: total });
        }
        let mut out = Spread { dsts, part: 0, offset: 0 };
        for piece in &self.pieces {
            if let Some(whole) = out.contiguous(piece.len()) {
                piece.write_to(whole)?;
                continue;
            }
            match piece {
                Piece::Plain(b) => out.write(b),
                Piece::Sealed(..) | Piece::Lent(_) | Piece::Forged(_) | Piece::Straddled { .. } => {
                    with_opened(piece, |plain| {
                        out.write(plain);
                        Ok::<(), std::convert::Infallible>(())
                    })
                    .map_err(|e| match e {
                        Opened::Payload(e) => e,
                        Opened::Visit(never) => match never {},
                    })?
                }
            }
        }
        Ok(())
    }

    /// Calls `f` with the payload as consecutive blocks of `T`. Runs of at least
    /// [`DIRECT_BYTES`] that lie aligned in one piece (a TCP lane's group, usually) are passed
    /// as they are, sealed records once opened into a cached buffer; the rest is staged
    /// through an aligned 4 KiB buffer that stays in L1 cache. The payload length must be a
    /// multiple of `size_of::<T>()` (the router checked it) and `T` at most 8-byte aligned.
    pub fn for_each_block<T: bytemuck::Pod, E>(
        &self,
        f: impl FnMut(&[T]) -> Result<(), E>,
    ) -> Result<(), BlockError<E>> {
        self.whole_here().map_err(BlockError::Payload)?;
        let mut blocks = Blocks::<T, _> { stage: [0u64; STAGE_WORDS], filled: 0, f, elem: PhantomData };
        for piece in &self.pieces {
            match piece {
                Piece::Plain(b) => blocks.feed(b).map_err(BlockError::Visit)?,
                Piece::Sealed(..) | Piece::Lent(_) | Piece::Forged(_) | Piece::Straddled { .. } => {
                    with_opened(piece, |plain| blocks.feed(plain).map_err(BlockError::Visit)).map_err(|e| match e {
                        Opened::Payload(e) => BlockError::Payload(e),
                        Opened::Visit(e) => e,
                    })?
                }
            }
        }
        blocks.finish().map_err(BlockError::Visit)
    }

    /// Reads exactly `len` bytes (already checked against a limit) as chunks, without an extra
    /// copy.
    pub async fn read(recv: &mut RecvStream, len: u64) -> Result<Payload, ReadFrameError> {
        let len = usize::try_from(len).map_err(|_| FrameError::TooLong { len, limit: usize::MAX as u64 })?;
        let mut pieces = Vec::new();
        let mut got = 0usize;
        while got < len {
            match recv.read_chunk(len - got, true).await.map_err(closed)? {
                Some(chunk) => {
                    got += chunk.bytes.len();
                    pieces.push(Piece::Plain(chunk.bytes));
                }
                None => {
                    return Err(closed(format!("stream ended {got} bytes into a {len}-byte payload")));
                }
            }
        }
        Ok(Payload { pieces, len, landed: None })
    }
}

/// Why [`with_opened`] stopped: the record did not open, or the visitor failed.
enum Opened<E> {
    Payload(PayloadError),
    Visit(E),
}

impl<E> From<PayloadError> for Opened<E> {
    fn from(e: PayloadError) -> Self {
        Opened::Payload(e)
    }
}

/// Opens sealed `piece` into the thread's cached [`OPENED`] buffer and shows `f` its
/// plaintext; a lent piece is copied there and shown [`LENT_STAGE`] bytes at a time.
fn with_opened<E>(piece: &Piece, mut f: impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), Opened<E>> {
    OPENED.with_borrow_mut(|opened| {
        let stage = match piece {
            Piece::Lent(_) => piece.len().min(LENT_STAGE),
            _ => piece.len(),
        };
        let words = stage.div_ceil(8);
        if opened.len() < words {
            opened.resize(words, 0);
        }
        let plain = &mut bytemuck::cast_slice_mut::<u64, u8>(opened)[..stage];
        if let Piece::Lent(lent) = piece {
            let mut failed = None;
            lent.each_piece(plain, &mut |bytes| match f(bytes) {
                Ok(()) => true,
                Err(e) => {
                    failed = Some(e);
                    false
                }
            });
            return failed.map_or(Ok(()), |e| Err(Opened::Visit(e)));
        }
        piece.write_to(plain)?;
        f(plain).map_err(Opened::Visit)
    })
}

/// A write position in a list of destinations, for [`Payload::copy_to_parts`].
struct Spread<'s, 'd> {
    dsts: &'s mut [&'d mut [u8]],
    part: usize,
    offset: usize,
}

impl Spread<'_, '_> {
    /// Moves past destinations that are full.
    fn skip_full(&mut self) {
        while self.part < self.dsts.len() && self.offset == self.dsts[self.part].len() {
            (self.part, self.offset) = (self.part + 1, 0);
        }
    }

    /// The next `len` bytes, when they lie in one destination.
    fn contiguous(&mut self, len: usize) -> Option<&mut [u8]> {
        self.skip_full();
        let room = self.dsts.get(self.part)?.len() - self.offset;
        if room < len {
            return None;
        }
        let start = self.offset;
        self.offset += len;
        Some(&mut self.dsts[self.part][start..start + len])
    }

    /// Copies `bytes` into the next destinations (the caller checked that they fit).
    fn write(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            self.skip_full();
            let Some(dst) = self.dsts.get_mut(self.part) else { return };
            let n = (dst.len() - self.offset).min(bytes.len());
            crate::transport::copy::copy_bytes(&mut dst[self.offset..self.offset + n], &bytes[..n]);
            self.offset += n;
            bytes = &bytes[n..];
        }
    }
}

/// Cuts a stream of bytes into blocks of `T` for [`Payload::for_each_block`]: aligned runs of
/// at least [`DIRECT_BYTES`] pass as they are, the rest through an aligned staging buffer.
struct Blocks<T, F> {
    stage: [u64; STAGE_WORDS],
    filled: usize,
    f: F,
    elem: PhantomData<T>,
}

impl<T: bytemuck::Pod, E, F: FnMut(&[T]) -> Result<(), E>> Blocks<T, F> {
    const ELEM: usize = if size_of::<T>() == 0 { 1 } else { size_of::<T>() };
    const CAP: usize = (STAGE_WORDS * 8 / Self::ELEM) * Self::ELEM;

    fn feed(&mut self, mut rest: &[u8]) -> Result<(), E> {
        while !rest.is_empty() {
            let whole = rest.len() / Self::ELEM * Self::ELEM;
            if self.filled == 0
                && whole >= DIRECT_BYTES
                && let Ok(direct) = bytemuck::try_cast_slice::<u8, T>(&rest[..whole])
            {
                (self.f)(direct)?;
                rest = &rest[whole..];
                continue;
            }
            let n = (Self::CAP - self.filled).min(rest.len());
            bytemuck::cast_slice_mut::<u64, u8>(&mut self.stage)[self.filled..self.filled + n]
                .copy_from_slice(&rest[..n]);
            self.filled += n;
            rest = &rest[n..];
            if self.filled == Self::CAP {
                (self.f)(bytemuck::cast_slice(&bytemuck::cast_slice::<u64, u8>(&self.stage)[..Self::CAP]))?;
                self.filled = 0;
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Result<(), E> {
        if self.filled >= Self::ELEM {
            let whole = self.filled / Self::ELEM * Self::ELEM;
            (self.f)(bytemuck::cast_slice(&bytemuck::cast_slice::<u64, u8>(&self.stage)[..whole]))?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "framed_tests.rs"]
mod tests;
