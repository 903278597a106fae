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
    for seg in block(Slot::Data, count, rank).segments(segment) {
        s.send(next, seg);
    }
    for k in 0..world - 1 {
        for seg in block(Slot::Data, count, (rank + 2 * world - k - 1) % world).segments(segment) {
            s.recv(prev, seg);
            if k < world - 2 {
                s.send(next, seg);
            }
        }
    }
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
    for seg in input(rank + world - 1).segments(segment) {
        s.send(next, seg);
    }
    for k in 0..world - 1 {
        let last = k == world - 2;
        let acc = if last { result } else { block(Slot::Scratch, count, k) };
        s.copy(input(rank + 2 * world - k - 2), acc);
        for seg in acc.segments(segment) {
            s.recv_reduce(prev, seg);
            if !last {
                s.send(next, seg);
            }
        }
    }
    s
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
        for seg in block(Slot::Input, count, to).segments(segment) {
            s.send(to, seg);
        }
        for seg in block(Slot::Data, count, from).segments(segment) {
            s.recv(from, seg);
        }
    }
    s
}
