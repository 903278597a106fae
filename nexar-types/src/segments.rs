//! Staging a buffer segment by segment, so an operation that works on one segment at a time
//! can overlap the copies of the others: while segment `k` is on the network, segment `k + 1`
//! is already coming to host memory and segment `k - 1` is going back to the device.
//!
//! [`RecvBuf::segment_stage`](crate::RecvBuf::segment_stage) hands out a [`SegmentStage`]:
//! host buffers work on their own memory in place, device buffers stage through pinned host
//! memory (`Buf<T, Cuda>`), any other buffer through one whole host copy
//! ([`WholeStage`]).

use std::collections::VecDeque;
use std::ops::Range;

use crate::buf::{DeviceError, HostStage};

/// A buffer being worked on segment by segment, in the order the segments were asked for.
///
/// The protocol, for segments `s0, s1, ...`:
///
/// ```text
/// prefetch(s0)
/// for k: prefetch(s(k+1)) if any; host() -> work on segment k; write_back()
/// finish()
/// ```
///
/// At most two segments are prefetched and not yet written back at any time. Dropping a
/// stage waits for every copy it started; nothing it started writes into host memory after
/// that, and device memory is written only in the order of the buffer's own stream.
///
/// ```
/// use nexar_types::RecvBuf;
/// let mut v: Vec<u32> = (0..10).collect();
/// let mut stage = v.segment_stage(4).unwrap();
/// for r in [0..4, 4..8, 8..10] {
///     stage.prefetch(r).unwrap();
///     stage.host().unwrap().iter_mut().for_each(|x| *x *= 10);
///     stage.write_back().unwrap();
/// }
/// stage.finish().unwrap();
/// drop(stage);
/// assert_eq!(v[9], 90);
/// ```
pub trait SegmentStage<T>: Send {
    /// Elements in the whole buffer.
    fn len(&self) -> usize;

    /// `true` when the buffer holds no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts bringing the elements in `range` to host memory.
    fn prefetch(&mut self, range: Range<usize>) -> Result<(), DeviceError>;

    /// The oldest prefetched segment that is not yet written back, in host memory, once its
    /// copy has arrived.
    fn host(&mut self) -> Result<&mut [T], DeviceError>;

    /// Starts writing the oldest prefetched segment back to the buffer and moves on to the
    /// next one.
    fn write_back(&mut self) -> Result<(), DeviceError>;

    /// Waits for every copy started so far; the first error of any of them.
    fn finish(&mut self) -> Result<(), DeviceError>;
}

/// An error for a caller that did not follow the [`SegmentStage`] protocol.
pub(crate) fn out_of_order(what: &str) -> DeviceError {
    DeviceError::StageOrder { what: what.to_string() }
}

/// Checks `range` against a buffer of `len` elements.
pub(crate) fn check_range(range: &Range<usize>, len: usize) -> Result<(), DeviceError> {
    if range.start <= range.end && range.end <= len {
        return Ok(());
    }
    Err(out_of_order(&format!("segment {}..{} of a buffer of {len} elements", range.start, range.end)))
}

/// The [`SegmentStage`] of a buffer that is staged whole: host buffers (borrowed, so the
/// segments are worked on in place) and any buffer type without a segment stage of its own
/// (one host copy, written back by [`finish`](SegmentStage::finish)).
///
/// ```
/// use nexar_types::{HostStage, SegmentStage, WholeStage};
/// let mut data = [1i64, 2, 3];
/// let mut stage = WholeStage::new(HostStage::borrowed(&mut data));
/// stage.prefetch(1..3).unwrap();
/// assert_eq!(stage.host().unwrap(), &[2, 3]);
/// ```
#[derive(Debug)]
pub struct WholeStage<'a, T> {
    stage: Option<HostStage<'a, T>>,
    len: usize,
    pending: VecDeque<Range<usize>>,
}

impl<'a, T> WholeStage<'a, T> {
    /// Segments of `stage`'s elements.
    pub fn new(stage: HostStage<'a, T>) -> Self {
        WholeStage { len: stage.len(), stage: Some(stage), pending: VecDeque::new() }
    }
}

impl<T: Send> SegmentStage<T> for WholeStage<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn prefetch(&mut self, range: Range<usize>) -> Result<(), DeviceError> {
        check_range(&range, self.len)?;
        self.pending.push_back(range);
        Ok(())
    }

    fn host(&mut self) -> Result<&mut [T], DeviceError> {
        let range = self.pending.front().cloned().ok_or_else(|| out_of_order("no segment was prefetched"))?;
        let stage = self.stage.as_mut().ok_or_else(|| out_of_order("the stage was finished"))?;
        Ok(&mut stage[range])
    }

    fn write_back(&mut self) -> Result<(), DeviceError> {
        self.pending.pop_front().map(drop).ok_or_else(|| out_of_order("no segment to write back"))
    }

    fn finish(&mut self) -> Result<(), DeviceError> {
        match self.stage.take() {
            Some(stage) => stage.commit(),
            None => Ok(()),
        }
    }
}

/// The segments an operation on `len` elements works on when each may hold `segment`
/// elements: consecutive ranges of `segment` elements, the last one shorter. Every rank that
/// agrees on `len` and `segment` gets the same ranges.
///
/// ```
/// let s: Vec<_> = nexar_types::segment_ranges(10, 4).collect();
/// assert_eq!(s, [0..4, 4..8, 8..10]);
/// assert_eq!(nexar_types::segment_ranges(0, 4).count(), 0);
/// ```
pub fn segment_ranges(len: usize, segment: usize) -> impl ExactSizeIterator<Item = Range<usize>> + Clone {
    let segment = segment.max(1);
    (0..len.div_ceil(segment)).map(move |k| k * segment..((k + 1) * segment).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buf::RecvBuf;

    #[test]
    fn a_whole_stage_follows_the_protocol_and_refuses_misuse() {
        let mut v: Vec<u16> = (0..7).collect();
        {
            let mut stage = v.segment_stage(3).unwrap();
            assert_eq!(stage.len(), 7);
            assert!(stage.host().is_err(), "nothing prefetched yet");
            assert!(stage.prefetch(5..8).is_err(), "past the end");
            let ranges: Vec<_> = segment_ranges(7, 3).collect();
            stage.prefetch(ranges[0].clone()).unwrap();
            for k in 0..ranges.len() {
                if let Some(next) = ranges.get(k + 1) {
                    stage.prefetch(next.clone()).unwrap();
                }
                let seg = stage.host().unwrap();
                assert_eq!(seg.len(), ranges[k].len());
                seg.iter_mut().for_each(|x| *x += 100);
                stage.write_back().unwrap();
            }
            assert!(stage.write_back().is_err(), "nothing left to write back");
            stage.finish().unwrap();
        }
        assert_eq!(v, [100, 101, 102, 103, 104, 105, 106]);
    }

    #[test]
    fn segment_ranges_cover_the_buffer_once() {
        for (len, seg) in [(0, 1), (1, 1), (5, 5), (6, 5), (1_000_003, 4096), (3, 0)] {
            let ranges: Vec<_> = segment_ranges(len, seg).collect();
            let mut at = 0;
            for r in &ranges {
                assert_eq!(r.start, at);
                assert!(!r.is_empty() && r.len() <= seg.max(1));
                at = r.end;
            }
            assert_eq!(at, len);
        }
    }
}
