//! Rooted collectives: broadcast (binomial tree, pipelined chain), reduce (binomial tree),
//! gather and scatter.

use crate::proto::schedule::{Schedule, Slot, Span};

/// Rank relative to the root, and back.
fn rel(rank: usize, root: usize, world: usize) -> usize {
    (rank + world - root) % world
}

fn abs(vrank: usize, root: usize, world: usize) -> usize {
    (vrank + root) % world
}

/// Binomial-tree broadcast: `ceil(log2 w)` rounds; each rank receives once and forwards to its
/// subtree. Cost: at most `log2 w` messages of `count` elements on the root.
pub fn broadcast_binomial(rank: usize, world: usize, count: usize, root: usize) -> Schedule {
    let mut s = Schedule::new();
    let buf = Span::new(Slot::Data, 0, count);
    let v = rel(rank, root, world);
    let mut mask = 1;
    while mask < world {
        if v & mask != 0 {
            s.recv(abs(v - mask, root, world), buf);
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if v + mask < world {
            s.send(abs(v + mask, root, world), buf);
        }
        mask >>= 1;
    }
    s
}

/// Pipelined chain broadcast: ranks form a chain from the root and each segment of at most
/// `segment` elements is forwarded as soon as it arrives. For large messages: time approaches
/// one buffer transfer regardless of `w`.
pub fn broadcast_chain(rank: usize, world: usize, count: usize, root: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    let v = rel(rank, root, world);
    for seg in Span::new(Slot::Data, 0, count).segments(segment) {
        if v > 0 {
            s.recv(abs(v - 1, root, world), seg);
        }
        if v + 1 < world {
            s.send(abs(v + 1, root, world), seg);
        }
    }
    s
}

/// Binomial-tree reduce to `root`, in segments of at most `segment` elements: each segment
/// goes on to the parent as soon as the children's parts are reduced into it, so the levels
/// of the tree work at once. The root accumulates in its buffer; ranks with children
/// accumulate in scratch space and leaves send their buffer as it is, so no rank but the root
/// changes its buffer.
pub fn reduce_binomial(rank: usize, world: usize, count: usize, root: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    let v = rel(rank, root, world);
    let data = Span::new(Slot::Data, 0, count);
    // Children (in the order their subtrees finish) and the parent, if any.
    let mut children = Vec::new();
    let mut parent = None;
    let mut mask = 1;
    while mask < world {
        if v & mask == 0 {
            if v | mask < world {
                children.push(abs(v | mask, root, world));
            }
        } else {
            parent = Some(abs(v & !mask, root, world));
            break;
        }
        mask <<= 1;
    }
    let acc = if v == 0 || children.is_empty() {
        data
    } else {
        s.need_scratch(count);
        let scratch = Span::new(Slot::Scratch, 0, count);
        s.copy(data, scratch);
        scratch
    };
    for seg in acc.segments(segment) {
        for &child in &children {
            s.recv_reduce(child, seg);
        }
        if let Some(parent) = parent {
            s.send(parent, seg);
        }
    }
    s
}

/// Gather of `count` elements per rank into the root's buffer (`count * w`), rank order, each
/// rank's block in segments of at most `segment` elements.
pub fn gather_linear(rank: usize, world: usize, count: usize, root: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    let input = Span::new(Slot::Input, 0, count);
    if rank == root {
        s.copy(input, Span::new(Slot::Data, root * count, count));
        for r in (0..world).filter(|r| *r != root) {
            for seg in Span::new(Slot::Data, r * count, count).segments(segment) {
                s.recv(r, seg);
            }
        }
    } else {
        for seg in input.segments(segment) {
            s.send(root, seg);
        }
    }
    s
}

/// Scatter of the root's `count * w` elements, `count` to each rank in rank order, each block
/// in segments of at most `segment` elements.
pub fn scatter_linear(rank: usize, world: usize, count: usize, root: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    let out = Span::new(Slot::Data, 0, count);
    if rank == root {
        for r in (0..world).filter(|r| *r != root) {
            for seg in Span::new(Slot::Input, r * count, count).segments(segment) {
                s.send(r, seg);
            }
        }
        s.copy(Span::new(Slot::Input, root * count, count), out);
    } else {
        for seg in out.segments(segment) {
            s.recv(root, seg);
        }
    }
    s
}
