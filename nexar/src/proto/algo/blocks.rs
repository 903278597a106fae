//! Block collectives: ring all-gather, ring reduce-scatter and pairwise all-to-all.

use crate::proto::schedule::{Schedule, Slot, Span};

fn block(slot: Slot, count: usize, i: usize) -> Span {
    Span::new(slot, i * count, count)
}

/// Ring all-gather of `count` elements per rank into a `count * w` buffer: `w-1` steps, each
/// forwarding the block received in the step before.
pub fn all_gather_ring(rank: usize, world: usize, count: usize) -> Schedule {
    let mut s = Schedule::new();
    s.copy(Span::new(Slot::Input, 0, count), block(Slot::Data, count, rank));
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    for k in 0..world.saturating_sub(1) {
        s.send(next, block(Slot::Data, count, (rank + world - k) % world));
        s.recv(prev, block(Slot::Data, count, (rank + 2 * world - k - 1) % world));
    }
    s
}

/// Ring reduce-scatter of a `count * w` input into `count` reduced elements per rank (block
/// `rank`): `w-1` steps of `count` elements, accumulating in scratch space.
pub fn reduce_scatter_ring(rank: usize, world: usize, count: usize) -> Schedule {
    let mut s = Schedule::new();
    if world == 1 {
        s.copy(Span::new(Slot::Input, 0, count), Span::new(Slot::Data, 0, count));
        return s;
    }
    s.need_scratch(count * world);
    s.copy(Span::new(Slot::Input, 0, count * world), Span::new(Slot::Scratch, 0, count * world));
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    for k in 0..world - 1 {
        s.send(next, block(Slot::Scratch, count, (rank + 2 * world - k - 1) % world));
        s.recv_reduce(prev, block(Slot::Scratch, count, (rank + 2 * world - k - 2) % world));
    }
    s.copy(block(Slot::Scratch, count, rank), Span::new(Slot::Data, 0, count));
    s
}

/// Pairwise all-to-all: in step `k` send block `rank+k` and receive block `rank-k`, so every
/// pair exchanges exactly once and no rank is a hot spot.
pub fn all_to_all_pairwise(rank: usize, world: usize, count: usize) -> Schedule {
    let mut s = Schedule::new();
    s.copy(block(Slot::Input, count, rank), block(Slot::Data, count, rank));
    for k in 1..world {
        let (to, from) = ((rank + k) % world, (rank + world - k) % world);
        s.send(to, block(Slot::Input, count, to));
        s.recv(from, block(Slot::Data, count, from));
    }
    s
}
