//! The schedule IR: what one rank does in one collective, as a list of steps over its buffers.
//!
//! Steps run in order. A `Send` snapshots its span when reached and does not wait; a `Recv`
//! waits for the next message from its peer and copies or reduces it into its span; `Copy` and
//! `Reduce` are local. Messages between two ranks are matched in order, so the k-th `Recv` from
//! a peer takes the k-th `Send` that peer addressed to this rank. Generators put sends before
//! the receives of a round, so sending, receiving and reducing overlap.

/// Which of a rank's buffers a span lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// The buffer the operation writes (in place, or the receive buffer).
    Data,
    /// The read-only send buffer of an out-of-place operation.
    Input,
    /// Temporary space owned by the executor, `Schedule::scratch_len` elements.
    Scratch,
}

/// A range of elements in one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    /// The buffer.
    pub slot: Slot,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl Span {
    /// A span of `len` elements at `offset` in `slot`.
    pub const fn new(slot: Slot, offset: usize, len: usize) -> Span {
        Span { slot, offset, len }
    }

    /// One past the last element.
    pub const fn end(&self) -> usize {
        self.offset + self.len
    }

    /// The `i`-th of `parts` nearly equal pieces of this span (the first `len % parts` pieces
    /// are one element longer), so every count, odd or prime, is covered exactly.
    pub fn part(&self, parts: usize, i: usize) -> Span {
        let (offset, len) = part(self.len, parts, i);
        Span::new(self.slot, self.offset + offset, len)
    }

    /// Splits the span into consecutive segments of at most `max` elements (one empty segment
    /// for an empty span).
    pub fn segments(&self, max: usize) -> Vec<Span> {
        let max = max.max(1);
        if self.len == 0 {
            return vec![*self];
        }
        (0..self.len.div_ceil(max))
            .map(|i| {
                let offset = i * max;
                Span::new(self.slot, self.offset + offset, max.min(self.len - offset))
            })
            .collect()
    }
}

/// `(offset, len)` of piece `i` of `count` elements split into `parts` nearly equal pieces.
pub fn part(count: usize, parts: usize, i: usize) -> (usize, usize) {
    let (base, extra) = (count / parts, count % parts);
    let offset = i * base + i.min(extra);
    (offset, base + usize::from(i < extra))
}

/// One step of a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send a copy of `src` to rank `to`.
    Send {
        /// Destination rank (within the communicator).
        to: usize,
        /// What to send.
        src: Span,
    },
    /// Receive the next message from `from` into `dst` (copy), or combine it into `dst` with the
    /// operation's reduction (`reduce`). The message must hold exactly `dst.len` elements.
    Recv {
        /// Source rank.
        from: usize,
        /// Where it goes.
        dst: Span,
        /// Combine instead of overwrite.
        reduce: bool,
    },
    /// Copy `src` over `dst` (same length).
    Copy {
        /// Source.
        src: Span,
        /// Destination.
        dst: Span,
    },
    /// `dst = dst op src` (same length).
    Reduce {
        /// Operand.
        src: Span,
        /// Accumulator.
        dst: Span,
    },
}

/// Everything one rank does in one collective.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// The steps, in order.
    pub steps: Vec<Step>,
    /// Elements of scratch space the steps use.
    pub scratch_len: usize,
    /// The algorithm that made it, for diagnostics (empty when unnamed).
    pub algorithm: &'static str,
}

impl Schedule {
    /// An empty schedule.
    pub fn new() -> Self {
        Schedule::default()
    }

    /// Appends a send.
    pub fn send(&mut self, to: usize, src: Span) {
        self.steps.push(Step::Send { to, src });
    }

    /// Appends a receive that overwrites.
    pub fn recv(&mut self, from: usize, dst: Span) {
        self.steps.push(Step::Recv { from, dst, reduce: false });
    }

    /// Appends a receive that reduces.
    pub fn recv_reduce(&mut self, from: usize, dst: Span) {
        self.steps.push(Step::Recv { from, dst, reduce: true });
    }

    /// Appends a local copy.
    pub fn copy(&mut self, src: Span, dst: Span) {
        debug_assert_eq!(src.len, dst.len);
        self.steps.push(Step::Copy { src, dst });
    }

    /// Appends a local reduction.
    pub fn reduce(&mut self, src: Span, dst: Span) {
        debug_assert_eq!(src.len, dst.len);
        self.steps.push(Step::Reduce { src, dst });
    }

    /// Reserves scratch space of at least `len` elements.
    pub fn need_scratch(&mut self, len: usize) {
        self.scratch_len = self.scratch_len.max(len);
    }

    /// Number of sends and of elements sent.
    #[cfg(test)]
    pub fn send_volume(&self) -> (usize, usize) {
        self.steps.iter().fold((0, 0), |(n, e), s| match s {
            Step::Send { src, .. } => (n + 1, e + src.len),
            _ => (n, e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_count_exactly() {
        for count in [0usize, 1, 2, 7, 16, 17, 3_000_001] {
            for parts in 1..=16 {
                let mut next = 0;
                for i in 0..parts {
                    let (o, l) = part(count, parts, i);
                    assert_eq!(o, next);
                    next = o + l;
                }
                assert_eq!(next, count);
            }
        }
        let s = Span::new(Slot::Data, 10, 25);
        let segs = s.segments(10);
        assert_eq!(segs.iter().map(|s| s.len).collect::<Vec<_>>(), vec![10, 10, 5]);
        assert_eq!(segs[2].end(), 35);
        assert_eq!(Span::new(Slot::Data, 3, 0).segments(4).len(), 1);
    }
}
