//! The lane's record protection: AES-128-GCM records with keys exported from the lane's TLS
//! 1.3 session (RFC 8446 §7.5), so the sender encrypts straight from the caller's buffer into
//! the buffers the writer sends, and the receiver decrypts a payload straight into the
//! caller's buffer (or, for a reduction, into a cached block it reduces from), with no copy in
//! between.
//!
//! The reader opens a group's header record and the records before its lead part (the
//! frames) as they arrive; the payload's records it leaves sealed ([`SealedRecord`]), each
//! where its plaintext belongs, with its nonce and key. Every record is authenticated before
//! its bytes are used; a payload record that fails fails the operation that reads it.
//!
//! A group travels as a *header record* holding its length and where its largest part starts
//! (so the receiver can place that part 8-byte aligned, and reduce straight from it), then its
//! bytes in records of at most [`RECORD`] bytes. A record is `len: u32 LE | ciphertext | 16-byte tag`, the length as
//! associated data. Nonces are the exported IV xor a per-key record counter; a key protects at
//! most [`KEY_LIMIT`] bytes, after which both sides derive the next one (exporter context =
//! the key's epoch), far inside AES-GCM's usage limits. A group length of `u64::MAX` is the
//! sender's goodbye.

use std::io::{self, Read};
use std::sync::Arc;

use aws_lc_rs::aead::{AES_128_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use rustls::{ClientConnection, ServerConnection};

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
const LABEL: &[u8] = b"EXPORTER-nexar-lane-records-v1";
/// The group length that says goodbye.
pub(crate) const GOODBYE: u64 = u64::MAX;
/// Plaintext bytes of a group's header record.
const HEAD: usize = 16;

/// What a group's header record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GroupHead {
    /// The group's length in bytes ([`GOODBYE`]: the sender's goodbye).
    pub len: u64,
    /// Where the group's largest part starts: a hint for placing it, never trusted for more.
    pub lead: u64,
}

impl GroupHead {
    fn encode(self) -> [u8; HEAD] {
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
pub(crate) trait Exporter: Send + 'static {
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

fn crypto_err(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("tcp lane records: {what}"))
}

/// One direction's key, IV and counters.
struct Keys {
    session: Box<dyn Exporter>,
    key: Arc<LessSafeKey>,
    iv: [u8; NONCE_LEN],
    records: u64,
    bytes: u64,
    epoch: u64,
    limit: u64,
}

impl Keys {
    fn new(session: Box<dyn Exporter>, limit: u64) -> io::Result<Keys> {
        let (key, iv) = derive(&*session, 0)?;
        Ok(Keys { session, key, iv, records: 0, bytes: 0, epoch: 0, limit })
    }

    /// The nonce of the next record of `len` bytes, moving to the next key first when this
    /// one has protected enough.
    fn next(&mut self, len: usize) -> io::Result<[u8; NONCE_LEN]> {
        if self.bytes + len as u64 > self.limit {
            self.epoch += 1;
            (self.key, self.iv) = derive(&*self.session, self.epoch)?;
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

fn derive(session: &dyn Exporter, epoch: u64) -> io::Result<(Arc<LessSafeKey>, [u8; NONCE_LEN])> {
    let mut material = [0u8; 16 + NONCE_LEN];
    session.export(&mut material, &epoch.to_le_bytes()).map_err(crypto_err)?;
    let key = UnboundKey::new(&AES_128_GCM, &material[..16]).map_err(crypto_err)?;
    let mut iv = [0u8; NONCE_LEN];
    iv.copy_from_slice(&material[16..]);
    Ok((Arc::new(LessSafeKey::new(key)), iv))
}

/// How a lane's records are protected.
enum Protection {
    /// AES-128-GCM with keys exported from the lane's TLS session (the default).
    Aead(Keys),
    /// None: records carry their bytes as they are and an all-zero tag
    /// (`NEXAR_BULK_ENCRYPTION=off`, for trusted fabrics only). The connection itself was
    /// still authenticated by TLS with the cluster's certificates.
    Plain,
}

impl Protection {
    fn new(session: impl Exporter, encrypt: bool) -> io::Result<Protection> {
        Ok(if encrypt { Protection::Aead(Keys::new(Box::new(session), KEY_LIMIT)?) } else { Protection::Plain })
    }
}

/// Seals groups into records (the sending side of one connection).
pub(crate) struct Sealer {
    keys: Protection,
}

impl Sealer {
    /// Seals with keys exported from `session` (one direction of a lane), or, when `encrypt`
    /// is false, frames records without encrypting them.
    pub fn new(session: impl Exporter, encrypt: bool) -> io::Result<Sealer> {
        Ok(Sealer { keys: Protection::new(session, encrypt)? })
    }

    /// Seals one group, the concatenation of `parts`, as records in buffers of about
    /// [`CHUNK`] bytes each (taken from `buffer`, so the caller can reuse them), handing each
    /// to `emit` as soon as it is sealed, so the wire starts before the group is all sealed.
    /// Stops when `emit` says no; `Ok(false)` then.
    ///
    /// A record whose bytes lie in one part is encrypted straight from it into the buffer;
    /// only records that span small parts (a message's header and the first bytes of its
    /// payload) are gathered first. Records therefore end where a large part ends.
    pub fn seal_group(
        &mut self,
        parts: &[&[u8]],
        mut buffer: impl FnMut() -> Vec<u8>,
        mut emit: impl FnMut(Sealed, bool) -> bool,
    ) -> io::Result<bool> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let largest = parts.iter().enumerate().max_by_key(|(i, p)| (p.len(), usize::MAX - i)).map_or(0, |(i, _)| i);
        let lead = parts[..largest].iter().map(|p| p.len()).sum::<usize>();
        let mut out = Chunk::new(buffer());
        self.seal_from(&mut out, &GroupHead { len: len as u64, lead: lead as u64 }.encode())?;
        let mut parts = Parts { parts, part: 0, offset: 0 };
        let mut left = len;
        while left > 0 {
            if out.used >= CHUNK && !emit(std::mem::replace(&mut out, Chunk::new(buffer())).finish(), false) {
                return Ok(false);
            }
            let here = parts.current();
            let n = left.min(RECORD);
            let n = if here.len() >= n || here.len() >= DIRECT_MIN {
                let n = n.min(here.len());
                self.seal_from(&mut out, &here[..n])?;
                parts.offset += n;
                n
            } else {
                let n = parts.small_run(n);
                self.seal_gathered(&mut out, &mut parts, n)?;
                n
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
                let nonce = Nonce::assume_unique_for_key(keys.next(plain.len())?);
                keys.key.seal_out_of_place_scatter(nonce, Aad::from(header), plain, body, &[], tag).map_err(crypto_err)
            }
            Protection::Plain => {
                body.copy_from_slice(plain);
                tag.fill(0);
                Ok(())
            }
        }
    }

    /// Seals the next `n` bytes of `parts` as one record, gathering them into `out` first.
    fn seal_gathered(&mut self, out: &mut Chunk, parts: &mut Parts, n: usize) -> io::Result<()> {
        let header = (n as u32).to_le_bytes();
        let (head, body, tag) = out.record(n);
        head.copy_from_slice(&header);
        parts.copy_into(body);
        match &mut self.keys {
            Protection::Aead(keys) => {
                let nonce = Nonce::assume_unique_for_key(keys.next(n)?);
                let sealed = keys.key.seal_in_place_separate_tag(nonce, Aad::from(header), body).map_err(crypto_err)?;
                tag.copy_from_slice(sealed.as_ref());
            }
            Protection::Plain => tag.fill(0),
        }
        Ok(())
    }
}

/// A part at least this long gets records of its own, ending where it ends, rather than
/// sharing a gathered record with the next part. At [`DEFER_MIN`], so that a payload made of
/// several buffers (a plan's bucket) is sealed straight from each, and its receiver, whose
/// buffers end at the same places, decrypts each record straight into its own buffer.
const DIRECT_MIN: usize = DEFER_MIN;

/// The most bytes one buffer holds: it is handed on once it reaches [`CHUNK`], so it takes at
/// most one more record, besides the group's header record.
const CHUNK_CAPACITY: usize = CHUNK + 2 * (HEADER + TAG) + RECORD + 8;

/// A buffer being filled with records. `buf[..used]` is sealed output; bytes past `used` are
/// left from the buffer's last use and are overwritten before they are sent, so a reused
/// buffer is not zeroed again.
struct Chunk {
    buf: Vec<u8>,
    used: usize,
}

impl Chunk {
    fn new(mut buf: Vec<u8>) -> Chunk {
        buf.reserve(CHUNK_CAPACITY.saturating_sub(buf.len()));
        Chunk { buf, used: 0 }
    }

    /// The next record's header, body and tag, `len` bytes of body, for the caller to fill.
    fn record(&mut self, len: usize) -> (&mut [u8], &mut [u8], &mut [u8]) {
        let (start, end) = (self.used, self.used + HEADER + len + TAG);
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
        self.used = end;
        let (head, rest) = self.buf[start..end].split_at_mut(HEADER);
        let (body, tag) = rest.split_at_mut(len);
        (head, body, tag)
    }

    fn finish(self) -> Sealed {
        Sealed { buf: self.buf, len: self.used }
    }
}

/// Sealed records ready for the wire: the first `len` bytes of a buffer. The buffer keeps its
/// full length, so when it is reused no part of it is zeroed again.
pub(crate) struct Sealed {
    buf: Vec<u8>,
    len: usize,
}

impl Sealed {
    /// The buffer, for sealing into again.
    pub fn into_buffer(self) -> Vec<u8> {
        self.buf
    }
}

impl From<Vec<u8>> for Sealed {
    fn from(buf: Vec<u8>) -> Sealed {
        Sealed { len: buf.len(), buf }
    }
}

impl std::ops::Deref for Sealed {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// A read position in a group's parts.
struct Parts<'p, 'b> {
    parts: &'p [&'b [u8]],
    part: usize,
    offset: usize,
}

impl<'b> Parts<'_, 'b> {
    /// What is left of the current part (empty at the end).
    fn current(&mut self) -> &'b [u8] {
        while self.part < self.parts.len() && self.offset == self.parts[self.part].len() {
            (self.part, self.offset) = (self.part + 1, 0);
        }
        self.parts.get(self.part).map_or(&[], |p| &p[self.offset..])
    }

    /// How many of the next bytes (at most `max`) lie in small parts: a gathered record stops
    /// where a part of [`DIRECT_MIN`] bytes or more starts, so that part's bytes are sealed
    /// where they lie.
    fn small_run(&mut self, max: usize) -> usize {
        let mut run = self.current().len().min(max);
        for part in &self.parts[self.part + 1..] {
            if run == max || part.len() >= DIRECT_MIN {
                break;
            }
            run += part.len().min(max - run);
        }
        run
    }

    /// Copies the next `dst.len()` bytes into `dst`.
    fn copy_into(&mut self, dst: &mut [u8]) {
        let mut at = 0;
        while at < dst.len() {
            let here = self.current();
            let take = here.len().min(dst.len() - at);
            dst[at..at + take].copy_from_slice(&here[..take]);
            (self.offset, at) = (self.offset + take, at + take);
        }
    }
}

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
    /// Opens with keys exported from `session` (the other end of the sealer's connection),
    /// or, when `encrypt` is false, reads records as they are.
    pub fn new(session: impl Exporter, encrypt: bool) -> io::Result<Opener> {
        Ok(Opener { keys: Protection::new(session, encrypt)? })
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

    /// Reads the records of a [`GroupSink::group_len`]-byte group into `buf`, each where its
    /// plaintext belongs, so the group ends up whole at the start of `buf`. Records that start
    /// at `defer_from` or later and hold at least [`DEFER_MIN`] bytes stay sealed and are
    /// listed in `deferred` (whoever reads them opens them straight into their destination);
    /// the others are decrypted where they land.
    pub fn read_group<S: GroupSink + ?Sized>(
        &mut self,
        input: &mut impl Read,
        buf: &mut S,
        defer_from: usize,
        deferred: &mut Vec<Deferred>,
    ) -> io::Result<()> {
        let len = buf.group_len();
        let mut at = 0;
        while at < len {
            let mut header = [0u8; HEADER];
            input.read_exact(&mut header)?;
            let n = u32::from_le_bytes(header) as usize;
            if n == 0 || n > RECORD || n > len - at {
                return Err(crypto_err(format!("a {n}-byte record with {} bytes of its group left", len - at)));
            }
            let record = &mut buf.room(at + n + TAG)[at..];
            input.read_exact(record)?;
            match &mut self.keys {
                Protection::Aead(keys) if at >= defer_from && n >= DEFER_MIN => {
                    let nonce = keys.next(n)?;
                    let mut tag = [0u8; TAG];
                    tag.copy_from_slice(&record[n..]);
                    let sealed = SealedRecord { header, nonce, tag, key: keys.key.clone() };
                    deferred.push(Deferred { at, len: n, sealed });
                }
                _ => {
                    self.open(header, record)?;
                }
            }
            at += n;
        }
        Ok(())
    }

    fn open<'b>(&mut self, header: [u8; HEADER], record: &'b mut [u8]) -> io::Result<&'b [u8]> {
        let len = record.len() - TAG;
        match &mut self.keys {
            Protection::Aead(keys) => {
                let nonce = Nonce::assume_unique_for_key(keys.next(len)?);
                let plain = keys
                    .key
                    .open_in_place(nonce, Aad::from(header), record)
                    .map_err(|_| crypto_err("a record failed authentication"))?;
                Ok(plain)
            }
            Protection::Plain => Ok(&record[..len]),
        }
    }
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

/// The shortest record [`Opener::read_group`] leaves sealed: it bounds the bookkeeping per
/// group to a few bytes per [`DEFER_MIN`] bytes, whatever the sender's record sizes.
pub(crate) const DEFER_MIN: usize = 16 << 10;

/// A record of a group that [`Opener::read_group`] left sealed, at byte `at` of the group.
#[derive(Clone, Debug)]
pub(crate) struct Deferred {
    /// Where the record's ciphertext starts in the group (where its plaintext belongs).
    pub at: usize,
    /// Its length in bytes.
    pub len: usize,
    /// What opening it takes besides the ciphertext.
    pub sealed: SealedRecord,
}

/// What opening a record that was left sealed needs besides its ciphertext: its header (the
/// associated data), nonce, tag and key. Opening it twice is harmless; a record that fails
/// authentication yields [`Forged`] and no bytes anyone should trust.
#[derive(Clone)]
pub(crate) struct SealedRecord {
    header: [u8; HEADER],
    nonce: [u8; NONCE_LEN],
    tag: [u8; TAG],
    key: Arc<LessSafeKey>,
}

/// A record that failed authentication: its bytes were altered after they were sealed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Forged;

impl SealedRecord {
    /// Authenticates `cipher` (this record's ciphertext) and decrypts it into `out`, which
    /// must be as long.
    pub fn open_into(&self, cipher: &[u8], out: &mut [u8]) -> Result<(), Forged> {
        let nonce = Nonce::assume_unique_for_key(self.nonce);
        self.key.open_separate_gather(nonce, Aad::from(self.header), cipher, &self.tag, out).map_err(|_| Forged)
    }
}

impl std::fmt::Debug for SealedRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SealedRecord({} bytes)", u32::from_le_bytes(self.header))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ends of a session export the same material; a fake one derives it from the context.
    struct Fake(u8);

    impl Exporter for Fake {
        fn export(&self, out: &mut [u8], context: &[u8]) -> Result<(), rustls::Error> {
            for (i, b) in out.iter_mut().enumerate() {
                *b = self.0 ^ context[0] ^ i as u8;
            }
            Ok(())
        }
    }

    fn pair(limit: u64) -> (Sealer, Opener) {
        let sealer = Sealer { keys: Protection::Aead(Keys::new(Box::new(Fake(7)), limit).unwrap()) };
        let opener = Opener { keys: Protection::Aead(Keys::new(Box::new(Fake(7)), limit).unwrap()) };
        (sealer, opener)
    }

    /// One group as the lane reads it (records from the lead part on left sealed), then with
    /// those records opened as a reader of the payload opens them.
    fn receive(opener: &mut Opener, wire: &mut &[u8]) -> io::Result<Option<Vec<u8>>> {
        match opener.read_group_head(wire)? {
            None => Ok(None),
            Some(GroupHead { len: GOODBYE, .. }) => Ok(None),
            Some(GroupHead { len, lead }) => {
                let mut buf = vec![0u8; len as usize + TAG];
                let mut deferred = Vec::new();
                opener.read_group(wire, &mut buf, lead as usize, &mut deferred)?;
                buf.truncate(len as usize);
                for d in deferred {
                    assert!(d.at >= lead as usize && d.len >= DEFER_MIN);
                    let mut plain = vec![0u8; d.len];
                    d.sealed.open_into(&buf[d.at..d.at + d.len], &mut plain).map_err(|_| crypto_err("forged"))?;
                    buf[d.at..d.at + d.len].copy_from_slice(&plain);
                }
                Ok(Some(buf))
            }
        }
    }

    #[test]
    fn records_left_sealed_open_only_unaltered_and_at_their_place() {
        let (mut sealer, mut opener) = pair(KEY_LIMIT);
        let payload: Vec<u8> = (0..RECORD + DEFER_MIN).map(|i| (i % 241) as u8).collect();
        let mut wire = Vec::new();
        sealer
            .seal_group(&[b"frames", &payload], Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        let mut r = &wire[..];
        let GroupHead { len, lead } = opener.read_group_head(&mut r).unwrap().unwrap();
        assert_eq!(lead, 6, "the payload leads");
        let mut buf = vec![0u8; len as usize + TAG];
        let mut deferred = Vec::new();
        opener.read_group(&mut r, &mut buf, lead as usize, &mut deferred).unwrap();
        assert_eq!(&buf[..6], b"frames", "the frames' record was opened");
        let places: Vec<(usize, usize)> = deferred.iter().map(|d| (d.at, d.len)).collect();
        assert_eq!(places, [(6, RECORD), (6 + RECORD, DEFER_MIN)]);
        let d = &deferred[1];
        let mut plain = vec![0u8; d.len];
        d.sealed.open_into(&buf[d.at..d.at + d.len], &mut plain).unwrap();
        assert_eq!(plain, payload[RECORD..]);
        // Altered ciphertext, or another record's bytes, fail to open.
        let mut altered = buf[d.at..d.at + d.len].to_vec();
        altered[100] ^= 1;
        assert_eq!(d.sealed.open_into(&altered, &mut plain), Err(Forged));
        let first = &deferred[0];
        assert_eq!(first.sealed.open_into(&buf[d.at..d.at + d.len], &mut plain), Err(Forged));
    }

    #[test]
    fn plain_records_carry_groups_as_they_are_and_leave_nothing_sealed() {
        let (mut sealer, mut opener) = (Sealer { keys: Protection::Plain }, Opener { keys: Protection::Plain });
        let payload: Vec<u8> = (0..2 * RECORD + DEFER_MIN + 3).map(|i| (i % 251) as u8).collect();
        for parts in [vec![&b"frames"[..], &payload[..]], vec![&payload[..7], &payload[7..]], vec![&payload[..1]]] {
            let mut wire = Vec::new();
            // Reused buffers with old bytes in them: nothing of them may reach the wire.
            sealer
                .seal_group(
                    &parts,
                    || vec![0xfd; 4 * RECORD],
                    |c, _| {
                        wire.extend_from_slice(&c);
                        true
                    },
                )
                .unwrap();
            let whole: Vec<u8> = parts.concat();
            // The largest part's first bytes travel as they are (it starts a record).
            let largest = parts.iter().max_by_key(|p| p.len()).unwrap();
            let probe = &largest[..largest.len().min(64)];
            assert!(wire.windows(probe.len()).any(|w| w == probe), "plaintext on the wire");
            assert!(!wire.contains(&0xfd), "stale buffer bytes on the wire"); // the payload is below 251
            let mut r = &wire[..];
            let GroupHead { len, lead } = opener.read_group_head(&mut r).unwrap().unwrap();
            let mut buf = vec![0u8; len as usize + TAG];
            let mut deferred = Vec::new();
            opener.read_group(&mut r, &mut buf, lead as usize, &mut deferred).unwrap();
            assert!(deferred.is_empty(), "plain records are never left sealed");
            assert_eq!(&buf[..len as usize], &whole[..]);
            assert!(r.is_empty());
        }
        // A record length past the group's end is still refused.
        let mut wire = Vec::new();
        sealer
            .seal_group(&[&payload[..100]], Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        let mut r = &wire[..];
        opener.read_group_head(&mut r).unwrap().unwrap();
        let mut short = vec![0u8; 50 + TAG];
        assert!(opener.read_group(&mut r, &mut short, 0, &mut Vec::new()).is_err());
    }

    #[test]
    fn payloads_with_sealed_records_read_back_exactly_and_refuse_altered_bytes() {
        use crate::transport::framed::{BlockError, Payload, PayloadError};
        let (mut sealer, mut opener) = pair(3 * RECORD as u64);
        let frames = [7u8; 21];
        let values: Vec<u32> = (0..(2 * RECORD + 3 * DEFER_MIN) as u32 / 4 + 5).collect();
        let payload: &[u8] = bytemuck::cast_slice(&values);
        for group_at in [0usize, 3] {
            let mut wire = Vec::new();
            sealer
                .seal_group(&[&frames, payload], Vec::new, |c, _| {
                    wire.extend_from_slice(&c);
                    true
                })
                .unwrap();
            let mut r = &wire[..];
            let GroupHead { len, lead } = opener.read_group_head(&mut r).unwrap().unwrap();
            // The group at an odd place: the payload is misaligned for the first pass.
            let mut buf = vec![0u8; group_at + len as usize + TAG];
            let mut deferred = Vec::new();
            opener.read_group(&mut r, &mut buf[group_at..], lead as usize, &mut deferred).unwrap();
            assert!(deferred.len() >= 3, "{} records left sealed", deferred.len());
            let group = bytes::Bytes::from(buf[group_at..group_at + len as usize].to_vec());
            let body = frames.len()..len as usize;
            let read = Payload::from_group(&group, body.clone(), &deferred).unwrap();
            assert_eq!(read.to_vec().unwrap(), payload);
            assert_eq!(read.to_chunks().unwrap().concat(), payload);
            let mut seen = Vec::new();
            read.for_each_block::<u32, ()>(|b| {
                seen.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, values);
            // Into several destinations: cut inside records (opened, then spread) and at
            // their edges (decrypted in place), with an empty one between.
            for cuts in [vec![1usize, 5000, 5000, RECORD + 3], vec![RECORD, RECORD + 1, 2 * RECORD - 4]] {
                let mut out = vec![0u8; payload.len()];
                let mut dsts: Vec<&mut [u8]> = Vec::new();
                let mut rest = &mut out[..];
                let mut at = 0;
                for cut in cuts {
                    let (head, tail) = rest.split_at_mut(cut - at);
                    dsts.push(head);
                    (rest, at) = (tail, cut);
                }
                dsts.push(rest);
                read.copy_to_parts(&mut dsts).unwrap();
                assert_eq!(out, payload);
            }
            let mut short = [0u8; 4];
            assert!(matches!(read.copy_to_parts(&mut [&mut short]), Err(PayloadError::Length { dst: 4, .. })));
            // A sealed record outside the payload is refused.
            assert!(Payload::from_group(&group, body.start + 1..body.end, &deferred).is_err());
            assert!(Payload::from_group(&group, body.start..body.end - 1, &deferred).is_err());
            // Altered ciphertext is refused however it is read.
            let mut altered = group.to_vec();
            altered[deferred[1].at + 9] ^= 0x40;
            let altered = Payload::from_group(&bytes::Bytes::from(altered), body.clone(), &deferred).unwrap();
            assert!(matches!(altered.to_vec(), Err(PayloadError::Forged { len }) if len == deferred[1].len));
            let visited = altered.for_each_block::<u32, ()>(|_| Ok(()));
            assert!(matches!(visited, Err(BlockError::Payload(PayloadError::Forged { .. }))));
            assert!(altered.to_chunks().is_err());
            let mut whole = vec![0u8; payload.len()];
            let (x, y) = whole.split_at_mut(deferred[1].at - body.start + 7);
            assert!(matches!(altered.copy_to_parts(&mut [x, y]), Err(PayloadError::Forged { .. })));
            // Decrypted straight into the caller's buffer, the altered record leaves no byte
            // there but old values, authenticated bytes and zeros where it failed.
            const OLD: u8 = 0xA5;
            for parts in [1usize, 2] {
                let mut dst = vec![OLD; payload.len()];
                let failed = deferred[1].at - body.start..deferred[1].at - body.start + deferred[1].len;
                let copied = if parts == 1 {
                    altered.copy_to(&mut dst)
                } else {
                    let (x, y) = dst.split_at_mut(failed.start);
                    altered.copy_to_parts(&mut [x, y])
                };
                assert!(matches!(copied, Err(PayloadError::Forged { .. })));
                assert!(dst[failed.clone()].iter().all(|&b| b == 0), "the failed record's bytes are cleared");
                for (i, &b) in dst.iter().enumerate().filter(|(i, _)| !failed.contains(i)) {
                    assert!(b == OLD || b == payload[i], "byte {i}: {b:#x} is neither old nor the payload's");
                }
            }
        }
    }

    #[test]
    fn frames_are_parsed_only_from_opened_records_whatever_the_senders_placement_hint() {
        use crate::proto::frame::{message_frame, raw_header};
        use crate::proto::message::{PeerMsg, encode};
        use crate::transport::bulk::decode_sealed_group;
        let payload = vec![9u8; 4 * DEFER_MIN];
        let len = payload.len() as u64 / 4; // f32 elements
        let msg = PeerMsg::Coll {
            comm: 0,
            seq: 1,
            kind: 1,
            op: 1,
            dtype: 1,
            root: 0,
            count: len,
            fingerprint: 0,
            segment: 0,
            part: 0,
            len,
        };
        let (message, raw) = (message_frame(&encode(&msg).unwrap()), raw_header(payload.len() as u64));
        let (mut sealer, mut opener) = pair(1 << 30);
        let whole = [&message[..], &raw[..], &payload[..]].concat();
        // An honest sender's parts; then a hostile one's: one part, so its hint says that the
        // payload starts at byte 0 and the record holding the frames is left sealed.
        for (parts, hostile) in [(vec![&message[..], &raw[..], &payload[..]], false), (vec![&whole[..]], true)] {
            let mut wire = Vec::new();
            sealer
                .seal_group(&parts, Vec::new, |c, _| {
                    wire.extend_from_slice(&c);
                    true
                })
                .unwrap();
            let mut r = &wire[..];
            let head = opener.read_group_head(&mut r).unwrap().unwrap();
            let mut buf = vec![0u8; head.len as usize + TAG];
            let mut deferred = Vec::new();
            opener.read_group(&mut r, &mut buf, head.lead as usize, &mut deferred).unwrap();
            buf.truncate(head.len as usize);
            let decoded = decode_sealed_group(&bytes::Bytes::from(buf), &deferred, 1 << 30);
            if hostile {
                assert_eq!(deferred.first().map(|d| d.at), Some(0), "the frames were left sealed");
                let err = decoded.unwrap_err().to_string();
                assert!(err.contains("group ends inside a frame header at byte 0"), "{err}");
            } else {
                let (got, read) = decoded.unwrap();
                assert_eq!((got, read.to_vec().unwrap()), (msg.clone(), payload.clone()));
            }
        }
    }

    #[test]
    fn groups_of_many_records_round_trip_across_key_changes() {
        // A key limit of two records' worth forces several key changes.
        let (mut sealer, mut opener) = pair(2 * RECORD as u64);
        let big: Vec<u8> = (0..RECORD * 3 + 17).map(|i| (i % 251) as u8).collect();
        let groups: Vec<Vec<&[u8]>> = vec![vec![b"head", &big[..]], vec![], vec![&big[..5], &big[5..RECORD + 9]]];
        let mut wire = Vec::new();
        for g in &groups {
            let mut chunks = Vec::new();
            assert!(
                sealer
                    .seal_group(g, Vec::new, |c, _| {
                        chunks.push(c);
                        true
                    })
                    .unwrap()
            );
            assert!(chunks.iter().all(|c| c.len() <= CHUNK + RECORD + HEADER + TAG));
            wire.extend(chunks.iter().flat_map(|c| c.iter()));
        }
        sealer.seal_goodbye(&mut wire).unwrap();
        let mut r = &wire[..];
        for g in &groups {
            assert_eq!(receive(&mut opener, &mut r).unwrap().unwrap(), g.concat());
        }
        assert!(receive(&mut opener, &mut r).unwrap().is_none(), "goodbye");
        assert!(r.is_empty());
        let Protection::Aead(keys) = &opener.keys else { panic!("the lane encrypts") };
        assert!(keys.epoch >= 2, "the keys changed ({} epochs)", keys.epoch);
    }

    /// Reads one group off `wire` as the lane and the executor do: the head, the records (the
    /// payload's left sealed), then the payload through [`Payload`]. `frames` bytes of frames
    /// lead the group.
    fn read_as_the_lane_does(wire: &[u8], frames: usize) -> Result<Vec<u8>, String> {
        use crate::transport::framed::Payload;
        let (_, mut opener) = pair(KEY_LIMIT);
        let mut r = wire;
        let head = opener.read_group_head(&mut r).map_err(|e| e.to_string())?;
        let Some(GroupHead { len, lead }) = head else { return Err("no group".into()) };
        if len > 4 * RECORD as u64 {
            return Err(format!("a {len}-byte group is over the limit"));
        }
        let mut buf = vec![0u8; len as usize + TAG];
        let mut deferred = Vec::new();
        opener.read_group(&mut r, &mut buf, lead as usize, &mut deferred).map_err(|e| e.to_string())?;
        let group = bytes::Bytes::from(buf[..len as usize].to_vec());
        let payload = Payload::from_group(&group, frames.min(len as usize)..len as usize, &deferred)
            .map_err(|e| e.to_string())?;
        let mut out = group[..frames.min(len as usize)].to_vec();
        out.extend(payload.to_vec().map_err(|e| e.to_string())?);
        Ok(out)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn an_altered_byte_anywhere_is_refused_and_never_read_as_data(
            payload_len in 0usize..(2 * RECORD + 3 * DEFER_MIN),
            at in proptest::prelude::any::<proptest::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let frames = [9u8; 40];
            let payload: Vec<u8> = (0..payload_len).map(|i| (i * 13 % 251) as u8).collect();
            let (mut sealer, _) = pair(KEY_LIMIT);
            let mut wire = Vec::new();
            sealer
                .seal_group(&[&frames, &payload], Vec::new, |c, _| {
                    wire.extend_from_slice(&c);
                    true
                })
                .unwrap();
            let whole = [&frames[..], &payload].concat();
            proptest::prop_assert_eq!(read_as_the_lane_does(&wire, frames.len()), Ok(whole));
            let i = at.index(wire.len());
            wire[i] ^= flip;
            let read = read_as_the_lane_does(&wire, frames.len());
            proptest::prop_assert!(read.is_err(), "byte {} altered, yet the group read back", i);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        #[test]
        fn any_parts_round_trip_through_dirty_buffers(
            lens in proptest::collection::vec(0usize..(3 * RECORD / 2), 0..6),
            junk in 0usize..(CHUNK + RECORD),
        ) {
            let data: Vec<u8> = (0..lens.iter().sum::<usize>()).map(|i| (i * 31 % 251) as u8).collect();
            let mut parts: Vec<&[u8]> = Vec::new();
            let mut at = 0;
            for len in &lens {
                parts.push(&data[at..at + len]);
                at += len;
            }
            let (mut sealer, mut opener) = pair(RECORD as u64 * 2);
            let mut wire = Vec::new();
            for _ in 0..2 {
                sealer
                    .seal_group(&parts, || vec![0xAA; junk], |c, _| {
                        wire.extend_from_slice(&c);
                        true
                    })
                    .unwrap();
            }
            let mut r = &wire[..];
            for _ in 0..2 {
                proptest::prop_assert_eq!(receive(&mut opener, &mut r).unwrap().unwrap(), data.clone());
            }
            proptest::prop_assert!(r.is_empty());
        }
    }

    #[test]
    fn reused_buffers_and_mixed_parts_round_trip() {
        let (mut sealer, mut opener) = pair(KEY_LIMIT);
        let big: Vec<u8> = (0..RECORD * 2 + 3).map(|i| (i * 7 % 253) as u8).collect();
        let small: Vec<u8> = (0..DIRECT_MIN - 1).map(|i| (i % 13) as u8).collect();
        // Small parts between large ones, parts that end inside a record, empty parts.
        let group: Vec<&[u8]> =
            vec![b"h", &small, &[], &big[..DIRECT_MIN], &small[..10], &big, &small, b"tail", &big[..RECORD + 1]];
        // Buffers come back dirty and of any length, as the writer hands them back.
        let mut junk = 0u8;
        let mut dirty = || {
            junk = junk.wrapping_add(41);
            vec![junk; (junk as usize) * 4099]
        };
        let mut wire = Vec::new();
        for _ in 0..2 {
            sealer
                .seal_group(&group, &mut dirty, |c, _| {
                    wire.extend_from_slice(&c);
                    true
                })
                .unwrap();
        }
        let mut r = &wire[..];
        for _ in 0..2 {
            assert_eq!(receive(&mut opener, &mut r).unwrap().unwrap(), group.concat());
        }
        assert!(r.is_empty(), "{} bytes left over", r.len());
    }

    #[test]
    fn tampering_reordering_and_bad_lengths_are_refused() {
        let (mut sealer, _) = pair(KEY_LIMIT);
        let mut wire = Vec::new();
        sealer
            .seal_group(&[b"payload bytes"], Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        sealer
            .seal_group(&[b"second"], Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        let first_len = sealed_len(13);
        // A flipped bit anywhere fails authentication (or the length checks).
        for i in [0, 5, HEADER + 3, first_len - 1] {
            let mut bad = wire.clone();
            bad[i] ^= 0x10;
            let (_, mut opener) = pair(KEY_LIMIT);
            assert!(receive(&mut opener, &mut &bad[..]).is_err(), "flip at {i}");
        }
        // The second group replayed first fails: the counter says where a record belongs.
        let (_, mut opener) = pair(KEY_LIMIT);
        assert!(receive(&mut opener, &mut &wire[first_len..]).is_err());
        // A record longer than what is left of its group is refused before it is read.
        let (mut sealer, mut opener) = pair(KEY_LIMIT);
        let mut wire = Vec::new();
        sealer.seal_record(&mut wire, &GroupHead { len: 4, lead: 0 }.encode()).unwrap();
        sealer.seal_record(&mut wire, b"too long").unwrap();
        let err = receive(&mut opener, &mut &wire[..]).unwrap_err();
        assert!(err.to_string().contains("8-byte record with 4 bytes"), "{err}");
        // A stream that ends inside a group is an error, not a goodbye.
        let (mut sealer, mut opener) = pair(KEY_LIMIT);
        let mut wire = Vec::new();
        sealer
            .seal_group(&[&[1u8; 100][..]], Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        assert!(receive(&mut opener, &mut &wire[..wire.len() - 1]).is_err());
        assert!(receive(&mut pair(KEY_LIMIT).1, &mut &[][..]).unwrap().is_none());
    }
}
