//! The buffer a collective writes, as the executor sees it: one slice, or several slices that
//! the schedule treats as one run of elements (a plan's bucket of tensors, reduced where they
//! lie instead of being copied into one buffer and back).

use crate::proto::schedule::{Schedule, Slot, Span, Step};

/// A collective's written buffer.
pub(crate) enum Data<'d, T> {
    /// One slice.
    Flat(&'d mut [T]),
    /// Several slices, one after the other (see [`Pieces`]).
    Pieces(Pieces<'d, T>),
}

impl<T> Data<'_, T> {
    /// The flat buffer; empty for pieces, whose spans the executor reads through
    /// [`Pieces::read`] and [`Pieces::write`] instead.
    pub fn flat(&self) -> &[T] {
        match self {
            Data::Flat(d) => d,
            Data::Pieces(_) => &[],
        }
    }

    /// The flat buffer, for writing; empty for pieces.
    pub fn flat_mut(&mut self) -> &mut [T] {
        match self {
            Data::Flat(d) => d,
            Data::Pieces(_) => &mut [],
        }
    }
}

/// Whether `schedule` can run on [`Pieces`]: every step sends from or receives into the
/// written buffer (no local copies, reductions or scratch space, which want one slice).
pub(crate) fn runs_on_pieces(schedule: &Schedule) -> bool {
    schedule.steps.iter().all(|step| match step {
        Step::Send { src, .. } => src.slot == Slot::Data,
        Step::Recv { dst, .. } => dst.slot == Slot::Data,
        Step::Copy { .. } | Step::Reduce { .. } => false,
    })
}

/// Slices that a schedule addresses as one buffer: element `i` of the run is in the first
/// slice whose end lies past it.
pub(crate) struct Pieces<'d, T> {
    parts: Vec<&'d mut [T]>,
    len: usize,
}

impl<'d, T> Pieces<'d, T> {
    /// The run of `parts`, in order.
    pub fn new(parts: Vec<&'d mut [T]>) -> Self {
        let len = parts.iter().map(|p| p.len()).sum();
        Pieces { parts, len }
    }

    /// Elements in the run.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `(slice, range in it)` for every non-empty part of `span`, or `None` past the end.
    fn locate(&self, span: Span) -> Option<Vec<(usize, std::ops::Range<usize>)>> {
        if span.end() > self.len {
            return None;
        }
        let mut found = Vec::new();
        let mut start = 0;
        for (i, part) in self.parts.iter().enumerate() {
            let end = start + part.len();
            let (from, to) = (span.offset.max(start), span.end().min(end));
            if from < to {
                found.push((i, from - start..to - start));
            }
            if end >= span.end() {
                break;
            }
            start = end;
        }
        Some(found)
    }

    /// The slices holding `span`, in order.
    pub fn read(&self, span: Span) -> Option<Vec<&[T]>> {
        Some(self.locate(span)?.into_iter().map(|(i, r)| &self.parts[i][r]).collect())
    }

    /// The slices holding `span`, in order, for writing.
    pub fn write(&mut self, span: Span) -> Option<Vec<&mut [T]>> {
        let mut wanted = self.locate(span)?.into_iter().peekable();
        let mut out = Vec::new();
        for (i, part) in self.parts.iter_mut().enumerate() {
            match wanted.peek() {
                Some((j, _)) if *j == i => {
                    let (_, r) = wanted.next()?;
                    out.push(&mut part[r]);
                }
                Some(_) => {}
                None => break,
            }
        }
        Some(out)
    }
}

/// A span's slices: one without allocating (flat buffers), or several (pieces).
pub(crate) enum Parts<A> {
    One([A; 1]),
    Many(Vec<A>),
}

impl<A> Parts<A> {
    /// The slices, in order.
    pub fn as_slice(&self) -> &[A] {
        match self {
            Parts::One(a) => a,
            Parts::Many(v) => v,
        }
    }

    /// The slices, in order, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [A] {
        match self {
            Parts::One(a) => a,
            Parts::Many(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_map_onto_the_slices_they_cross() {
        let (mut a, mut b, mut c, mut d) = ([0u32; 3], [0u32; 0], [0u32; 2], [0u32; 4]);
        let mut pieces = Pieces::new(vec![&mut a[..], &mut b[..], &mut c[..], &mut d[..]]);
        assert_eq!(pieces.len(), 9);
        for (i, x) in pieces.write(Span::new(Slot::Data, 0, 9)).unwrap().into_iter().flatten().enumerate() {
            *x = i as u32;
        }
        let read = |p: &Pieces<u32>, offset, len| -> Vec<Vec<u32>> {
            p.read(Span::new(Slot::Data, offset, len)).unwrap().into_iter().map(<[u32]>::to_vec).collect()
        };
        assert_eq!(read(&pieces, 2, 4), vec![vec![2], vec![3, 4], vec![5]], "the empty slice is skipped");
        assert_eq!(read(&pieces, 3, 2), vec![vec![3, 4]]);
        assert_eq!(read(&pieces, 9, 0), Vec::<Vec<u32>>::new());
        assert!(pieces.read(Span::new(Slot::Data, 8, 2)).is_none(), "past the end");
        assert!(pieces.write(Span::new(Slot::Data, 0, 10)).is_none());
        for x in pieces.write(Span::new(Slot::Data, 4, 3)).unwrap().into_iter().flatten() {
            *x = 100;
        }
        assert_eq!((a, c, d), ([0, 1, 2], [3, 100], [100, 100, 7, 8]));
    }
}
