//! The lane's record protection: AEGIS-128X2 or AES-128-GCM records ([`LaneAead`]) with keys
//! exported from the lane's TLS
//! 1.3 session (RFC 8446 §7.5), so the sender encrypts straight from the caller's buffer into
//! the buffers the writer sends, and the receiver decrypts a payload straight into the
//! caller's buffer (or, for a reduction, into a cached block it reduces from), with no copy in
//! between.
//!
//! The reader opens a group's header record and the records before its lead part (the
//! frames) as they arrive; the payload's records it leaves sealed ([`SealedRecord`]), each
//! where its plaintext belongs, with its nonce and key. Every record is authenticated before
//! its bytes are used; a payload record that fails fails the operation that reads it. Where
//! the cipher in use opens in place only (ring's AES-GCM, [`super::cipher`]), opening into the
//! caller's buffer would copy the record first anyway, so the reader opens the payload's
//! records as they arrive too, while they are in cache, and the receive copies or reduces
//! plaintext (a 4–16 MiB broadcast 13–24 % faster on a Zen 3).
//!
//! A group travels as a *header record* holding its length and where its largest part starts
//! (so the receiver can place that part 8-byte aligned, and reduce straight from it), then its
//! bytes in records of at most [`RECORD`] bytes. A record is `len: u32 LE | ciphertext | 16-byte tag`, the length as
//! associated data. Nonces are the exported IV xor a per-key record counter; a key protects at
//! most [`KEY_LIMIT`] bytes, after which both sides derive the next one (exporter context =
//! the key's epoch, the records' [`Direction`] — the lane's one connection carries both
//! ways, each under keys of its own — and the cipher), far inside AES-GCM's usage limits. A group length of `u64::MAX` is the
//! sender's goodbye.

use std::io::{self, Read};
use std::sync::Arc;

use super::cipher::{KEY_LEN, LaneAead, LaneKey, NONCE_LEN};
use rustls::{ClientConnection, ServerConnection};

pub(crate) use super::payload_records::{DEFER_MIN, Deferred, Kept, SealedRecord};
pub(crate) use super::sealed::Sealed;
use super::sealed::{Chunk, Cut, NextRecord, Parts};

/// Largest plaintext of one record.
pub(crate) const RECORD: usize = 256 << 10;
/// Sealed bytes per buffer a group is sealed into: a large group takes several, so buffers stay
/// small enough to reuse and the first goes out while the rest are sealed.
pub(crate) const CHUNK: usize = 512 << 10;
/// Bytes of a record's tag.
pub(crate) const TAG: usize = 16;
/// Bytes of a record's length header.
pub(crate) const HEADER: usize = 4;
/// Plaintext bytes one key protects before both sides move to the next.
const KEY_LIMIT: u64 = 1 << 36;
/// The exporter label of the lane's record keys.
const LABEL: &[u8] = b"EXPORTER-nexar-lane-records-v2";
/// The group length that says goodbye.
pub(crate) const GOODBYE: u64 = u64::MAX;
/// Plaintext bytes of a group's header record.
pub(crate) const HEAD: usize = 16;

/// What a group's header record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GroupHead {
    /// The group's length in bytes ([`GOODBYE`]: the sender's goodbye).
    pub len: u64,
    /// Where the group's largest part starts: a hint for placing it, never trusted for more.
    pub lead: u64,
}

impl GroupHead {
    pub(super) fn encode(self) -> [u8; HEAD] {
        let mut out = [0u8; HEAD];
        out[..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..].copy_from_slice(&self.lead.to_le_bytes());
        out
    }

    fn decode(plain: &[u8]) -> io::Result<GroupHead> {
        let word = |at: usize| plain.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        match (word(0), word(8)) {
            (Some(len), Some(lead)) => Ok(GroupHead { len, lead }),
            _ => Err(crypto_err(format!("a {}-byte group header", plain.len()))),
        }
    }
}

/// A TLS session keys can be exported from.
pub(crate) trait Exporter: Send + Sync + 'static {
    fn export(&self, out: &mut [u8], context: &[u8]) -> Result<(), rustls::Error>;
}

impl Exporter for ClientConnection {
    fn export(&self, out: &mut [u8], context: &[u8]) -> Result<(), rustls::Error> {
        self.export_keying_material(out, LABEL, Some(context)).map(|_| ())
    }
}

impl Exporter for ServerConnection {
    fn export(&self, out: &mut [u8], context: &[u8]) -> Result<(), rustls::Error> {
        self.export_keying_material(out, LABEL, Some(context)).map(|_| ())
    }
}

/// A lane's TLS session, shared by the sealer and the opener of its one connection.
pub(crate) type Session = Arc<dyn Exporter>;

#[cfg(test)]
pub(crate) use super::test_groups::{plain_group, sealed_group, test_group};

/// Which way records travel on a lane's connection: each way has keys of its own, so no
/// nonce is ever used by both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// From the rank that dialled the connection (the TLS client).
    FromDialler,
    /// From the rank that answered it (the TLS server).
    FromAnswerer,
}

impl Direction {
    /// The exporter context's last byte for this direction's keys.
    fn context_byte(self) -> u8 {
        match self {
            Direction::FromDialler => 0,
            Direction::FromAnswerer => 1,
        }
    }

    /// The other way.
    pub fn reverse(self) -> Direction {
        match self {
            Direction::FromDialler => Direction::FromAnswerer,
            Direction::FromAnswerer => Direction::FromDialler,
        }
    }
}

fn crypto_err(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("tcp lane records: {what}"))
}

/// One direction's key, IV and counters.
struct Keys {
    session: Session,
    direction: Direction,
    aead: LaneAead,
    key: Arc<LaneKey>,
    iv: [u8; NONCE_LEN],
    records: u64,
    bytes: u64,
    epoch: u64,
    limit: u64,
}

impl Keys {
    fn new(session: Session, direction: Direction, aead: LaneAead, limit: u64) -> io::Result<Keys> {
        let (key, iv) = derive(&*session, direction, aead, 0)?;
        Ok(Keys { session, direction, aead, key, iv, records: 0, bytes: 0, epoch: 0, limit })
    }

    /// What opening the next record, of `len` bytes, whose header is `header` and tag `tag`,
    /// later takes.
    fn sealed(&mut self, header: [u8; HEADER], len: usize, tag: [u8; TAG]) -> io::Result<SealedRecord> {
        let nonce = self.next(len)?;
        Ok(SealedRecord { header, nonce, tag, key: self.key.clone() })
    }

    /// The nonce of the next record of `len` bytes, moving to the next key first when this
    /// one has protected enough.
    fn next(&mut self, len: usize) -> io::Result<[u8; NONCE_LEN]> {
        if self.bytes + len as u64 > self.limit {
            self.epoch += 1;
            (self.key, self.iv) = derive(&*self.session, self.direction, self.aead, self.epoch)?;
            (self.records, self.bytes) = (0, 0);
        }
        let mut nonce = self.iv;
        for (n, c) in nonce[NONCE_LEN - 8..].iter_mut().zip(self.records.to_be_bytes()) {
            *n ^= c;
        }
        self.records += 1;
        self.bytes += len as u64;
        Ok(nonce)
    }
}

fn derive(
    session: &dyn Exporter,
    direction: Direction,
    aead: LaneAead,
    epoch: u64,
) -> io::Result<(Arc<LaneKey>, [u8; NONCE_LEN])> {
    let mut material = [0u8; KEY_LEN + NONCE_LEN];
    let mut context = [0u8; 10];
    context[..8].copy_from_slice(&epoch.to_le_bytes());
    context[8] = direction.context_byte();
    context[9] = aead.context_byte();
    session.export(&mut material, &context).map_err(crypto_err)?;
    let (key, iv) = material.split_at(KEY_LEN);
    let key = LaneKey::new(aead, key.try_into().map_err(crypto_err)?).map_err(crypto_err)?;
    Ok((Arc::new(key), iv.try_into().map_err(crypto_err)?))
}

/// How a lane's records are protected.
enum Protection {
    /// AEGIS-128X2 or AES-128-GCM with keys exported from the lane's TLS session (the
    /// default).
    Aead(Keys),
    /// None: records carry their bytes as they are and an all-zero tag
    /// (`NEXAR_BULK_ENCRYPTION=off`, for trusted fabrics only). The connection itself was
    /// still authenticated by TLS with the cluster's certificates.
    Plain,
}

impl Protection {
    fn new(session: &Session, direction: Direction, encrypt: Option<LaneAead>) -> io::Result<Protection> {
        Ok(match encrypt {
            Some(aead) => Protection::Aead(Keys::new(session.clone(), direction, aead, KEY_LIMIT)?),
            None => Protection::Plain,
        })
    }
}

/// Seals groups into records (the sending side of one connection).
pub(crate) struct Sealer {
    keys: Protection,
}

impl Sealer {
    /// Seals records going `direction` with keys exported from `session` (with the cipher
    /// `encrypt` names), or, when `encrypt` is `None`, frames records without
    /// encrypting them.
    pub fn new(session: &Session, direction: Direction, encrypt: Option<LaneAead>) -> io::Result<Sealer> {
        Ok(Sealer { keys: Protection::new(session, direction, encrypt)? })
    }

    /// A sealer that frames records without encrypting them.
    #[cfg(test)]
    pub fn plain_for_tests() -> Sealer {
        Sealer { keys: Protection::Plain }
    }

    /// Whether records are encrypted (not with `NEXAR_BULK_ENCRYPTION=off`).
    pub fn encrypts(&self) -> bool {
        matches!(self.keys, Protection::Aead(_))
    }

    /// Seals one group, the concatenation of `parts`, as records in buffers of about
    /// [`CHUNK`] bytes each (taken from `buffer`, so the caller can reuse them), handing each
    /// to `emit` as soon as it is sealed, so the wire starts before the group is all sealed.
    /// Stops when `emit` says no; `Ok(false)` then.
    ///
    /// The first record ends where a large part starts (a message's frames come alone ahead
    /// of its payload); after it, records of [`RECORD`] bytes run across parts. A record whose
    /// bytes lie in one part is encrypted straight from it into the buffer; one that spans
    /// parts is gathered first.
    pub fn seal_group(
        &mut self,
        parts: &[&[u8]],
        buffer: impl FnMut() -> Vec<u8>,
        emit: impl FnMut(Sealed, bool) -> bool,
    ) -> io::Result<bool> {
        self.seal_group_led(parts, lead_of(parts) as u64, buffer, emit)
    }

    /// [`seal_group`](Self::seal_group) with `lead` as the header's placement hint (an honest
    /// sender's is [`lead_of`] its parts).
    pub fn seal_group_led(
        &mut self,
        parts: &[&[u8]],
        lead: u64,
        mut buffer: impl FnMut() -> Vec<u8>,
        mut emit: impl FnMut(Sealed, bool) -> bool,
    ) -> io::Result<bool> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut out = Chunk::new(buffer());
        self.seal_from(&mut out, &GroupHead { len: len as u64, lead }.encode())?;
        let mut parts = Parts { parts, part: 0, offset: 0 };
        let mut left = len;
        while left > 0 {
            if out.used >= CHUNK && !emit(std::mem::replace(&mut out, Chunk::new(buffer())).finish(), false) {
                return Ok(false);
            }
            let n = match parts.next_record(left.min(RECORD), Cut::of(left == len)) {
                NextRecord::Direct(here) => {
                    self.seal_from(&mut out, here)?;
                    here.len()
                }
                NextRecord::Gathered(n) => {
                    self.seal_gathered(&mut out, &mut parts, n)?;
                    n
                }
            };
            left -= n;
        }
        Ok(emit(out.finish(), true))
    }

    /// Appends the goodbye (a header record with length [`GOODBYE`]).
    pub fn seal_goodbye(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        self.seal_record(out, &GroupHead { len: GOODBYE, lead: 0 }.encode())
    }

    /// Appends one record holding `plain`.
    fn seal_record(&mut self, out: &mut Vec<u8>, plain: &[u8]) -> io::Result<()> {
        let mut chunk = Chunk { used: out.len(), buf: std::mem::take(out) };
        let sealed = self.seal_from(&mut chunk, plain);
        *out = chunk.buf;
        sealed
    }

    /// Seals `plain` as one record, encrypting it straight into `out`.
    fn seal_from(&mut self, out: &mut Chunk, plain: &[u8]) -> io::Result<()> {
        let header = (plain.len() as u32).to_le_bytes();
        let (head, body, tag) = out.record(plain.len());
        head.copy_from_slice(&header);
        match &mut self.keys {
            Protection::Aead(keys) => {
                let nonce = keys.next(plain.len())?;
                keys.key.seal_into(nonce, &header, plain, body, tag).map_err(crypto_err)
            }
            Protection::Plain => {
                body.copy_from_slice(plain);
                tag.fill(0);
                Ok(())
            }
        }
    }

    /// Seals the next `n` bytes of `parts` as one record: AEGIS encrypts each part's bytes
    /// straight into `out`; AES-GCM, whose APIs take one input, gathers them there first.
    fn seal_gathered(&mut self, out: &mut Chunk, parts: &mut Parts, n: usize) -> io::Result<()> {
        let header = (n as u32).to_le_bytes();
        let (head, body, tag) = out.record(n);
        head.copy_from_slice(&header);
        match &mut self.keys {
            Protection::Aead(keys) => {
                let nonce = keys.next(n)?;
                keys.key.seal_pieces(nonce, &header, body, tag, |each| parts.take(n, each)).map_err(crypto_err)
            }
            Protection::Plain => {
                parts.copy_into(body);
                tag.fill(0);
                Ok(())
            }
        }
    }
}

/// Where the largest of `parts` (the first, of equals) starts in their concatenation: the
/// group's lead part, which the receiver places aligned.
pub(crate) fn lead_of(parts: &[&[u8]]) -> usize {
    let largest = parts.iter().enumerate().max_by_key(|(i, p)| (p.len(), usize::MAX - i)).map_or(0, |(i, _)| i);
    parts[..largest].iter().map(|p| p.len()).sum()
}

/// A part at least this long gets records of its own where records end at long parts (a
/// group's first record, [`Cut`](super::sealed::Cut)), so that a long payload's records
/// start where it starts: at [`DEFER_MIN`], where the receiver may leave them sealed.
pub(super) const DIRECT_MIN: usize = DEFER_MIN;

/// Bytes on the wire for a group of `len` bytes in one part.
#[cfg(test)]
fn sealed_len(len: usize) -> usize {
    let records = len.div_ceil(RECORD) + 1;
    len + HEAD + records * (HEADER + TAG)
}

/// Opens records (the receiving side of one connection).
pub(crate) struct Opener {
    keys: Protection,
}

impl Opener {
    /// Opens records coming `direction` with keys exported from `session` (the other end's
    /// session of the same connection), or, when `encrypt` is `None`, reads records as they are.
    pub fn new(session: &Session, direction: Direction, encrypt: Option<LaneAead>) -> io::Result<Opener> {
        Ok(Opener { keys: Protection::new(session, direction, encrypt)? })
    }

    /// Whether a payload's records may be read straight into the buffer a receive lends
    /// ([`super::landing`]): plaintext ones, and sealed ones where the cipher opens in place
    /// at no cost (AEGIS-128X2, ring's AES-GCM: [`LaneAead::lands`]). aws-lc's AES-GCM leaves
    /// them sealed and opens them straight into that buffer anyway.
    pub fn lands(&self) -> bool {
        match &self.keys {
            Protection::Plain => true,
            Protection::Aead(keys) => keys.aead.lands(),
        }
    }

    /// Takes the next record, whose header is `header` and tag `tag`, read straight into its
    /// destination `body` ([`super::landing`]): opened there in place; `Err(Forged)`, `body`
    /// zeroed, when it fails authentication. A plaintext record is already what it holds.
    pub fn open_landed(
        &mut self,
        header: [u8; HEADER],
        body: &mut [u8],
        tag: &[u8; TAG],
    ) -> io::Result<Result<(), super::payload_records::Forged>> {
        match &mut self.keys {
            Protection::Aead(keys) => {
                let nonce = keys.next(body.len())?;
                let opened = keys.key.open_in_place_tagged(nonce, &header, tag, body);
                Ok(opened.map_err(|_| super::payload_records::Forged))
            }
            Protection::Plain => Ok(Ok(())),
        }
    }

    /// Takes the next record, of `len` bytes, whose header is `header` and tag `tag`, without
    /// opening it: what opening it later takes (its ciphertext lies in two places,
    /// [`super::landing`]); `None` for a plaintext record, which needs no opening.
    pub fn keep_sealed(
        &mut self,
        header: [u8; HEADER],
        len: usize,
        tag: [u8; TAG],
    ) -> io::Result<Option<SealedRecord>> {
        match &mut self.keys {
            Protection::Aead(keys) => Ok(Some(keys.sealed(header, len, tag)?)),
            Protection::Plain => Ok(None),
        }
    }

    /// Reads the next group's header record: `None` at a clean end of the stream between
    /// groups; a length of [`GOODBYE`] when the peer said goodbye.
    pub fn read_group_head(&mut self, input: &mut impl Read) -> io::Result<Option<GroupHead>> {
        let mut header = [0u8; HEADER];
        let mut got = 0;
        while got < HEADER {
            match input.read(&mut header[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let mut body = [0u8; HEAD + TAG];
        if u32::from_le_bytes(header) as usize != HEAD {
            return Err(crypto_err(format!("a group header record of {} bytes", u32::from_le_bytes(header))));
        }
        input.read_exact(&mut body)?;
        let plain = self.open(header, &mut body)?;
        GroupHead::decode(plain).map(Some)
    }

    /// Reads a whole group with [`read_records`](Self::read_records) (the reader reads a group
    /// in two steps; tests read it in one).
    #[cfg(test)]
    pub fn read_group<S: GroupSink + ?Sized>(
        &mut self,
        input: &mut impl Read,
        buf: &mut S,
        defer_from: usize,
        deferred: &mut Vec<Deferred>,
    ) -> io::Result<()> {
        let len = buf.group_len();
        self.read_records(input, buf, 0, len, defer_from, deferred).map(drop)
    }

    /// Reads the records of a [`GroupSink::group_len`]-byte group into `buf` from byte `at`
    /// on, each where its plaintext belongs, until at least its first `until` bytes (at most
    /// its length) are in, and returns how many are (a whole number of records); the group
    /// ends up whole at the start of `buf` once `until` reaches its length. Records that start
    /// at `defer_from` or later and hold at least [`DEFER_MIN`] bytes stay sealed and are
    /// listed in `deferred` (whoever reads them opens them straight into their destination);
    /// the others are decrypted where they land.
    pub fn read_records<S: GroupSink + ?Sized>(
        &mut self,
        input: &mut impl Read,
        buf: &mut S,
        mut at: usize,
        until: usize,
        defer_from: usize,
        deferred: &mut Vec<Deferred>,
    ) -> io::Result<usize> {
        let len = buf.group_len();
        let until = until.min(len);
        while at < until {
            let mut header = [0u8; HEADER];
            input.read_exact(&mut header)?;
            let n = record_len(header, len, at)?;
            let record = &mut buf.room(at + n + TAG)[at..];
            input.read_exact(record)?;
            self.take_record(header, record, at, defer_from, deferred)?;
            at += n;
        }
        Ok(at)
    }

    /// Takes the record whose header is `header` and whose ciphertext and tag are `record`
    /// (read where its plaintext belongs, at byte `at` of its group): it is decrypted in
    /// place, or, when it starts at `defer_from` or later and holds at least [`DEFER_MIN`]
    /// bytes, left sealed and listed in `deferred`. An implementation that opens only in
    /// place (ring's) would copy a record left sealed to open it into its destination, so
    /// there such a record is opened at once, here, while the socket's copy of it is still in
    /// cache, and listed in `deferred` as opened (frames must still lie before it).
    pub fn take_record(
        &mut self,
        header: [u8; HEADER],
        record: &mut [u8],
        at: usize,
        defer_from: usize,
        deferred: &mut Vec<Deferred>,
    ) -> io::Result<()> {
        let n = record.len().saturating_sub(TAG);
        match &mut self.keys {
            Protection::Aead(keys) if at >= defer_from && n >= DEFER_MIN && !keys.key.opens_out_of_place() => {
                let nonce = keys.next(n)?;
                let kept = match keys.key.open_in_place(nonce, &header, record) {
                    Ok(_) => Kept::Opened,
                    // As with a record left sealed, the operation that reads it fails, not
                    // the lane: its bytes are zeros and nobody reads them.
                    Err(_) => {
                        record.fill(0);
                        Kept::Forged
                    }
                };
                deferred.push(Deferred { at, len: n, kept });
            }
            Protection::Aead(keys) if at >= defer_from && n >= DEFER_MIN => {
                let mut tag = [0u8; TAG];
                tag.copy_from_slice(&record[n..]);
                deferred.push(Deferred { at, len: n, kept: Kept::Sealed(keys.sealed(header, n, tag)?) });
            }
            _ => {
                self.open(header, record)?;
            }
        }
        Ok(())
    }

    fn open<'b>(&mut self, header: [u8; HEADER], record: &'b mut [u8]) -> io::Result<&'b [u8]> {
        let len = record.len() - TAG;
        match &mut self.keys {
            Protection::Aead(keys) => {
                let nonce = keys.next(len)?;
                let plain = keys
                    .key
                    .open_in_place(nonce, &header, record)
                    .map_err(|_| crypto_err("a record failed authentication"))?;
                Ok(plain)
            }
            Protection::Plain => Ok(&record[..len]),
        }
    }
}

/// The plaintext length of the record whose header is `header`, at byte `at` of a `len`-byte
/// group: refused when it is empty, over [`RECORD`], or runs past the group.
pub(crate) fn record_len(header: [u8; HEADER], len: usize, at: usize) -> io::Result<usize> {
    let n = u32::from_le_bytes(header) as usize;
    if n == 0 || n > RECORD || n > len.saturating_sub(at) {
        return Err(crypto_err(format!("a {n}-byte record with {} bytes of its group left", len.saturating_sub(at))));
    }
    Ok(n)
}

/// Where [`Opener::read_group`] puts a group: room that may grow as records arrive, so that
/// a group's announced length costs memory only once its bytes have come.
pub(crate) trait GroupSink {
    /// The group's length in bytes.
    fn group_len(&self) -> usize;
    /// The group's first `upto` bytes (at most its length and a tag), made room for: a slice
    /// of exactly `upto` bytes, whose first bytes hold what earlier calls' slices were given.
    fn room(&mut self, upto: usize) -> &mut [u8];
}

/// A slice holds a group of its length less a tag.
impl GroupSink for [u8] {
    fn group_len(&self) -> usize {
        self.len().saturating_sub(TAG)
    }

    fn room(&mut self, upto: usize) -> &mut [u8] {
        &mut self[..upto]
    }
}

/// As its slice.
impl GroupSink for Vec<u8> {
    fn group_len(&self) -> usize {
        self.as_slice().group_len()
    }

    fn room(&mut self, upto: usize) -> &mut [u8] {
        self.as_mut_slice().room(upto)
    }
}

#[cfg(test)]
#[path = "records_tests.rs"]
mod tests;
