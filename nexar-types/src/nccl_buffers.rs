//! The views of device buffers that NCCL operations take (feature `nccl`): the buffer an
//! operation writes ([`NcclOperand`]), the one it only reads ([`NcclSource`]), memory of a
//! collective's own ([`NcclScratch`]) and part of a buffer lent to nexar's own collectives
//! ([`DeviceWindow`]), with their copies to and from host memory and within the device. No
//! `unsafe` here: the operations themselves are in `nccl.rs`.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use crate::buf::{Buf, DeviceError};
use crate::cuda::driver;
use crate::cuda_adapter::CudaAdapter;
use crate::element::Element;
use crate::nccl_types::nccl_dtype;
use crate::space::Cuda;

/// A device buffer lent to NCCL operations: made by
/// [`RecvBuf::nccl_operand`](crate::RecvBuf::nccl_operand) for element types NCCL has. It
/// keeps the buffer borrowed for as long as it lives, and copies ranges of it to and from host
/// memory for the steps that leave the host.
pub struct NcclOperand<'a, T: Element> {
    pub(crate) slice: &'a mut CudaSlice<T>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) device: usize,
}

/// `Debug`, `len`, `is_empty` and `device` for the views of a device buffer that NCCL
/// operations take (each has `slice` and `device` fields).
macro_rules! device_view {
    ($view:ident) => {
        impl<T: Element> fmt::Debug for $view<'_, T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($view)).field("device", &self.device).field("len", &self.slice.len()).finish()
            }
        }

        impl<T: Element> $view<'_, T> {
            /// Elements in the buffer.
            pub fn len(&self) -> usize {
                self.slice.len()
            }

            /// `true` when the buffer has no elements.
            pub fn is_empty(&self) -> bool {
                self.slice.len() == 0
            }

            /// The device the buffer lives on.
            pub fn device(&self) -> usize {
                self.device
            }
        }
    };
}

device_view!(NcclOperand);
device_view!(NcclSource);

impl<'a, T: Element> NcclOperand<'a, T> {
    /// Copies elements `range` to `out` (as long as the range) and waits for the copy (from
    /// 64 KiB through pinned buffers, chunk by chunk).
    pub fn copy_out(&self, range: std::ops::Range<usize>, out: &mut [T]) -> Result<(), DeviceError> {
        copy_out(self.slice, &self.stream, self.device, range, out)
    }

    /// Waits until the work enqueued on this buffer's stream (copies within the device
    /// included) is done.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(driver("waiting for the device", self.device))
    }

    /// Copies `data` (as long as the range) into elements `range` and waits for the copy.
    pub fn copy_in(&mut self, range: std::ops::Range<usize>, data: &[T]) -> Result<(), DeviceError> {
        self.check(&range, data.len())?;
        CudaAdapter::global().upload_at(self.slice, &self.stream, self.device, range.start, data)
    }

    fn check(&self, range: &std::ops::Range<usize>, host: usize) -> Result<(), DeviceError> {
        check(self.len(), range, host)
    }

    /// Elements `range` of the buffer as a buffer of their own for nexar's collectives (the
    /// steps of a two-level collective that cross hosts): staged through host memory, large
    /// ones segment by segment through pinned buffers, so the copies overlap the network.
    ///
    /// ```no_run
    /// use nexar_types::{Buf, Cuda, RecvBuf, SendBuf};
    /// let mut params = Buf::<f32, Cuda>::zeros_on(0, 1 << 20)?;
    /// let mut operand = params.nccl_operand().unwrap();
    /// let head = operand.window(0..1024)?; // what `comm.all_reduce(&mut head, Sum)` would take
    /// assert_eq!(head.elems(), 1024);
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn window(&mut self, range: std::ops::Range<usize>) -> Result<DeviceWindow<'_, T>, DeviceError> {
        self.check(&range, range.len())?;
        Ok(DeviceWindow { slice: self.slice, range, stream: self.stream.clone(), device: self.device })
    }

    /// The buffer as the read side of an out-of-place operation.
    pub fn source(&self) -> NcclSource<'_, T> {
        NcclSource { slice: self.slice, stream: self.stream.clone(), device: self.device }
    }

    /// A new device buffer of `len` zeros on this buffer's device and stream, for the steps
    /// of a collective that need room of their own.
    pub fn scratch(&self, len: usize) -> Result<NcclScratch<T>, DeviceError> {
        let slice = self.stream.alloc_zeros::<T>(len).map_err(driver("allocating device memory", self.device))?;
        Ok(NcclScratch { slice, stream: self.stream.clone(), device: self.device })
    }

    /// Copies elements `from` of `source` to this buffer from element `at` on, in order on
    /// this buffer's stream (no wait: later operations on the stream come after it).
    pub fn copy_within_device(
        &mut self,
        at: usize,
        source: &NcclSource<'_, T>,
        from: std::ops::Range<usize>,
    ) -> Result<(), DeviceError> {
        if source.device != self.device {
            return Err(DeviceError::Unavailable {
                reason: format!("a copy from device {} to device {}", source.device, self.device),
            });
        }
        let fits = from.start <= from.end
            && from.end <= source.len()
            && at.checked_add(from.len()).is_some_and(|end| end <= self.len());
        if !fits {
            return Err(DeviceError::LengthMismatch { adapter: "nccl", buffer: self.len(), host: from.len() });
        }
        if !from.is_empty() {
            let mut target = self.slice.slice_mut(at..at + from.len());
            self.stream
                .memcpy_dtod(&source.slice.slice(from), &mut target)
                .map_err(driver("copying on the device", self.device))?;
        }
        Ok(())
    }

    pub(crate) fn of(buf: &'a mut Buf<T, Cuda>) -> Option<Self> {
        nccl_dtype(T::DTYPE)?;
        let (slice, stream, device) = buf.storage.parts_mut_with_device();
        Some(NcclOperand { slice, stream, device })
    }
}

/// A device buffer read by an NCCL operation: the send side of the out-of-place collectives,
/// made by [`SendBuf::nccl_source`](crate::SendBuf::nccl_source) for element types NCCL has,
/// or by [`NcclOperand::source`]. It keeps the buffer borrowed for as long as it lives.
///
/// ```no_run
/// use nexar_types::{Buf, Cuda, SendBuf};
/// let weights = Buf::<f32, Cuda>::from_host(0, &[1.0, 2.0])?;
/// let source = weights.nccl_source().unwrap();
/// let mut host = [0.0; 2];
/// source.copy_out(0..2, &mut host)?;
/// # Ok::<(), nexar_types::DeviceError>(())
/// ```
pub struct NcclSource<'a, T: Element> {
    pub(crate) slice: &'a CudaSlice<T>,
    stream: Arc<CudaStream>,
    pub(crate) device: usize,
}

impl<'a, T: Element> NcclSource<'a, T> {
    pub(crate) fn of(buf: &'a Buf<T, Cuda>) -> Option<Self> {
        nccl_dtype(T::DTYPE)?;
        let (slice, stream, device) = buf.storage.parts();
        Some(NcclSource { slice, stream: stream.clone(), device })
    }

    /// Copies elements `range` to `out` (as long as the range) and waits for the copy.
    pub fn copy_out(&self, range: std::ops::Range<usize>, out: &mut [T]) -> Result<(), DeviceError> {
        copy_out(self.slice, &self.stream, self.device, range, out)
    }
}

/// Elements of a device buffer lent to one of nexar's collectives as a buffer of their own
/// (see [`NcclOperand::window`]): a [`RecvBuf`](crate::RecvBuf) that is staged through host
/// memory, never handed to NCCL.
///
/// ```no_run
/// use nexar_types::{Buf, Cuda, RecvBuf, SendBuf};
/// let mut buf = Buf::<f32, Cuda>::from_host(0, &[1.0; 10])?;
/// let mut operand = buf.nccl_operand().unwrap();
/// let window = operand.window(2..6)?;
/// assert_eq!(&*window.host_view()?, &[1.0; 4][..]);
/// # Ok::<(), nexar_types::DeviceError>(())
/// ```
pub struct DeviceWindow<'a, T: Element> {
    slice: &'a mut CudaSlice<T>,
    range: std::ops::Range<usize>,
    stream: Arc<CudaStream>,
    device: usize,
}

impl<T: Element> fmt::Debug for DeviceWindow<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceWindow").field("device", &self.device).field("range", &self.range).finish()
    }
}

impl<T: Element> DeviceWindow<'_, T> {
    fn download(&self) -> Result<Vec<T>, DeviceError> {
        let mut host = vec![T::zeroed(); self.range.len()];
        copy_out(self.slice, &self.stream, self.device, self.range.clone(), &mut host)?;
        Ok(host)
    }
}

impl<T: Element> crate::buf::WriteBack<T> for DeviceWindow<'_, T> {
    fn write_back(&mut self, host: &[T]) -> Result<(), DeviceError> {
        check(self.range.len(), &(0..host.len()), self.range.len())?;
        CudaAdapter::global().upload_at(self.slice, &self.stream, self.device, self.range.start, host)
    }
}

impl<T: Element> crate::buf::SendBuf for DeviceWindow<'_, T> {
    type Elem = T;
    fn elems(&self) -> usize {
        self.range.len()
    }
    fn host_view(&self) -> Result<crate::buf::HostView<'_, T>, DeviceError> {
        Ok(crate::buf::HostView::Copied(self.download()?))
    }
}

impl<T: Element> crate::buf::RecvBuf for DeviceWindow<'_, T> {
    fn host_stage(&mut self) -> Result<crate::buf::HostStage<'_, T>, DeviceError> {
        let host = self.download()?;
        Ok(crate::buf::HostStage::copied(host, self))
    }

    fn segment_stage(
        &mut self,
        segment: usize,
    ) -> Result<Box<dyn crate::segments::SegmentStage<T> + Send + '_>, DeviceError> {
        let (range, stream) = (self.range.clone(), self.stream.clone());
        Ok(Box::new(crate::cuda_segments::CudaSegments::window(self.slice, range, stream, self.device, segment)))
    }
}

/// Device memory a collective allocated for its own steps (see [`NcclOperand::scratch`]),
/// freed when dropped.
///
/// ```no_run
/// use nexar_types::{Buf, Cuda, RecvBuf};
/// let mut buf = Buf::<f32, Cuda>::from_host(0, &[3.0; 4])?;
/// let operand = buf.nccl_operand().unwrap();
/// let mut room = operand.scratch(8)?;
/// room.operand().copy_within_device(4, &operand.source(), 0..4)?;
/// # Ok::<(), nexar_types::DeviceError>(())
/// ```
pub struct NcclScratch<T: Element> {
    slice: CudaSlice<T>,
    stream: Arc<CudaStream>,
    device: usize,
}

impl<T: Element> fmt::Debug for NcclScratch<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclScratch").field("device", &self.device).field("len", &self.slice.len()).finish()
    }
}

impl<T: Element> NcclScratch<T> {
    /// The memory as an operand of NCCL operations and copies.
    pub fn operand(&mut self) -> NcclOperand<'_, T> {
        NcclOperand { slice: &mut self.slice, stream: self.stream.clone(), device: self.device }
    }
}

/// Checks that `range` lies within `len` elements and is as long as a host side of `host`.
fn check(len: usize, range: &std::ops::Range<usize>, host: usize) -> Result<(), DeviceError> {
    if range.start > range.end || range.end > len || range.len() != host {
        return Err(DeviceError::LengthMismatch { adapter: "nccl", buffer: len, host });
    }
    Ok(())
}

/// Copies elements `range` of `slice` to `out` and waits for the copy.
fn copy_out<T: Element>(
    slice: &CudaSlice<T>,
    stream: &Arc<CudaStream>,
    device: usize,
    range: std::ops::Range<usize>,
    out: &mut [T],
) -> Result<(), DeviceError> {
    check(slice.len(), &range, out.len())?;
    CudaAdapter::global().download_at(slice, stream, device, range.start, out)
}
