//! A plaintext group's payload read straight into the buffer of the receive that waits for it
//! (`NEXAR_BULK_ENCRYPTION=off`, a lane read on the rank's runtime).
//!
//! A receive that spins for a collective message polls its lane's reader itself
//! ([`Drivable::drive`](crate::transport::drivable::Drivable::drive)) and lends it, for each
//! such poll, the part of its buffer the payload belongs in ([`crate::transport::lent`]). Once
//! the reader has admitted that message, it reads the payload's records from the socket into
//! that buffer, during those polls only, instead of into a pooled buffer that the receive
//! would copy out of afterwards: the payload crosses memory once, as with MPI's TCP transport
//! (a 1 MiB broadcast 20 % faster here). Nothing reads on after the receive stops lending:
//! when its reader's own task polls it without a loan for [`LENT_GRACE`] (the receive was
//! dropped), or at once when the receive says it stops spinning ([`Spun::park`]), the rest of
//! the group goes into the pooled buffer as usual, and the message tells the receive how many
//! bytes it already has ([`Landed`]).
//!
//! Sealed records land too where the lane's AES-GCM opens in place (ring's): each is read into
//! the buffer and opened there once its tag is in, so the receive copies nothing (before, the
//! reader opened it in its pooled buffer and the receive copied the plaintext out). A record
//! that fails authentication there is zeroed and fails the receive. A record the loan ended
//! inside lies partly in the buffer and partly in the pooled group: the receive opens it once
//! it copies the rest in ([`Straddle`]); any other receive gets an error, never those bytes.
//! A receive dropped while a sealed record lands leaves that record's ciphertext in its
//! buffer (as a dropped receive leaves any partly received payload), never unauthenticated
//! plaintext: a record is opened only once whole, and zeroed if it fails.
//!
//! A message whose receive is not lending yet when the reader has admitted it waits in the
//! socket for up to [`LEND_WAIT`]: its rank is often still busy with the step or message
//! before (a pipelined broadcast's next segment arrives while the last is being taken), and
//! reading it into the pooled buffer at once would cost the copy this module saves (the
//! 16 and 64 MiB broadcasts 40 % faster with the wait). It waits only while receives spin on
//! the lane ([`Spun`]): one that parked is woken by the message itself, so waiting for it
//! would only delay it (the 1 MiB allreduce with `NEXAR_SPIN_US=0` took 480 µs instead of
//! 280 before this check). A receive that spins for the message but will reduce it, not take
//! it as it is, lends an empty buffer, which ends the wait.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, BufReader, ReadBuf};

use bytes::Bytes;

use super::reader::PooledGroup;
use super::records::{Deferred, GroupSink, HEADER, Opener, SealedRecord, TAG, record_len};
use crate::proto::frame::FrameError;
use crate::proto::message::PeerMsg;
use crate::transport::eager_read::EagerRead;
use crate::transport::framed::{Landed, Payload};
use crate::transport::lent::{Lent, with_lent};

/// The shortest payload read into a lent buffer (shorter ones cost little to copy).
pub(super) const LAND_MIN: usize = 64 << 10;
/// How long the reader waits, from the receive's last loan, for it to lend its buffer again
/// before it reads the rest of the group into the pooled buffer. A spinning receive lends it
/// every few tens of microseconds.
const LENT_GRACE: Duration = Duration::from_millis(1);
/// How long the reader waits, once it has admitted a message, for its receive to lend a
/// buffer before it reads the payload into the pooled buffer; it waits only where some
/// receive has polled the lane's reader itself within [`SPUN_RECENTLY`] ([`Spun`]).
const LEND_WAIT: Duration = Duration::from_micros(100);

/// How recently a receive must have polled the lane's reader itself for the reader to wait
/// for a loan: receives of a rank whose receives spin do so at least every few hundred
/// microseconds of a collective (100 µs gave up the wait in pipelined broadcasts, whose
/// receives often find their segment ready and do not spin).
const SPUN_RECENTLY: Duration = Duration::from_millis(2);

/// When a receive last polled the lane's reader on its own thread (it spins on the lane):
/// the reader waits for a loan only where receives spin, never for one that parked
/// (`NEXAR_SPIN_US=0`, or a spin given up on a busy machine), which would only be woken by
/// the message it waits for.
#[derive(Debug)]
pub(super) struct Spun {
    born: Instant,
    /// Microseconds from `born`.
    at: AtomicU64,
    /// When a receive that lent its buffer last stopped spinning (microseconds from `born`,
    /// plus one; zero: never).
    parked: AtomicU64,
    /// The reader is reading a payload into a lent buffer.
    landing: AtomicBool,
}

impl Default for Spun {
    fn default() -> Self {
        Spun { born: Instant::now(), at: AtomicU64::new(0), parked: AtomicU64::new(0), landing: AtomicBool::new(false) }
    }
}

impl Spun {
    /// A receive polls the reader now.
    pub fn now(&self) {
        self.at.store(self.born.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    /// A receive that polled the reader stops spinning, to be woken by its message: `true`
    /// if the reader is reading a payload into a lent buffer (it should then go on without).
    pub fn park(&self) -> bool {
        self.parked.store(self.born.elapsed().as_micros() as u64 + 1, Ordering::Relaxed);
        self.landing.load(Ordering::Relaxed)
    }

    /// Whether the last receive to poll the reader has stopped spinning since.
    fn parked(&self) -> bool {
        self.parked.load(Ordering::Relaxed) > self.at.load(Ordering::Relaxed)
    }

    /// Whether a receive polled the reader within `window` of now, and spins still.
    fn within(&self, window: Duration) -> bool {
        let now = self.born.elapsed().as_micros() as u64;
        now.saturating_sub(self.at.load(Ordering::Relaxed)) <= window.as_micros() as u64 && !self.parked()
    }
}

/// The record being read: where it starts and ends in the group, its header, and how many of
/// its first bytes went into the lent buffer.
#[derive(Clone, Copy)]
struct Record {
    start: usize,
    end: usize,
    header: [u8; HEADER],
    in_dst: usize,
}

/// What the socket's next bytes are.
#[derive(Clone, Copy)]
enum Next {
    Header { got: usize, bytes: [u8; HEADER] },
    Body(Record),
    Tag { record: Record, got: usize, tag: [u8; TAG] },
}

/// A sealed record whose first `in_dst` bytes of ciphertext went into the lent buffer before
/// the receive stopped lending it, and whose other bytes, `at..end` of the group, into the
/// pooled group: the receive opens it once it has the rest ([`Payload::copy_to`]).
pub(super) struct Straddle {
    pub at: usize,
    pub end: usize,
    pub in_dst: usize,
    pub sealed: SealedRecord,
}

/// A group whose payload was read, wholly or in part, into the buffer its receive lent.
pub(super) struct LandedGroup {
    /// Where the payload's first bytes went, how many, and whether one of its records that
    /// was opened there failed authentication.
    pub landed: Landed,
    /// The record that lies partly there and partly in the pooled group, if any.
    pub straddle: Option<Straddle>,
    /// The records read into the pooled group after the receive stopped lending.
    pub deferred: Vec<Deferred>,
}

impl LandedGroup {
    /// The payload's bytes that are not in the lent buffer, from `group` (the pooled group,
    /// whose payload starts at `payload_at`). Once a byte of the payload went into the pooled
    /// group, every later one did, so the group then has room for all of it; where none did,
    /// the group is not used (it may have room for its frames only).
    pub fn rest(&self, group: PooledGroup, payload_at: usize) -> Result<Payload, FrameError> {
        let len = group.group_len();
        let from = self.straddle.as_ref().map_or(payload_at + self.landed.bytes, |s| s.at);
        if from == len {
            let rest = Payload::default();
            return Ok(match &self.straddle {
                Some(s) => rest.after_straddled(s.in_dst, Bytes::new(), s.sealed.clone()),
                None => rest,
            });
        }
        let group = Bytes::from_owner(group);
        match &self.straddle {
            Some(s) => Ok(Payload::from_group(&group, s.end..len, &self.deferred)?.after_straddled(
                s.in_dst,
                group.slice(s.at..s.end),
                s.sealed.clone(),
            )),
            None => Payload::from_group(&group, from..len, &self.deferred),
        }
    }
}

/// A group whose payload is being read into a lent buffer.
struct Landing<'g> {
    spun: &'g Spun,
    opener: &'g mut Opener,
    group: &'g mut PooledGroup,
    msg: &'g PeerMsg,
    /// Where the payload starts in the group.
    payload_at: usize,
    /// Bytes of the group read so far.
    at: usize,
    next: Next,
    /// The lent buffer's address, once lent, and the payload bytes read into it.
    lent_at: Option<usize>,
    landed: usize,
    /// The receive stopped lending: the rest goes into the pooled buffer.
    pooled: bool,
    last_lent: Instant,
    grace: Option<Pin<Box<tokio::time::Sleep>>>,
    /// A record opened in the lent buffer that failed authentication (its length).
    forged: Option<usize>,
    straddle: Option<Straddle>,
    deferred: Vec<Deferred>,
}

/// Reads the rest of `group` (its bytes from `at`, where its `payload_len`-byte payload starts:
/// whole records) from `sock` into the buffer the receive that waits for `msg` lends in this
/// poll, and on into `group` should it stop lending; `opener` takes the records (sealed ones
/// are opened where they lie). `None`, having read nothing, when no receive lends a buffer
/// for `msg` now.
pub(super) async fn read_landing(
    sock: &mut BufReader<EagerRead>,
    opener: &mut Opener,
    group: &mut PooledGroup,
    at: usize,
    msg: &PeerMsg,
    spun: &Spun,
) -> io::Result<Option<LandedGroup>> {
    let mut landing = Landing {
        spun,
        opener,
        group,
        msg,
        payload_at: at,
        at,
        next: Next::Header { got: 0, bytes: [0; HEADER] },
        lent_at: None,
        landed: 0,
        pooled: false,
        last_lent: Instant::now(),
        grace: None,
        forged: None,
        straddle: None,
        deferred: Vec::new(),
    };
    std::future::poll_fn(|cx| with_lent(|lent| landing.poll(cx, Pin::new(&mut *sock), lent))).await
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        if self.lent_at.is_some() {
            self.spun.landing.store(false, Ordering::Relaxed);
        }
    }
}

impl Landing<'_> {
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        sock: Pin<&mut BufReader<EagerRead>>,
        lent: Option<Lent<'_>>,
    ) -> Poll<io::Result<Option<LandedGroup>>> {
        let payload_len = self.group.group_len() - self.payload_at;
        let ours = lent.filter(|l| l.awaited.is(self.msg));
        // Its receive spins without a buffer to lend (it reduces the payload).
        let declined = ours.as_ref().is_some_and(|l| l.dst.is_empty());
        let dst = ours.filter(|l| l.dst.len() == payload_len).map(|l| l.dst);
        let dst = match (dst, self.lent_at) {
            // No loan yet: the receive may be about to spin for it (its rank still busy with
            // the step before, or the previous message); the payload waits in the socket.
            (None, None) if !declined && self.last_lent.elapsed() < LEND_WAIT && self.spun.within(SPUN_RECENTLY) => {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            (None, None) => return Poll::Ready(Ok(None)),
            (Some(dst), None) => {
                self.lent_at = Some(dst.as_ptr() as usize);
                self.spun.landing.store(true, Ordering::Relaxed);
                Some(dst)
            }
            (Some(dst), Some(at)) if at == dst.as_ptr() as usize && !self.pooled => Some(dst),
            _ => None,
        };
        if dst.is_some() {
            self.last_lent = Instant::now();
            self.grace = None;
        } else if !self.pooled {
            let until = self.last_lent + LENT_GRACE;
            // A receive that parked lends nothing until its message wakes it.
            if Instant::now() < until && !self.spun.parked() {
                let grace = self.grace.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until.into())));
                if grace.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            tracing::trace!(landed = self.landed, "the receive stopped lending its buffer; the rest is pooled");
            self.pooled = true;
        }
        ready!(self.read(cx, sock, dst))?;
        Poll::Ready(Ok(self.lent_at.map(|at| LandedGroup {
            landed: Landed { at, bytes: self.landed, forged: self.forged },
            straddle: self.straddle.take(),
            deferred: std::mem::take(&mut self.deferred),
        })))
    }

    /// Reads records until the group is whole: payload bytes into `dst` while it is lent,
    /// into the pooled group once it is not.
    fn read(
        &mut self,
        cx: &mut Context<'_>,
        mut sock: Pin<&mut BufReader<EagerRead>>,
        mut dst: Option<&mut [u8]>,
    ) -> Poll<io::Result<()>> {
        let len = self.group.group_len();
        loop {
            match self.next {
                Next::Header { got: 0, .. } if self.at == len => return Poll::Ready(Ok(())),
                Next::Header { got, mut bytes } => {
                    let n = ready!(poll_some(cx, sock.as_mut(), &mut bytes[got..]))?;
                    self.next = match got + n {
                        HEADER => {
                            let end = self.at + record_len(bytes, len, self.at)?;
                            Next::Body(Record { start: self.at, end, header: bytes, in_dst: 0 })
                        }
                        got => Next::Header { got, bytes },
                    };
                }
                Next::Body(mut record) => {
                    let (from, to) = (self.at - self.payload_at, record.end - self.payload_at);
                    let into = match dst.as_deref_mut() {
                        Some(dst) if !self.pooled => &mut dst[from..to],
                        _ => &mut self.group.room(record.end + TAG)[self.at..record.end],
                    };
                    let n = ready!(poll_some(cx, sock.as_mut(), into))?;
                    self.at += n;
                    if !self.pooled {
                        record.in_dst += n;
                        self.landed = self.at - self.payload_at;
                    }
                    self.next = match self.at == record.end {
                        true => Next::Tag { record, got: 0, tag: [0; TAG] },
                        false => Next::Body(record),
                    };
                }
                Next::Tag { record, got, mut tag } => {
                    let n = ready!(poll_some(cx, sock.as_mut(), &mut tag[got..]))?;
                    if got + n < TAG {
                        self.next = Next::Tag { record, got: got + n, tag };
                        continue;
                    }
                    self.take(record, tag, dst.as_deref_mut())?;
                    self.next = Next::Header { got: 0, bytes: [0; HEADER] };
                }
            }
        }
    }

    /// Takes a record read whole: opened where it lies (in `dst`, or in the pooled group as
    /// the reader takes every record there), or, when its bytes lie in both, kept sealed for
    /// the receive to open.
    fn take(&mut self, record: Record, tag: [u8; TAG], dst: Option<&mut [u8]>) -> io::Result<()> {
        let Record { start, end, header, in_dst } = record;
        if in_dst == 0 {
            let bytes = &mut self.group.room(end + TAG)[start..];
            bytes[end - start..].copy_from_slice(&tag);
            return self.opener.take_record(header, bytes, start, self.payload_at, &mut self.deferred);
        }
        match dst {
            Some(dst) if in_dst == end - start && !self.pooled => {
                let body = &mut dst[start - self.payload_at..end - self.payload_at];
                if self.opener.open_landed(header, body, &tag)?.is_err() {
                    self.forged.get_or_insert(end - start);
                }
            }
            _ => {
                if let Some(sealed) = self.opener.keep_sealed(header, end - start, tag)? {
                    self.straddle = Some(Straddle { at: start + in_dst, end, in_dst, sealed });
                }
            }
        }
        Ok(())
    }
}

/// Reads some bytes into `buf` (not empty): how many, or an error at the end of the stream.
fn poll_some(cx: &mut Context<'_>, sock: Pin<&mut BufReader<EagerRead>>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
    let mut read = ReadBuf::new(buf);
    ready!(sock.poll_read(cx, &mut read))?;
    match read.filled().len() {
        0 => Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection ended inside a group"))),
        n => Poll::Ready(Ok(n)),
    }
}

#[cfg(test)]
#[path = "landing_tests.rs"]
mod tests;
