//! Block collectives: ring all-gather, ring reduce-scatter and pairwise all-to-all.

use crate::proto::schedule::{Schedule, Slot, Span};

fn block(slot: Slot, count: usize, i: usize) -> Span {
    Span::new(slot, i * count, count)
}

/// Ring all-gather of `count` elements per rank into a `count * w` buffer: `w-1` steps, each
/// forwarding the block received in the step before. Blocks go in segments of at most
/// `segment` elements, each passed on as soon as it arrives, so the receiver works on one
/// while the next is on the wire (`segment = usize::MAX`: whole blocks).
pub fn all_gather_ring(rank: usize, world: usize, count: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    s.copy(Span::new(Slot::Input, 0, count), block(Slot::Data, count, rank));
    if world == 1 {
        return s;
    }
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let mut own = Ahead::start(&mut s, next, block(Slot::Data, count, rank).segments(segment));
    for k in 0..world - 1 {
        for seg in block(Slot::Data, count, (rank + 2 * world - k - 1) % world).segments(segment) {
            s.recv(prev, seg);
            if k < world - 2 {
                own.all(&mut s);
                s.send(next, seg);
            }
            own.one_more(&mut s);
        }
    }
    own.all(&mut s);
    s
}

/// Ring reduce-scatter of a `count * w` input into `count` reduced elements per rank (block
/// `rank`): `w-1` steps of `count` elements. The first block goes straight from the input;
/// each later one accumulates where it is needed next (scratch, or the result at the last
/// step), so no block is copied more than once. Blocks go in segments of at most `segment`
/// elements, each passed on as soon as it is reduced (`segment = usize::MAX`: whole blocks).
pub fn reduce_scatter_ring(rank: usize, world: usize, count: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    let input = |i: usize| block(Slot::Input, count, i % world);
    let result = Span::new(Slot::Data, 0, count);
    if world == 1 {
        s.copy(input(0), result);
        return s;
    }
    s.need_scratch(count * (world - 2));
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let mut first = Ahead::start(&mut s, next, input(rank + world - 1).segments(segment));
    for k in 0..world - 1 {
        let last = k == world - 2;
        let acc = if last { result } else { block(Slot::Scratch, count, k) };
        s.copy(input(rank + 2 * world - k - 2), acc);
        for seg in acc.segments(segment) {
            s.recv_reduce(prev, seg);
            if !last {
                first.all(&mut s);
                s.send(next, seg);
            }
            first.one_more(&mut s);
        }
    }
    first.all(&mut s);
    s
}

/// Segments a rank sends before it receives anything (its own block, in a ring): at most
/// [`AHEAD`] go out at the start and one more after each receive, so a rank's sends run only
/// a little ahead of what its peer takes in. Posting a whole large block at once left most of
/// it waiting in the peer's mailbox, out of cache, until the peer's receives caught up: a
/// 64 MiB reduce-scatter at np 2 took longer than a 64 MiB allreduce. A peer matches a
/// rank's messages in the order they were sent, so whatever is left goes before anything
/// else to the same peer ([`all`](Self::all)); in a ring of two, nothing else goes.
struct Ahead {
    to: usize,
    rest: std::vec::IntoIter<Span>,
}

/// Segments of a rank's own block (or chunk, in the allreduce of two) in flight before its
/// first receive.
pub(super) const AHEAD: usize = 2;

impl Ahead {
    fn start(s: &mut Schedule, to: usize, segments: Vec<Span>) -> Ahead {
        let mut rest = segments.into_iter();
        for seg in rest.by_ref().take(AHEAD) {
            s.send(to, seg);
        }
        Ahead { to, rest }
    }

    /// The next segment, if any is left, after a receive.
    fn one_more(&mut self, s: &mut Schedule) {
        if let Some(seg) = self.rest.next() {
            s.send(self.to, seg);
        }
    }

    /// Every segment left.
    fn all(&mut self, s: &mut Schedule) {
        for seg in self.rest.by_ref() {
            s.send(self.to, seg);
        }
    }
}

/// Pairwise all-to-all: in step `k` send block `rank+k` and receive block `rank-k`, so every
/// pair exchanges exactly once and no rank is a hot spot. Blocks go in segments of at most
/// `segment` elements, so the receiver works on one while the next is on the wire
/// (`segment = usize::MAX`: whole blocks).
pub fn all_to_all_pairwise(rank: usize, world: usize, count: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    s.copy(block(Slot::Input, count, rank), block(Slot::Data, count, rank));
    for k in 1..world {
        let (to, from) = ((rank + k) % world, (rank + world - k) % world);
        // Each step's sends go to a peer of their own, so they can follow the receives.
        let mut out = Ahead::start(&mut s, to, block(Slot::Input, count, to).segments(segment));
        for seg in block(Slot::Data, count, from).segments(segment) {
            s.recv(from, seg);
            out.one_more(&mut s);
        }
        out.all(&mut s);
    }
    s
}
