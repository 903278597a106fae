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
use std::sync::atomic::{AtomicU64, Ordering};
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
}

impl Default for Spun {
    fn default() -> Self {
        Spun { born: Instant::now(), at: AtomicU64::new(0), parked: AtomicU64::new(0) }
    }
}

impl Spun {
    /// A receive polls the reader now.
    pub fn now(&self) {
        self.at.store(self.born.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    /// A receive that polled the reader stops spinning, to be woken by its message.
    pub fn park(&self) {
        self.parked.store(self.born.elapsed().as_micros() as u64 + 1, Ordering::Relaxed);
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
mod tests {
    use std::io::Write;
    use std::sync::Arc;
    use std::task::Waker;

    use tokio::net::TcpStream;

    use super::*;
    use crate::config::LaneAes;
    use crate::proto::message::CollHeader;
    use crate::transport::bulk::Awaited;
    use crate::transport::framed::PayloadError;
    use crate::transport::lent::lend;
    use crate::transport::tcp_lane::reader::RecvPool;
    use crate::transport::tcp_lane::records::{RECORD, test_group};

    const FRAMES: usize = 100;
    const AWAITED: Awaited = Awaited::Collective { comm: 0, seq: 1, part: 0 };
    /// Plaintext records, and records sealed by ring's AES-GCM (which opens in place).
    const PROTECTIONS: [Option<LaneAes>; 2] = [None, Some(LaneAes::Ring)];

    fn msg(len: u64) -> PeerMsg {
        let header = CollHeader { kind: 1, op: 0, dtype: 1, root: 0, count: len, fingerprint: 0, segment: 0 };
        PeerMsg::Coll { comm: 0, seq: 1, header, part: 0, len }
    }

    /// A lane's reading end with a group of `FRAMES` bytes of frames and `payload` read up to
    /// its payload, and the wire bytes of its payload's records (not sent yet).
    struct Setup {
        sock: BufReader<EagerRead>,
        peer: std::net::TcpStream,
        opener: Opener,
        group: PooledGroup,
        at: usize,
        payload_wire: Vec<u8>,
        _pool: Arc<RecvPool>,
        /// Receives polling the lane (renewed by the tests that need them to be recent).
        spun: Arc<Spun>,
    }

    async fn setup(payload: &[u8], encrypt: Option<LaneAes>) -> Setup {
        let (head, wire, mut opener) = test_group(&[&[7u8; FRAMES], payload], encrypt);
        let mut rest = &wire[..];
        let pool = Arc::new(RecvPool::default());
        let mut group = RecvPool::take(&pool, head.len as usize, head.lead);
        let at = opener.read_records(&mut rest, &mut group, 0, 1, usize::MAX, &mut Vec::new()).unwrap();
        assert_eq!(at, FRAMES, "the frames come alone in the first record");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        ours.set_nonblocking(true).unwrap();
        let sock = BufReader::with_capacity(16 << 10, EagerRead(TcpStream::from_std(ours).unwrap()));
        Setup { sock, peer, opener, group, at, payload_wire: rest.to_vec(), _pool: pool, spun: Arc::default() }
    }

    impl Setup {
        fn read<'s>(&'s mut self, msg: &'s PeerMsg) -> impl Future<Output = io::Result<Option<LandedGroup>>> + 's {
            Box::pin(read_landing(&mut self.sock, &mut self.opener, &mut self.group, self.at, msg, &self.spun))
        }

        /// The payload as its receive sees it, once `landing` is done with the group.
        fn payload(self, landing: &LandedGroup) -> Payload {
            Payload::from_landed(landing.landed, landing.rest(self.group, self.at).unwrap())
        }
    }

    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    /// Polls `fut` once, lending `dst` for `awaited` if given.
    fn poll_once<F: Future + Unpin>(fut: &mut F, lent: Option<(&mut [u8], Awaited)>) -> Poll<F::Output> {
        let mut cx = Context::from_waker(Waker::noop());
        match lent {
            Some((dst, awaited)) => lend(dst, awaited, || Pin::new(&mut *fut).poll(&mut cx)),
            None => Pin::new(fut).poll(&mut cx),
        }
    }

    /// Polls `reading` (lending `dst` each time, if given) until it is done.
    async fn finish<F: Future<Output = io::Result<Option<LandedGroup>>> + Unpin>(
        reading: &mut F,
        mut dst: Option<&mut [u8]>,
    ) -> LandedGroup {
        loop {
            let lent = dst.as_deref_mut().map(|d| (d, AWAITED));
            if let Poll::Ready(done) = poll_once(reading, lent) {
                return done.unwrap().expect("landed");
            }
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
    }

    #[tokio::test]
    async fn a_payload_read_while_its_receive_lends_a_buffer_lands_there_whole() {
        for encrypt in PROTECTIONS {
            let want = payload(700_001);
            let mut s = setup(&want, encrypt).await;
            s.peer.write_all(&s.payload_wire).unwrap();
            let msg = msg(want.len() as u64);
            let mut dst = vec![0u8; want.len()];
            let mut reading = s.read(&msg);
            let landing = finish(&mut reading, Some(&mut dst)).await;
            drop(reading);
            assert_eq!(landing.landed, Landed { at: dst.as_ptr() as usize, bytes: want.len(), forged: None });
            assert!(landing.straddle.is_none() && landing.deferred.is_empty(), "{encrypt:?}");
            assert!(dst == want, "{encrypt:?}: the payload landed altered");
            assert_eq!(s.group.first(FRAMES), &[7u8; FRAMES][..], "the frames stay in the group");
            s.payload(&landing).copy_to(&mut dst).unwrap();
            assert!(dst == want, "{encrypt:?}: nothing left to copy alters it");
        }
    }

    /// The receive lends its buffer while the wire's first `cut` bytes come, then stops; the
    /// rest goes into the pooled group, and the receive's copy completes the payload (a sealed
    /// record cut by the end of the loan is opened there once its rest is in).
    #[tokio::test]
    async fn a_receive_that_stops_lending_leaves_the_rest_to_the_pooled_buffer() {
        // Inside the first record; after its body, before its tag; after it; inside the second;
        // after the body of a payload's only record, before its tag.
        let between = HEADER + RECORD + TAG;
        let cuts = [(200_000, 600_000), (HEADER + RECORD, 600_000), (between, 600_000)];
        for (cut, len) in cuts.into_iter().chain([(between + HEADER + 1_000, 600_000), (HEADER + 100_000, 100_000)]) {
            for encrypt in PROTECTIONS {
                let want = payload(len);
                let mut s = setup(&want, encrypt).await;
                let wire = std::mem::take(&mut s.payload_wire);
                let (first, second) = wire.split_at(cut);
                let mut peer = s.peer.try_clone().unwrap();
                peer.write_all(first).unwrap();
                let msg = msg(want.len() as u64);
                let mut dst = vec![0u8; want.len()];
                let mut reading = s.read(&msg);
                // Lent while the first bytes come, then never again.
                let began = Instant::now();
                while began.elapsed() < Duration::from_millis(50) {
                    assert!(poll_once(&mut reading, Some((&mut dst, AWAITED))).is_pending());
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                peer.write_all(second).unwrap();
                let landing = finish(&mut reading, None).await;
                drop(reading);
                let n = landing.landed.bytes;
                let case = format!("{encrypt:?}, cut at {cut} of {len}: {n} bytes landed");
                assert!(n > 0 && n <= len, "{case}");
                assert!(dst[n..].iter().all(|b| *b == 0), "{case}: nothing written after the loan ended");
                match encrypt {
                    None => assert!(dst[..n] == want[..n], "{case}: the landed part altered"),
                    // A record the loan ended inside (or before its tag) is left to the receive.
                    Some(_) => assert_eq!(landing.straddle.is_some(), cut != between, "{case}"),
                }
                let payload = s.payload(&landing);
                assert_eq!(payload.to_vec(), Err(PayloadError::Elsewhere { bytes: n }), "{case}");
                payload.copy_to(&mut dst).unwrap();
                assert!(dst == want, "{case}: the payload read back altered");
            }
        }
    }

    /// A receive that stops spinning lends nothing until its message wakes it: the reader
    /// reads on into the pooled group at once, not after a grace for another loan.
    #[tokio::test]
    async fn a_receive_that_parks_leaves_the_rest_to_the_pooled_buffer_at_once() {
        for encrypt in PROTECTIONS {
            let want = payload(210_000);
            let mut s = setup(&want, encrypt).await;
            let wire = std::mem::take(&mut s.payload_wire);
            let mut peer = s.peer.try_clone().unwrap();
            peer.write_all(&wire[..200_000]).unwrap();
            let (msg, spun) = (msg(want.len() as u64), s.spun.clone());
            let mut dst = vec![0u8; want.len()];
            let mut reading = s.read(&msg);
            let began = Instant::now();
            while began.elapsed() < Duration::from_millis(30) {
                assert!(poll_once(&mut reading, Some((&mut dst, AWAITED))).is_pending());
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            // The rest comes (loopback: in the socket once the write returns); soon after its
            // last loan (within the grace a receive that merely yields gets), the receive parks,
            // and the reader, polled without a loan (reading the socket itself, as while a
            // receive drives it), reads it all at once.
            assert!(poll_once(&mut reading, Some((&mut dst, AWAITED))).is_pending(), "the first bytes are in");
            peer.write_all(&wire[200_000..]).unwrap();
            spun.park();
            let done = crate::transport::eager_read::driven(|| poll_once(&mut reading, None));
            let Poll::Ready(Ok(Some(landing))) = done else { panic!("{encrypt:?}: the reader waits for a loan") };
            drop(reading);
            s.payload(&landing).copy_to(&mut dst).unwrap();
            assert!(dst == want, "{encrypt:?}: the payload read back altered");
        }
    }

    #[tokio::test]
    async fn a_sealed_record_altered_on_the_way_fails_its_receive_and_leaves_zeros() {
        let want = payload(600_000);
        // The second record is altered: in the lent buffer; then with the loan ended before it.
        for lent_throughout in [true, false] {
            let mut s = setup(&want, Some(LaneAes::Ring)).await;
            let mut wire = std::mem::take(&mut s.payload_wire);
            let second = HEADER + RECORD + TAG + HEADER;
            wire[second + 77] ^= 1;
            let mut peer = s.peer.try_clone().unwrap();
            let msg = msg(want.len() as u64);
            let mut dst = vec![0u8; want.len()];
            let mut reading = s.read(&msg);
            let landing = if lent_throughout {
                peer.write_all(&wire).unwrap();
                finish(&mut reading, Some(&mut dst)).await
            } else {
                peer.write_all(&wire[..second - HEADER]).unwrap();
                let began = Instant::now();
                while began.elapsed() < Duration::from_millis(50) {
                    assert!(poll_once(&mut reading, Some((&mut dst, AWAITED))).is_pending());
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                peer.write_all(&wire[second - HEADER..]).unwrap();
                finish(&mut reading, None).await
            };
            drop(reading);
            let case = format!("lent throughout: {lent_throughout}");
            assert_eq!(landing.landed.forged.is_some(), lent_throughout, "{case}");
            let payload = s.payload(&landing);
            assert_eq!(payload.copy_to(&mut dst), Err(PayloadError::Forged { len: RECORD }), "{case}");
            assert!(dst[..RECORD] == want[..RECORD], "{case}: the authentic record is whole");
            assert!(dst[RECORD..2 * RECORD].iter().all(|b| *b == 0), "{case}: the altered one is zeros");
        }
    }

    #[tokio::test]
    async fn without_a_loan_for_the_message_nothing_is_read() {
        let want = payload(100_000);
        let mut s = setup(&want, None).await;
        s.peer.write_all(&s.payload_wire).unwrap();
        let msg = msg(want.len() as u64);
        let other = Awaited::Collective { comm: 0, seq: 2, part: 0 };
        let (mut short, mut dst) = (vec![0u8; want.len() - 1], vec![0u8; want.len()]);
        // No loan, a loan for another message, one of another length: the reader waits a
        // little for the receive to lend its buffer, then gives up.
        for case in 0..3 {
            let mut reading = Box::pin(read_landing(&mut s.sock, &mut s.opener, &mut s.group, s.at, &msg, &s.spun));
            let began = Instant::now();
            let done = loop {
                let lent = match case {
                    0 => None,
                    1 => Some((&mut dst[..], other)),
                    _ => Some((&mut short[..], AWAITED)),
                };
                // Some receive spins on the lane meanwhile.
                s.spun.now();
                match poll_once(&mut reading, lent) {
                    Poll::Ready(done) => break done,
                    Poll::Pending => std::thread::yield_now(),
                }
            };
            assert!(matches!(done, Ok(None)), "case {case}");
            assert!(began.elapsed() >= LEND_WAIT, "case {case}: gave up before the wait was over");
        }
        // A receive that spins for the message with nothing to lend (it reduces the payload):
        // at once.
        s.spun.now();
        let mut reading = Box::pin(read_landing(&mut s.sock, &mut s.opener, &mut s.group, s.at, &msg, &s.spun));
        assert!(matches!(poll_once(&mut reading, Some((&mut [][..], AWAITED))), Poll::Ready(Ok(None))));
        drop(reading);
        // No receive has polled the lane for longer than the wait (they park): at once.
        let parked = Spun { born: Instant::now() - Duration::from_secs(1), ..Spun::default() };
        let mut reading = Box::pin(read_landing(&mut s.sock, &mut s.opener, &mut s.group, s.at, &msg, &parked));
        assert!(matches!(poll_once(&mut reading, None), Poll::Ready(Ok(None))));
        drop(reading);
        assert!(s.sock.buffer().is_empty(), "nothing was read");
        // The group's records are all still there to read the usual way.
        let mut wire = vec![0u8; s.payload_wire.len()];
        tokio::io::AsyncReadExt::read_exact(&mut s.sock, &mut wire).await.unwrap();
        assert_eq!(wire, s.payload_wire);
    }
}
