//! The [`SegmentStage`] of `Buf<T, Cuda>`: each segment is copied into its own pinned host
//! buffer on the buffer's stream, so the device copy of segment `k + 1` and the write-back of
//! segment `k - 1` run while the operation works on segment `k` in host memory.
//!
//! Two pinned buffers of one segment each are enough: a buffer handed back by `write_back` is
//! only reused by a later `prefetch`, which the stream orders after that write-back.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};

use crate::buf::{Buf, DeviceError};
use crate::cuda::driver;
use crate::cuda_adapter::CudaAdapter;
use crate::element::Element;
use crate::segments::{SegmentStage, check_range, out_of_order};
use crate::space::Cuda;

/// Segments prefetched and not yet written back, at most.
const IN_FLIGHT: usize = 2;

/// A `Buf<T, Cuda>`, or a window of device memory, staged segment by segment through pinned
/// host memory.
pub(crate) struct CudaSegments<'a, T: Element> {
    slice: &'a mut CudaSlice<T>,
    /// The window's elements of `slice`: segment ranges count from its start.
    window: Range<usize>,
    stream: Arc<CudaStream>,
    device: usize,
    /// Elements of each pinned buffer: the longest segment.
    slot_len: usize,
    /// Prefetched and not yet written back, oldest first, with the event that says the copy
    /// into the pinned buffer is done (cudarc records the buffer's own event only for contexts
    /// with several streams, so the host waits on this one before it reads).
    staged: VecDeque<(Range<usize>, PinnedHostSlice<T>, Option<CudaEvent>)>,
    /// Pinned buffers whose segment was written back (the stream orders their reuse).
    free: Vec<PinnedHostSlice<T>>,
}

impl<'a, T: Element> CudaSegments<'a, T> {
    /// Segments of at most `segment` elements of `buf`.
    pub(crate) fn new(buf: &'a mut Buf<T, Cuda>, segment: usize) -> Self {
        let len = buf.len();
        let (slice, stream, device) = buf.storage.parts_mut_with_device();
        Self::window(slice, 0..len, stream, device, segment)
    }

    /// Segments of at most `segment` elements of elements `window` of `slice` (which the
    /// caller checked lie within it).
    pub(crate) fn window(
        slice: &'a mut CudaSlice<T>,
        window: Range<usize>,
        stream: Arc<CudaStream>,
        device: usize,
        segment: usize,
    ) -> Self {
        let slot_len = segment.clamp(1, window.len().max(1));
        CudaSegments { slice, window, stream, device, slot_len, staged: VecDeque::new(), free: Vec::new() }
    }

    /// `range` of the window as elements of the slice.
    fn on_device(&self, range: &Range<usize>) -> Range<usize> {
        self.window.start + range.start..self.window.start + range.end
    }

    fn slot(&mut self) -> Result<PinnedHostSlice<T>, DeviceError> {
        match self.free.pop() {
            Some(slot) => Ok(slot),
            None => CudaAdapter::global().take_pinned(self.device, self.stream.context(), self.slot_len),
        }
    }
}

impl<T: Element> SegmentStage<T> for CudaSegments<'_, T> {
    fn len(&self) -> usize {
        self.window.len()
    }

    fn prefetch(&mut self, range: Range<usize>) -> Result<(), DeviceError> {
        check_range(&range, self.window.len())?;
        if range.len() > self.slot_len || self.staged.len() >= IN_FLIGHT {
            return Err(out_of_order(&format!(
                "segment of {} elements with {} in flight (at most {IN_FLIGHT} of {})",
                range.len(),
                self.staged.len(),
                self.slot_len
            )));
        }
        let mut slot = self.slot()?;
        let fail = driver("copying a segment to the host", self.device);
        let (slice, on_device) = (&*self.slice, self.on_device(&range));
        let mut copied = None;
        if range.len() == slot.len() {
            // Asynchronous: `host` waits for the event recorded after it.
            self.stream.memcpy_dtoh(&slice.slice(on_device), &mut slot).map_err(&fail)?;
            copied = Some(self.stream.record_event(None).map_err(&fail)?);
        } else if !range.is_empty() {
            // A copy into a pinned buffer moves the whole buffer's length, so a shorter (last)
            // segment goes into part of the slot: wait for it here.
            let host = slot.as_mut_slice().map_err(&fail)?;
            self.stream.memcpy_dtoh(&slice.slice(on_device), &mut host[..range.len()]).map_err(&fail)?;
            self.stream.synchronize().map_err(&fail)?;
        }
        self.staged.push_back((range, slot, copied));
        Ok(())
    }

    fn host(&mut self) -> Result<&mut [T], DeviceError> {
        let device = self.device;
        let fail = driver("copying a segment to the host", device);
        let (range, slot, copied) = self.staged.front_mut().ok_or_else(|| out_of_order("no segment was prefetched"))?;
        // Waits for this buffer's own copy only; the next segment's copy keeps running.
        if let Some(done) = copied.take() {
            done.synchronize().map_err(&fail)?;
        }
        let host = slot.as_mut_slice().map_err(&fail)?;
        Ok(&mut host[..range.len()])
    }

    fn write_back(&mut self) -> Result<(), DeviceError> {
        let (range, slot, copied) = self.staged.pop_front().ok_or_else(|| out_of_order("no segment to write back"))?;
        if copied.is_some() {
            return Err(out_of_order("a segment written back before `host` was asked for"));
        }
        let fail = driver("copying a segment to the device", self.device);
        let on_device = self.on_device(&range);
        let mut target = self.slice.slice_mut(on_device);
        if range.len() == slot.len() {
            // Asynchronous: the slot is only refilled by a later `prefetch`, whose copy the
            // stream orders after this one.
            self.stream.memcpy_htod(&slot, &mut target).map_err(&fail)?;
        } else if !range.is_empty() {
            // A shorter (last) segment is copied from part of the slot, which no event tracks:
            // wait for it here.
            let host = slot.as_slice().map_err(&fail)?;
            self.stream.memcpy_htod(&host[..range.len()], &mut target).map_err(&fail)?;
            self.stream.synchronize().map_err(&fail)?;
        }
        self.free.push(slot);
        Ok(())
    }

    fn finish(&mut self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(driver("copying segments", self.device))
    }
}

impl<T: Element> Drop for CudaSegments<'_, T> {
    /// Waits for every copy this stage started (an operation that stops early, or a future
    /// that is dropped, leaves nothing running), then keeps the pinned buffers for reuse.
    fn drop(&mut self) {
        let settled = self.stream.synchronize().is_ok();
        let slots = self.free.drain(..).chain(self.staged.drain(..).map(|(_, slot, _)| slot));
        if settled {
            slots.for_each(|slot| CudaAdapter::global().give_pinned(self.device, slot));
        }
        // Otherwise each buffer waits for its own copies as it is freed.
    }
}
