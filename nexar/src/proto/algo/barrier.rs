//! Barriers: dissemination and two-phase (gather to rank 0, then release).

use crate::proto::schedule::{Schedule, Slot, Span};

const EMPTY: Span = Span::new(Slot::Data, 0, 0);

/// Dissemination barrier: in round `k` signal rank `r + 2^k` and wait for rank `r - 2^k`;
/// `ceil(log2 w)` rounds, no root.
pub fn dissemination(rank: usize, world: usize) -> Schedule {
    let mut s = Schedule::new();
    append_dissemination(&mut s, rank, world);
    s
}

/// Appends dissemination rounds to a schedule (also used to confirm rooted collectives).
pub fn append_dissemination(s: &mut Schedule, rank: usize, world: usize) {
    let mut d = 1;
    while d < world {
        s.send((rank + d) % world, EMPTY);
        s.recv((rank + world - d) % world, EMPTY);
        d *= 2;
    }
}

/// Two-phase barrier: everyone signals rank 0, which then releases everyone.
pub fn two_phase(rank: usize, world: usize) -> Schedule {
    let mut s = Schedule::new();
    if rank == 0 {
        for r in 1..world {
            s.recv(r, EMPTY);
        }
        for r in 1..world {
            s.send(r, EMPTY);
        }
    } else {
        s.send(0, EMPTY);
        s.recv(0, EMPTY);
    }
    s
}
