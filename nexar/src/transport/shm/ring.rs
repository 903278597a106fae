//! A one-way byte ring in a shared segment: one process writes, the other reads, and neither
//! trusts what the other left in the segment.
//!
//! Layout: a header page, then `capacity` data bytes (a power of two). The header holds four
//! words on separate cache lines: `head` (bytes ever written, the writer's), `tail` (bytes
//! ever read, the reader's), and a flag per side saying that it sleeps and wants waking: the
//! reader by a doorbell on the link's socket, the writer by a futex wake on its flag (the
//! segment is shared, so the futex is too).
//!
//! Each side keeps its own index in its own memory and only *publishes* it to the segment; it
//! reads the other side's index from the segment and checks it against its own before using
//! it. So a peer that scribbles on the header can at worst make the ring look full or empty,
//! or make this side read garbage bytes of the peer's own stream: never an out-of-bounds
//! access, a panic, or a wait that the group deadline does not end.

use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use super::lease::{Lease, LeaseBook};
use super::mapping::SharedMap;
use crate::transport::tcp_lane::RecvPool;

/// Bytes before the data area.
pub(crate) const HEADER: usize = 4096;
const HEAD: usize = 0;
pub(super) const TAIL: usize = 128;
const READER_SLEEPS: usize = 256;
pub(super) const WRITER_SLEEPS: usize = 384;

/// The segment length of a ring of `capacity` data bytes.
pub(crate) fn segment_len(capacity: usize) -> usize {
    HEADER + capacity
}

/// What the peer left in the ring's header is impossible.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the shared ring's header is corrupt: the writer claims {claimed} unread bytes in a {capacity}-byte ring")]
pub(crate) struct Corrupt {
    claimed: u64,
    capacity: usize,
}

/// One side's view of a ring: the segment and this side's own index.
pub(super) struct Side {
    map: Arc<SharedMap>,
    capacity: usize,
}

impl Side {
    fn load(&self, at: usize) -> u64 {
        self.map.word(at).map_or(0, |w| w.load(Ordering::Acquire))
    }

    fn store(&self, at: usize, v: u64) {
        if let Some(w) = self.map.word(at) {
            w.store(v, Ordering::Release);
        }
    }

    /// Copies the ring's bytes from stream position `pos` into `dst` (at most the capacity).
    pub(super) fn copy_out(&self, pos: u64, dst: &mut [u8]) -> bool {
        let len = dst.len();
        self.copy(pos, |at, r| self.map.copy_out(at, &mut dst[r]), len)
    }

    /// The data capacity.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The segment.
    pub(super) fn map(&self) -> &SharedMap {
        &self.map
    }

    /// Copies `len` bytes between the stream position `pos` and `buf`, in up to two pieces
    /// around the end of the data area.
    fn copy(&self, pos: u64, mut each: impl FnMut(usize, std::ops::Range<usize>) -> bool, len: usize) -> bool {
        let start = (pos % self.capacity as u64) as usize;
        let first = len.min(self.capacity - start);
        each(HEADER + start, 0..first) && (first == len || each(HEADER, first..len))
    }
}

/// The writing side of a ring.
pub(crate) struct Writer {
    side: Side,
    head: u64,
    /// The reader's `tail` as last loaded (and found sound): the room it leaves is there for
    /// sure, so the segment's `tail`, a cache line the reader writes with every read, is loaded
    /// again only when that room is too small.
    seen_tail: u64,
}

impl Writer {
    /// The writer of the ring in `map` (which it created: the ring starts empty).
    pub fn new(map: Arc<SharedMap>) -> Writer {
        let capacity = map.len() - HEADER;
        Writer { side: Side { map, capacity }, head: 0, seen_tail: 0 }
    }

    /// Bytes that fit now, by the reader's current `tail`. A tail the reader claims past the
    /// head, or too far behind it, reads as a full ring (the peer's scribbles stall only its
    /// own stream).
    pub fn room(&mut self) -> usize {
        let tail = self.side.load(TAIL);
        match self.head.checked_sub(tail) {
            Some(used) if used <= self.side.capacity as u64 => {
                self.seen_tail = tail;
                self.side.capacity - used as usize
            }
            _ => 0,
        }
    }

    /// The room the last sound `tail` left (never more than there is).
    fn room_seen(&self) -> usize {
        self.side.capacity.saturating_sub(self.head.saturating_sub(self.seen_tail) as usize)
    }

    /// Whether `len` bytes fit, loading the reader's `tail` only if the room seen is short.
    pub fn fits(&mut self, len: usize) -> bool {
        self.room_seen() >= len || self.room() >= len
    }

    /// Copies as much of `src` as fits; returns how much. Unpublished until [`publish`](Self::publish).
    pub fn write(&mut self, src: &[u8]) -> usize {
        let room = if self.room_seen() >= src.len() { self.room_seen() } else { self.room() };
        let n = src.len().min(room);
        if n > 0 && self.side.copy(self.head, |at, r| self.side.map.copy_in(at, &src[r]), n) {
            self.head += n as u64;
            n
        } else {
            0
        }
    }

    /// Makes what was written visible to the reader; `true` when the reader sleeps and must be
    /// woken (its flag is cleared here, so one doorbell answers it).
    pub fn publish(&self) -> bool {
        self.side.store(HEAD, self.head);
        fence(Ordering::SeqCst);
        // Loaded first: a swap of a lowered flag changes nothing, and skipping it keeps the
        // flag's cache line shared instead of taking it over on every publish.
        self.side
            .map
            .word(READER_SLEEPS)
            .is_some_and(|w| w.load(Ordering::SeqCst) != 0 && w.swap(0, Ordering::AcqRel) != 0)
    }

    /// What [`RoomWait::wait`] needs, taken so that the wait holds no lock on the writer.
    pub fn waiter(&self) -> RoomWait {
        RoomWait { side: Side { map: self.side.map.clone(), capacity: self.side.capacity }, head: self.head }
    }

    /// The ring's data capacity.
    pub fn capacity(&self) -> usize {
        self.side.capacity
    }
}

/// A writer's wait for room, apart from the writer.
pub(crate) struct RoomWait {
    side: Side,
    head: u64,
}

impl RoomWait {
    /// Sleeps until the reader frees room for `want` bytes, or `nap` passes (a wake can be
    /// missed only if the peer scribbles on the flag). Returns at once if room appeared after
    /// the flag went up.
    pub fn wait(&self, want: usize, nap: std::time::Duration) {
        let Some(flag) = self.side.map.word32(WRITER_SLEEPS) else { return };
        flag.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let tail = self.side.load(TAIL);
        let room = match self.head.checked_sub(tail) {
            Some(used) if used <= self.side.capacity as u64 => self.side.capacity - used as usize,
            _ => 0,
        };
        if room >= want.min(self.side.capacity) {
            flag.store(0, Ordering::SeqCst);
            return;
        }
        let nap = rustix::thread::futex::Timespec { tv_sec: nap.as_secs() as i64, tv_nsec: nap.subsec_nanos() as i64 };
        // The flag still 1: asleep until woken or the nap ends; anything else: awake.
        let _ = rustix::thread::futex::wait(flag, rustix::thread::futex::Flags::empty(), 1, Some(&nap));
        flag.store(0, Ordering::SeqCst);
    }
}

/// The reading side of a ring.
pub(crate) struct Reader {
    side: Side,
    tail: u64,
    /// Hands room back to the writer, up to the oldest payload still lent.
    book: Arc<LeaseBook>,
}

impl Reader {
    /// The reader of the ring in `map` (the peer created it: it starts empty).
    #[cfg(test)]
    pub fn new(map: Arc<SharedMap>) -> Reader {
        Reader::with_pool(map, Arc::default())
    }

    /// A reader whose spilled payloads (see [`super::lease`]) go to buffers of `pool`.
    pub fn with_pool(map: Arc<SharedMap>, pool: Arc<RecvPool>) -> Reader {
        let capacity = map.len() - HEADER;
        let book = Arc::new(LeaseBook::new(Side { map: map.clone(), capacity }, pool));
        Reader { side: Side { map, capacity }, tail: 0, book }
    }

    /// Lends the `len` ready bytes that follow the first `offset` ready bytes, to be copied
    /// out later ([`Lease`]); `None` when they are not all ready. Read past them next (with
    /// [`skip`](Self::skip)): their room goes back to the writer when the lease ends.
    pub fn lend(&self, offset: usize, len: usize) -> Result<Option<Arc<Lease>>, Corrupt> {
        let ready = self.ready()?;
        if offset.checked_add(len).is_none_or(|end| end > ready) {
            return Ok(None);
        }
        Ok(Some(self.book.lend(self.tail + offset as u64, len)))
    }

    /// The longest group whose payload may be lent (see [`LeaseBook::largest`]).
    pub fn lend_largest(&self) -> usize {
        self.book.largest()
    }

    #[cfg(test)]
    pub(super) fn book(&self) -> &LeaseBook {
        &self.book
    }

    /// Bytes ready to read, checked against the ring's capacity.
    pub fn ready(&self) -> Result<usize, Corrupt> {
        let head = self.side.load(HEAD);
        match head.checked_sub(self.tail) {
            Some(n) if n <= self.side.capacity as u64 => Ok(n as usize),
            _ => Err(Corrupt { claimed: head.wrapping_sub(self.tail), capacity: self.side.capacity }),
        }
    }

    /// Copies up to `dst.len()` ready bytes into `dst`; returns how many. The room is handed
    /// back to the writer only by [`release`](Self::release).
    pub fn read(&mut self, dst: &mut [u8]) -> Result<usize, Corrupt> {
        let n = dst.len().min(self.ready()?);
        if n > 0 && self.side.copy_out(self.tail, &mut dst[..n]) {
            self.tail += n as u64;
            Ok(n)
        } else {
            Ok(0)
        }
    }

    /// Copies the `dst.len()` ready bytes that follow the first `offset` ready bytes into
    /// `dst` without reading them; `false` (and `dst` as it was) when they are not all ready.
    pub fn peek(&self, offset: usize, dst: &mut [u8]) -> Result<bool, Corrupt> {
        let ready = self.ready()?;
        if offset.checked_add(dst.len()).is_none_or(|end| end > ready) {
            return Ok(false);
        }
        let (pos, len) = (self.tail + offset as u64, dst.len());
        Ok(len == 0 || self.side.copy_out(pos, dst))
    }

    /// Reads `n` ready bytes without copying them (after a [`peek`](Self::peek)); `false`
    /// when fewer are ready. Handed back to the writer only by [`release`](Self::release).
    pub fn skip(&mut self, n: usize) -> Result<bool, Corrupt> {
        if n > self.ready()? {
            return Ok(false);
        }
        self.tail += n as u64;
        Ok(true)
    }

    /// Hands the bytes read so far back to the writer (up to the oldest payload still lent),
    /// waking it if it sleeps.
    pub fn release(&self) {
        self.book.advance(self.tail);
    }

    /// This side is about to sleep until bytes arrive: `true` if it must (none ready once the
    /// flag is up), `false` when some arrived meanwhile.
    pub fn sleep(&self) -> Result<bool, Corrupt> {
        self.sleep_short_of(1)
    }

    /// Like [`sleep`](Self::sleep), until `n` bytes are ready: `true` if fewer are once the
    /// flag is up (the writer's next publish wakes this side).
    pub fn sleep_short_of(&self, n: usize) -> Result<bool, Corrupt> {
        self.side.store(READER_SLEEPS, 1);
        fence(Ordering::SeqCst);
        if self.ready()? >= n {
            self.side.store(READER_SLEEPS, 0);
            return Ok(false);
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(capacity: usize) -> Arc<SharedMap> {
        Arc::new(SharedMap::create("nexar-ring-test", segment_len(capacity)).unwrap())
    }

    /// Every sequence of writes and reads of sizes 0..=5 (up to six steps) on an 8-byte ring
    /// delivers the written stream exactly, in order, and never more than fits.
    #[test]
    fn every_small_schedule_delivers_the_stream_exactly() {
        const CAP: usize = 8;
        const STEPS: usize = 6;
        // A step: write n (0..=5) or read n (0..=5): 12 choices. One segment, its header
        // reset per schedule, with the data area cut to CAP bytes.
        let map = ring(4096);
        for schedule in 0..12usize.pow(STEPS as u32) {
            map.word(HEAD).unwrap().store(0, Ordering::SeqCst);
            map.word(TAIL).unwrap().store(0, Ordering::SeqCst);
            let (mut w, mut r) = (Writer::new(map.clone()), Reader::new(map.clone()));
            w.side.capacity = CAP;
            r.side.capacity = CAP;
            let (mut sent, mut got, mut next) = (Vec::new(), Vec::new(), 0u8);
            let mut s = schedule;
            for _ in 0..STEPS {
                let (op, n) = ((s % 12) / 6, s % 6);
                s /= 12;
                if op == 0 {
                    let src: Vec<u8> = (0..n).map(|i| next.wrapping_add(i as u8)).collect();
                    let room = w.room();
                    let wrote = w.write(&src);
                    assert_eq!(wrote, n.min(room));
                    assert!(sent.len() + wrote - got.len() <= CAP);
                    sent.extend_from_slice(&src[..wrote]);
                    next = next.wrapping_add(wrote as u8);
                    w.publish();
                } else {
                    let mut dst = vec![0u8; n];
                    let read = r.read(&mut dst).unwrap();
                    assert_eq!(read, n.min(sent.len() - got.len()));
                    got.extend_from_slice(&dst[..read]);
                    r.release();
                }
                assert_eq!(&sent[..got.len()], &got[..], "schedule {schedule}");
            }
        }
    }

    #[test]
    fn a_scribbled_header_is_refused_or_stalls_never_reads_out_of_bounds() {
        let map = ring(4096);
        let (mut w, mut r) = (Writer::new(map.clone()), Reader::new(map.clone()));
        assert_eq!(w.write(b"abc"), 3);
        w.publish();
        // The peer claims more than the ring holds.
        map.word(HEAD).unwrap().store(1 << 40, Ordering::SeqCst);
        let err = r.read(&mut [0u8; 16]).unwrap_err();
        assert!(err.to_string().contains("corrupt"), "{err}");
        // Or a head behind the tail.
        map.word(HEAD).unwrap().store(0, Ordering::SeqCst);
        assert_eq!(r.read(&mut [0u8; 16]).unwrap(), 0);
        // A tail past the head makes the writer see a full ring, not a huge one.
        map.word(TAIL).unwrap().store(u64::MAX, Ordering::SeqCst);
        assert_eq!(w.room(), 0);
        // The writer never goes past the room the last sound tail left.
        assert_eq!(w.write(&[0u8; 4096]), 0);
        assert!(w.write(b"x") <= 4096 - 3);
    }

    #[test]
    fn peeking_reads_nothing_until_skipped() {
        let map = ring(4096);
        let (mut w, mut r) = (Writer::new(map.clone()), Reader::new(map.clone()));
        w.write(b"hello world");
        w.publish();
        let mut five = [0u8; 5];
        assert!(r.peek(6, &mut five).unwrap());
        assert_eq!(&five, b"world");
        assert!(!r.peek(7, &mut five).unwrap(), "past what is ready");
        assert!(!r.peek(usize::MAX, &mut five).unwrap(), "no overflow");
        assert_eq!(r.ready().unwrap(), 11, "a peek reads nothing");
        assert!(!r.skip(12).unwrap());
        assert!(r.skip(6).unwrap());
        let mut rest = [0u8; 5];
        assert_eq!(r.read(&mut rest).unwrap(), 5);
        assert_eq!(&rest, b"world");
    }

    #[test]
    fn the_sleep_flags_ask_for_exactly_one_doorbell() {
        let map = ring(4096);
        let (mut w, mut r) = (Writer::new(map.clone()), Reader::new(map.clone()));
        assert!(r.sleep().unwrap(), "nothing to read: sleep");
        w.write(b"x");
        assert!(w.publish(), "the reader sleeps: ring");
        assert!(!w.publish(), "once");
        assert!(!r.sleep().unwrap(), "bytes are ready: no sleep");
        r.read(&mut [0u8; 1]).unwrap();
        r.release();
        // A full ring: the writer sleeps until the reader frees room (well before the nap).
        w.write(&[0u8; 4096]);
        w.publish();
        std::thread::scope(|s| {
            let start = std::time::Instant::now();
            s.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(50));
                r.read(&mut [0u8; 10]).unwrap();
                r.release();
            });
            w.waiter().wait(10, std::time::Duration::from_secs(60));
            assert!(start.elapsed() < std::time::Duration::from_secs(30), "woken, not timed out");
            assert!(w.room() >= 10);
        });
    }

    #[test]
    fn two_threads_stream_through_a_small_ring() {
        let map = ring(4096);
        let total = 1usize << 20;
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut w = Writer::new(map.clone());
                let data: Vec<u8> = (0..total).map(|i| (i * 7 % 251) as u8).collect();
                let mut at = 0;
                while at < total {
                    at += w.write(&data[at..(at + 1000).min(total)]);
                    w.publish();
                    std::hint::spin_loop();
                }
            });
            let mut r = Reader::new(map.clone());
            let mut got = Vec::with_capacity(total);
            let mut buf = [0u8; 777];
            while got.len() < total {
                let n = r.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
                r.release();
            }
            assert!(got.iter().enumerate().all(|(i, b)| *b == (i * 7 % 251) as u8));
        });
    }
}
