//! Allreduce generators: (pipelined) ring, recursive halving-doubling and recursive doubling,
//! the last two with non-power-of-two ranks folded in.

use super::blocks::AHEAD;
use crate::proto::schedule::{Schedule, Slot, Span};

fn data(count: usize) -> Span {
    Span::new(Slot::Data, 0, count)
}

/// Ring allreduce: a reduce-scatter then an all-gather around the ring, `2(w-1)` steps each
/// moving `count/w` elements. Each chunk is cut into segments of at most `segment` elements
/// and every segment is forwarded as soon as it is reduced, so sending, receiving and reducing
/// overlap (`segment = usize::MAX` is the plain ring).
///
/// Cost: `2(w-1)` messages of `count/w` elements per rank; bandwidth-optimal.
pub fn ring(rank: usize, world: usize, count: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    if world == 1 {
        return s;
    }
    let all = data(count);
    let chunk = |i: usize| all.part(world, i % world);
    if world == 2
        && let (own, theirs) = (chunk(rank).segments(segment), chunk(rank + 1).segments(segment))
        && own.len() == theirs.len()
        && own.len() > AHEAD
    {
        return ring_of_two(own, theirs, 1 - rank);
    }
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    for seg in chunk(rank).segments(segment) {
        s.send(next, seg);
    }
    // Reduce-scatter: each reduced segment goes straight on to the next rank; after the last
    // step this rank holds chunk rank+1 fully reduced, which starts the all-gather.
    for k in 0..world - 1 {
        for seg in chunk(rank + 2 * world - k - 1).segments(segment) {
            s.recv_reduce(prev, seg);
            s.send(next, seg);
        }
    }
    // All-gather: receive the finished chunks and pass them on.
    for k in 0..world - 1 {
        for seg in chunk(rank + world - k).segments(segment) {
            s.recv(prev, seg);
            if k < world - 2 {
                s.send(next, seg);
            }
        }
    }
    s
}

/// The ring of two with its messages interleaved: a rank sends its own chunk's raw segments
/// ([`AHEAD`] at the start, then one after each reduction) between the reduced segments of the
/// peer's chunk, and receives in the same pattern, so neither rank posts its whole chunk
/// before it takes anything in (the peer would hold it, out of cache, until its receives
/// caught up). Both ranks run this same pattern, so each receives the other's messages in
/// the order they were sent: `own 0, own 1, reduced 0, own 2, reduced 1, ...`.
fn ring_of_two(own: Vec<Span>, theirs: Vec<Span>, peer: usize) -> Schedule {
    let mut s = Schedule::new();
    let n = own.len();
    for seg in &own[..AHEAD] {
        s.send(peer, *seg);
    }
    for j in 0..n {
        s.recv_reduce(peer, theirs[j]);
        s.send(peer, theirs[j]);
        if let Some(seg) = own.get(j + AHEAD) {
            s.send(peer, *seg);
        }
        // The peer's reduced segment j-1 comes after its own segment j+1 (its raw segments
        // run AHEAD - 1 ahead of its reduced ones once both flow).
        if j + 1 >= AHEAD {
            s.recv(peer, own[j + 1 - AHEAD]);
        }
    }
    for seg in &own[n + 1 - AHEAD..] {
        s.recv(peer, *seg);
    }
    s
}

/// The power-of-two core of `world` ranks: `(p, rem)` with `p` the largest power of two not
/// above `world` and `rem = world - p` ranks folded in.
fn fold(world: usize) -> (usize, usize) {
    let p = if world.is_power_of_two() { world } else { world.next_power_of_two() / 2 };
    (p, world - p)
}

/// Folding in extra ranks: among the first `2*rem` ranks, each even rank hands its data to the
/// odd rank above it and sits out. Returns this rank's index in the power-of-two core, or
/// `None` if it sits out.
fn fold_in(s: &mut Schedule, rank: usize, rem: usize, count: usize) -> Option<usize> {
    if rank < 2 * rem {
        if rank.is_multiple_of(2) {
            s.send(rank + 1, data(count));
            None
        } else {
            s.recv_reduce(rank - 1, data(count));
            Some(rank / 2)
        }
    } else {
        Some(rank - rem)
    }
}

/// The real rank of core index `core`.
fn real(core: usize, rem: usize) -> usize {
    if core < rem { 2 * core + 1 } else { core + rem }
}

/// Hands the result back to the ranks that sat out.
fn fold_out(s: &mut Schedule, rank: usize, rem: usize, count: usize) {
    if rank < 2 * rem {
        if rank.is_multiple_of(2) {
            s.recv(rank + 1, data(count));
        } else {
            s.send(rank - 1, data(count));
        }
    }
}

/// Recursive halving-doubling (Rabenseifner): recursive-halving reduce-scatter then
/// recursive-doubling all-gather over the largest power-of-two core, with the other ranks
/// folded in before and out after.
///
/// Cost: `2 log2 p` messages totalling `2 count (p-1)/p` elements per core rank, plus two
/// full-buffer messages for folded pairs.
pub fn halving_doubling(rank: usize, world: usize, count: usize) -> Schedule {
    let mut s = Schedule::new();
    if world == 1 {
        return s;
    }
    let (p, rem) = fold(world);
    let all = data(count);
    if let Some(me) = fold_in(&mut s, rank, rem, count) {
        // Chunks [lo, hi) of p equal parts; halve until one chunk (index `me`) is ours.
        let span_of = |lo: usize, hi: usize| {
            let start = all.part(p, lo).offset;
            let end = if hi == p { all.end() } else { all.part(p, hi).offset };
            Span::new(Slot::Data, start, end - start)
        };
        let (mut lo, mut hi) = (0, p);
        let mut mask = p / 2;
        while mask > 0 {
            let partner = real(me ^ mask, rem);
            let mid = (lo + hi) / 2;
            if me & mask == 0 {
                s.send(partner, span_of(mid, hi));
                s.recv_reduce(partner, span_of(lo, mid));
                hi = mid;
            } else {
                s.send(partner, span_of(lo, mid));
                s.recv_reduce(partner, span_of(mid, hi));
                lo = mid;
            }
            mask /= 2;
        }
        let mut mask = 1;
        while mask < p {
            let partner = me ^ mask;
            let mine = me & !(mask - 1);
            let theirs = partner & !(mask - 1);
            s.send(real(partner, rem), span_of(mine, mine + mask));
            s.recv(real(partner, rem), span_of(theirs, theirs + mask));
            mask *= 2;
        }
    }
    fold_out(&mut s, rank, rem, count);
    s
}

/// Recursive doubling: `log2 p` rounds, each exchanging and reducing the whole buffer with a
/// partner, with the other ranks folded in and out. Fewest rounds; for small messages.
pub fn recursive_doubling(rank: usize, world: usize, count: usize) -> Schedule {
    let mut s = Schedule::new();
    if world == 1 {
        return s;
    }
    let (p, rem) = fold(world);
    if let Some(me) = fold_in(&mut s, rank, rem, count) {
        let mut mask = 1;
        while mask < p {
            let partner = real(me ^ mask, rem);
            s.send(partner, data(count));
            s.recv_reduce(partner, data(count));
            mask *= 2;
        }
    }
    fold_out(&mut s, rank, rem, count);
    s
}
