//! Prefix reductions by recursive doubling (Hillis-Steele): `ceil(log2 w)` rounds.

use crate::proto::schedule::{Schedule, Slot, Span};

/// Inclusive scan: rank `r` ends with `x0 op x1 op … op xr`.
pub fn inclusive(rank: usize, world: usize, count: usize) -> Schedule {
    let mut s = Schedule::new();
    let buf = Span::new(Slot::Data, 0, count);
    let mut d = 1;
    while d < world {
        if rank + d < world {
            s.send(rank + d, buf);
        }
        if rank >= d {
            s.recv_reduce(rank - d, buf);
        }
        d *= 2;
    }
    s
}

/// Exclusive scan: rank `r > 0` ends with `x0 op … op x(r-1)`; rank 0's buffer is left as it
/// was (MPI leaves it undefined).
pub fn exclusive(rank: usize, world: usize, count: usize) -> Schedule {
    let mut s = Schedule::new();
    if world == 1 {
        return s;
    }
    s.need_scratch(2 * count);
    let partial = Span::new(Slot::Scratch, 0, count);
    let incoming = Span::new(Slot::Scratch, count, count);
    let out = Span::new(Slot::Data, 0, count);
    s.copy(out, partial);
    let mut first = true;
    let mut d = 1;
    while d < world {
        if rank + d < world {
            s.send(rank + d, partial);
        }
        if rank >= d {
            s.recv(rank - d, incoming);
            s.reduce(incoming, partial);
            if first {
                s.copy(incoming, out);
                first = false;
            } else {
                s.reduce(incoming, out);
            }
        }
        d *= 2;
    }
    s
}
