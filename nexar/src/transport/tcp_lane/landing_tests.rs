//! Tests of [`super`]: payloads read into a lent buffer, plaintext and sealed, whole and in part.

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
use crate::transport::tcp_lane::LaneAead;
use crate::transport::tcp_lane::reader::RecvPool;
use crate::transport::tcp_lane::records::{RECORD, test_group};

const FRAMES: usize = 100;
const AWAITED: Awaited = Awaited::Collective { comm: 0, seq: 1, part: 0 };
/// Plaintext records, and records sealed by ring's AES-GCM (which opens in place).
const PROTECTIONS: [Option<LaneAead>; 3] = [None, Some(LaneAead::AesGcm(LaneAes::Ring)), Some(LaneAead::Aegis128X2)];

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

async fn setup(payload: &[u8], encrypt: Option<LaneAead>) -> Setup {
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
        assert!(spun.park(), "{encrypt:?}: the reader says it was landing a payload");
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
    let sealed = PROTECTIONS.into_iter().flatten();
    for (aead, lent_throughout) in sealed.flat_map(|aead| [(aead, true), (aead, false)]) {
        let mut s = setup(&want, Some(aead)).await;
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
        let case = format!("{aead}, lent throughout: {lent_throughout}");
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
