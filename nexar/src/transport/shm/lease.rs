//! Payloads read in place: a group's payload stays in the peer's ring, lent to the message,
//! until nexar copies it where it is wanted, so that each byte is copied once on this side
//! (ring to destination) instead of twice (ring to a buffer, buffer to destination).
//!
//! The ring is a queue, so a lent region holds back the room after it too: the writer gets
//! room back only up to the oldest region still lent ([`LeaseBook`] publishes the ring's
//! `tail` as the lesser of what the reader has read and where that region starts). A
//! message can wait unread for long (a receive not yet posted), so the lent regions may
//! hold back only what leaves room for the longest one ([`LeaseBook::largest`]): past that,
//! the reader copies the oldest ones out ("spills" them) and hands their room back. The
//! writer therefore always has that room, whatever the receives do.
//!
//! The bytes are the peer's: it may change them while they are lent, which garbles only its
//! own message, as it could have sent other bytes. They are only ever copied out
//! ([`super::mapping::SharedMap::copy_out`]), never read through a reference.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, Mutex, Weak};

use super::ring::{Side, TAIL, WRITER_SLEEPS};
use crate::transport::framed::LentBytes;
use crate::transport::tcp_lane::{GroupSink, PooledGroup, RecvPool};

/// Who hands the ring's room back to the writer: the reader as it reads, the leases as they
/// end.
pub(crate) struct LeaseBook {
    /// The reader's view of the ring.
    side: Side,
    /// The longest region lent.
    largest: usize,
    /// The most bytes lent regions may hold back: the rest of the ring always has room for
    /// the longest region.
    budget: usize,
    book: Mutex<Book>,
    /// A spill stopped at a region that was being read: its reader finishes the spill.
    deferred: AtomicBool,
    /// Where spilled payloads go (the reader's receive buffers: no fresh pages per spill).
    pool: Arc<RecvPool>,
}

#[derive(Default)]
struct Book {
    /// The reader's position: bytes ever read (lent or copied).
    read_to: u64,
    /// The `tail` last published to the segment.
    published: u64,
    /// Regions lent and not yet ended, in stream order.
    open: VecDeque<Region>,
}

struct Region {
    start: u64,
    ended: bool,
    lease: Weak<Lease>,
}

impl LeaseBook {
    /// The book of the ring `side` reads. It lends regions of up to a quarter of the ring and
    /// 64 KiB (a segment of a quarter of the ring and its frames; at most half the ring), and
    /// lent regions hold back what the longest leaves.
    pub fn new(side: Side, pool: Arc<RecvPool>) -> LeaseBook {
        let capacity = side.capacity();
        let largest = (capacity / 4 + (64 << 10)).min(capacity / 2);
        LeaseBook {
            side,
            largest,
            budget: capacity - largest,
            book: Mutex::new(Book::default()),
            deferred: AtomicBool::new(false),
            pool,
        }
    }

    /// The longest region lent: while lent regions hold back no more than the budget, a
    /// region this long always fits in the rest of the ring, so a reader waiting for one
    /// to lie whole in the ring never waits for room that only a lease could give back.
    pub fn largest(&self) -> usize {
        self.largest
    }

    /// The reader has read up to `read_to`: hands back what no lease holds.
    pub fn advance(&self, read_to: u64) {
        let mut book = crate::sync::lock(&self.book);
        book.read_to = book.read_to.max(read_to);
        self.publish(&mut book);
    }

    /// Lends the `len` bytes at stream position `start` (ready, not yet read: the reader
    /// reads past them next). Spills the oldest regions while the lent ones hold more than
    /// the budget.
    pub fn lend(self: &Arc<Self>, start: u64, len: usize) -> Arc<Lease> {
        let lease = Arc::new(Lease { book: self.clone(), start, len, spilled: Mutex::new(None) });
        let mut spilled = Vec::new();
        {
            let mut book = crate::sync::lock(&self.book);
            book.open.push_back(Region { start, ended: false, lease: Arc::downgrade(&lease) });
            self.spill_over_budget(&mut book, start + len as u64, &mut spilled);
        }
        // Dropped without the book's lock: the last reference's drop takes it.
        drop(spilled);
        lease
    }

    /// Copies the oldest lent regions out while the ring they hold back, up to `front`, is
    /// over the budget, keeping a reference to each in `spilled`. Stops at a region being
    /// read at this moment, and leaves the rest to its reader ([`Self::read_done`]): the
    /// region may outlive the read (a message kept whole until its last segment is in), and
    /// a reader waiting for a group to lie whole in the ring must not wait on it.
    fn spill_over_budget(&self, book: &mut Book, front: u64, spilled: &mut Vec<Arc<Lease>>) {
        for region in book.open.iter_mut() {
            // Held back from here on, once the regions before have ended.
            if front.saturating_sub(region.start.min(book.read_to)) <= self.budget as u64 {
                break;
            }
            if region.ended {
                continue;
            }
            // A lease that cannot be upgraded is being dropped: its drop ends it.
            if let Some(lease) = region.lease.upgrade() {
                let Ok(mut copy) = lease.spilled.try_lock() else {
                    self.deferred.store(true, Ordering::Release);
                    break;
                };
                if copy.is_none() {
                    let mut bytes = RecvPool::take(&self.pool, lease.len, 0);
                    self.side.copy_out(lease.start, bytes.room(lease.len));
                    *copy = Some(bytes);
                    tracing::trace!(bytes = lease.len, "a lent payload waited long: copied out of the ring");
                }
                drop(copy);
                spilled.push(lease);
            }
            region.ended = true;
        }
        self.publish(book);
    }

    /// A lent region was read: finishes a spill that stopped at it (see
    /// [`spill_over_budget`](Self::spill_over_budget)).
    fn read_done(&self) {
        if !self.deferred.swap(false, Ordering::AcqRel) {
            return;
        }
        let mut spilled = Vec::new();
        {
            let mut book = crate::sync::lock(&self.book);
            let front = book.read_to;
            self.spill_over_budget(&mut book, front, &mut spilled);
        }
        drop(spilled);
    }

    /// Marks the region at `start` ended.
    fn end(&self, start: u64) {
        let mut book = crate::sync::lock(&self.book);
        if let Some(region) = book.open.iter_mut().find(|r| r.start == start) {
            region.ended = true;
        }
        self.publish(&mut book);
    }

    /// Drops ended regions from the front and publishes the new `tail` if it moved, waking
    /// the writer if it sleeps.
    fn publish(&self, book: &mut Book) {
        while book.open.front().is_some_and(|r| r.ended) {
            book.open.pop_front();
        }
        let tail = book.open.front().map_or(book.read_to, |r| r.start.min(book.read_to));
        if tail <= book.published {
            return;
        }
        book.published = tail;
        let map = self.side.map();
        if let Some(w) = map.word(TAIL) {
            w.store(tail, Ordering::Release);
        }
        fence(Ordering::SeqCst);
        if let Some(flag) = map.word32(WRITER_SLEEPS)
            && flag.load(Ordering::SeqCst) != 0
            && flag.swap(0, Ordering::AcqRel) != 0
        {
            let _ = rustix::thread::futex::wake(flag, rustix::thread::futex::Flags::empty(), 1);
        }
    }

    /// Bytes lent regions hold back now, up to the reader's position (for tests).
    #[cfg(test)]
    fn held(&self) -> u64 {
        let book = crate::sync::lock(&self.book);
        book.read_to - book.published
    }
}

/// A payload lent from the ring: copied out from there until it is spilled, then from its
/// copy. Dropping the last reference hands its room back.
pub(crate) struct Lease {
    book: Arc<LeaseBook>,
    start: u64,
    len: usize,
    /// The bytes once copied out of the ring (the room they held is the writer's again).
    spilled: Mutex<Option<PooledGroup>>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("start", &self.start).field("len", &self.len).finish_non_exhaustive()
    }
}

impl LentBytes for Lease {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        let Some(end) = offset.checked_add(dst.len()).filter(|&end| end <= self.len) else {
            dst.fill(0);
            return;
        };
        // Held while the ring is read: the region cannot be spilled, and so handed back,
        // meanwhile.
        let spilled = crate::sync::lock(&self.spilled);
        match spilled.as_ref() {
            Some(copy) => dst.copy_from_slice(&copy.as_ref()[offset..end]),
            None => {
                self.book.side.copy_out(self.start + offset as u64, dst);
            }
        }
        drop(spilled);
        self.book.read_done();
    }

    fn each_piece(&self, stage: &mut [u8], f: &mut dyn FnMut(&[u8]) -> bool) {
        // Held throughout, as for `copy_out`.
        let spilled = crate::sync::lock(&self.spilled);
        if let Some(copy) = spilled.as_ref() {
            f(copy.as_ref());
        } else {
            let mut at = 0;
            while at < self.len && !stage.is_empty() {
                let n = (self.len - at).min(stage.len());
                self.book.side.copy_out(self.start + at as u64, &mut stage[..n]);
                if !f(&stage[..n]) {
                    break;
                }
                at += n;
            }
        }
        drop(spilled);
        self.book.read_done();
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.book.end(self.start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::mapping::SharedMap;
    use crate::transport::shm::ring::{Reader, Writer, segment_len};

    fn ring(capacity: usize) -> Arc<SharedMap> {
        Arc::new(SharedMap::create("nexar-lease-test", segment_len(capacity)).unwrap())
    }

    fn tail(map: &SharedMap) -> u64 {
        map.word(TAIL).unwrap().load(Ordering::SeqCst)
    }

    /// Writes `n` bytes counting from `first` and returns them.
    fn write(w: &mut Writer, first: u8, n: usize) -> Vec<u8> {
        let bytes: Vec<u8> = (0..n).map(|i| first.wrapping_add(i as u8)).collect();
        assert_eq!(w.write(&bytes), n);
        w.publish();
        bytes
    }

    fn read(lease: &Lease) -> Vec<u8> {
        let mut out = vec![0u8; lease.len()];
        lease.copy_out(0, &mut out);
        out
    }

    #[test]
    fn room_comes_back_only_up_to_the_oldest_lease_still_held() {
        let map = ring(4096);
        let (mut w, mut r) = (Writer::new(map.clone()), Reader::new(map.clone()));
        let a = write(&mut w, 0, 100);
        let b = write(&mut w, 100, 200);
        let c = write(&mut w, 44, 50);
        let (la, lb) = (r.lend(0, 100).unwrap().unwrap(), r.lend(100, 200).unwrap().unwrap());
        assert!(r.skip(300).unwrap());
        let mut rest = vec![0u8; 50];
        assert_eq!(r.read(&mut rest).unwrap(), 50);
        r.release();
        assert_eq!(rest, c);
        // Read to 350, but the first lease holds everything from 0.
        assert_eq!(tail(&map), 0);
        assert_eq!((read(&la), read(&lb)), (a, b));
        // The second ends first: still held back by the first.
        drop(lb);
        assert_eq!(tail(&map), 0);
        drop(la);
        assert_eq!(tail(&map), 350);
    }

    #[test]
    fn leases_over_the_budget_are_copied_out_and_their_room_handed_back() {
        // A 4 KiB ring: leases may hold 2 KiB.
        let map = ring(4096);
        let (mut w, mut r) = (Writer::new(map.clone()), Reader::new(map.clone()));
        let mut leases = Vec::new();
        let mut sent = Vec::new();
        for i in 0..6u8 {
            // Fill the ring again and again: 6 KiB through a 4 KiB ring while every lease is
            // still held.
            assert!(w.fits(1000), "lease {i}: the writer has room");
            sent.push(write(&mut w, i * 7, 1000));
            leases.push(r.lend(0, 1000).unwrap().unwrap());
            assert!(r.skip(1000).unwrap());
            r.release();
            assert!(r.book().held() <= 2048, "lease {i}: {} bytes held", r.book().held());
        }
        // Every lease still reads what was written, from the ring or from its copy.
        for (lease, bytes) in leases.iter().zip(&sent) {
            assert_eq!(&read(lease), bytes);
        }
        drop(leases);
        assert_eq!(tail(&map), 6000);
    }

    /// A spill that meets a lease being read at that moment leaves it to the read: once the
    /// read is done the lease is copied out and its room handed back, even though the lease
    /// itself lives on (a message kept whole until its last segment is in), so a reader
    /// waiting for the next group to lie whole in the ring never waits on it.
    #[test]
    fn a_spill_that_meets_a_lease_being_read_is_finished_by_that_read() {
        // A 4 KiB ring: leases may hold 2 KiB.
        let map = ring(4096);
        let (mut w, mut r) = (Writer::new(map.clone()), Reader::new(map.clone()));
        let a = write(&mut w, 3, 1000);
        let la = r.lend(0, 1000).unwrap().unwrap();
        assert!(r.skip(1000).unwrap());
        r.release();
        let (reading, go) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut stage = vec![0u8; 4096];
                let mut seen = Vec::new();
                la.each_piece(&mut stage, &mut |piece| {
                    reading.wait();
                    go.wait();
                    seen.extend_from_slice(piece);
                    true
                });
                seen
            });
            reading.wait();
            // While the first lease is read: two more, 3,000 bytes held back in all.
            let _b = write(&mut w, 5, 1000);
            let lb = r.lend(0, 1000).unwrap().unwrap();
            assert!(r.skip(1000).unwrap());
            r.release();
            let _c = write(&mut w, 7, 1000);
            let lc = r.lend(0, 1000).unwrap().unwrap();
            assert!(r.skip(1000).unwrap());
            r.release();
            assert_eq!(tail(&map), 0, "the lease being read was not spilled under its reader");
            go.wait();
            assert_eq!(reader.join().unwrap(), a);
            assert_eq!(tail(&map), 1000, "the read spilled the first lease: its room is back");
            assert_eq!(read(&la), a, "and it still reads what was sent, from its copy");
            drop((lb, lc));
        });
    }

    #[test]
    fn a_lease_reads_across_the_end_of_the_ring_and_refuses_ranges_past_its_end() {
        let map = ring(4096);
        let (mut w, mut r) = (Writer::new(map.clone()), Reader::new(map.clone()));
        write(&mut w, 0, 4000);
        assert!(r.skip(4000).unwrap());
        r.release();
        let wrapped = write(&mut w, 9, 300);
        let lease = r.lend(0, 300).unwrap().unwrap();
        assert!(r.lend(1, 300).unwrap().is_none(), "bytes not yet written cannot be lent");
        assert_eq!(read(&lease), wrapped);
        let mut part = [0u8; 10];
        lease.copy_out(290, &mut part);
        assert_eq!(&part[..], &wrapped[290..]);
        let mut past = [7u8; 10];
        lease.copy_out(295, &mut past);
        assert_eq!(past, [0; 10]);
    }
}
