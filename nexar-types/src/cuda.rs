//! Device memory (feature `cuda`): `Buf<T, Cuda>` backed by cudarc, with the CUDA driver loaded
//! at run time, so this builds and runs (reporting "no CUDA driver") on hosts without a GPU.
//!
//! Every copy between host and device waits for completion before it returns: nothing is ever
//! written into memory the caller got back.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::adapter::DeviceAdapter;
use crate::buf::{Buf, DeviceError, HostStage, HostView, RecvBuf, SendBuf, WriteBack};
use crate::cuda_adapter::CudaAdapter;
use crate::cuda_segments::CudaSegments;
use crate::element::Element;
use crate::segments::SegmentStage;
use crate::space::Cuda;

/// The elements of a `Buf<T, Cuda>`: device memory, the stream its copies are ordered on, and
/// the device index.
pub struct CudaStorage<T: Element> {
    slice: CudaSlice<T>,
    stream: Arc<CudaStream>,
    device: usize,
}

impl<T: Element> CudaStorage<T> {
    /// The device memory, its stream and its device index.
    pub(crate) fn parts(&self) -> (&CudaSlice<T>, &Arc<CudaStream>, usize) {
        (&self.slice, &self.stream, self.device)
    }

    /// The device memory for writing, its stream and its device index.
    pub(crate) fn parts_mut_with_device(&mut self) -> (&mut CudaSlice<T>, Arc<CudaStream>, usize) {
        (&mut self.slice, self.stream.clone(), self.device)
    }

    /// The device memory, for writing, and its stream.
    pub(crate) fn parts_mut(&mut self) -> (&mut CudaSlice<T>, Arc<CudaStream>) {
        (&mut self.slice, self.stream.clone())
    }
}

impl<T: Element> fmt::Debug for CudaStorage<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStorage").field("device", &self.device).field("len", &self.slice.len()).finish()
    }
}

/// Whether the CUDA driver library can be loaded on this host (checked once).
fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: this only tries to load the driver library (libcuda) and reports whether it
        // loaded; none of its functions is called here. cudarc's own entry points would panic
        // instead of returning an error when the library is missing.
        #[cfg(not(feature = "cuda-linked"))]
        #[allow(unsafe_code)]
        unsafe {
            cudarc::driver::sys::is_culib_present()
        }
        // Linked when the program was built: it would not have started without the library.
        #[cfg(feature = "cuda-linked")]
        true
    })
}

fn unavailable() -> DeviceError {
    DeviceError::Unavailable { reason: "no CUDA driver (libcuda.so) was found on this host".into() }
}

pub(crate) fn driver(op: &'static str, device: usize) -> impl Fn(cudarc::driver::DriverError) -> DeviceError {
    move |e| DeviceError::Driver { op, device, reason: e.to_string() }
}

/// The number of CUDA devices on this host.
///
/// ```
/// match nexar_types::cuda_device_count() {
///     Ok(n) => println!("{n} GPUs"),
///     Err(e) => println!("no GPU: {e}"), // e.g. no CUDA driver on this host
/// }
/// ```
pub fn cuda_device_count() -> Result<usize, DeviceError> {
    if !driver_present() {
        return Err(unavailable());
    }
    let n = CudaContext::device_count().map_err(driver("counting devices", 0))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The context of `device`, made once per process.
pub(crate) fn context(device: usize) -> Result<Arc<CudaContext>, DeviceError> {
    let count = cuda_device_count()?;
    if device >= count {
        return Err(DeviceError::NoDevice { index: device, count });
    }
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = OnceLock::new();
    let mut contexts = CONTEXTS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ctx) = contexts.get(&device) {
        return Ok(ctx.clone());
    }
    let ordinal = device;
    let ctx = CudaContext::new(ordinal).map_err(driver("creating a context", device))?;
    contexts.insert(device, ctx.clone());
    Ok(ctx)
}

impl<T: Element> Buf<T, Cuda> {
    /// `len` zero elements on device `device`.
    ///
    /// ```no_run
    /// use nexar_types::{Buf, Cuda};
    /// let b = Buf::<f32, Cuda>::zeros_on(0, 1024)?;
    /// assert_eq!(b.len(), 1024);
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn zeros_on(device: usize, len: usize) -> Result<Self, DeviceError> {
        let stream = context(device)?.default_stream();
        let slice = stream.alloc_zeros::<T>(len).map_err(driver("allocating device memory", device))?;
        stream.synchronize().map_err(driver("allocating device memory", device))?;
        Ok(Buf { storage: CudaStorage { slice, stream, device } })
    }

    /// A device copy of `data` on device `device`.
    ///
    /// ```no_run
    /// use nexar_types::{Buf, Cuda};
    /// let b = Buf::<u32, Cuda>::from_host(0, &[1, 2, 3])?;
    /// assert_eq!(b.to_host()?, vec![1, 2, 3]);
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn from_host(device: usize, data: &[T]) -> Result<Self, DeviceError> {
        let mut buf = Self::zeros_on(device, data.len())?;
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// Copies the elements to host memory (through [`CudaAdapter::global`]).
    pub fn to_host(&self) -> Result<Vec<T>, DeviceError> {
        let mut host = vec![T::zeroed(); self.len()];
        CudaAdapter::global().download(self, &mut host)?;
        Ok(host)
    }

    /// Overwrites the elements with `data`, which must be as long as the buffer (through
    /// [`CudaAdapter::global`]).
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<(), DeviceError> {
        CudaAdapter::global().upload(self, data)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.storage.slice.len()
    }

    /// `true` when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device the elements live on.
    pub fn device(&self) -> usize {
        self.storage.device
    }

    /// Where the elements live in the device's address space, for registering them with
    /// another driver (GPUDirect RDMA: `nexar_rdma::GpuRegion`). Every copy and kernel of
    /// this buffer has finished when it returns. The address stays valid while the buffer
    /// lives; it is a number, not a pointer the host can read through.
    ///
    /// ```no_run
    /// use nexar_types::{Buf, Cuda};
    /// let b = Buf::<f32, Cuda>::zeros_on(0, 1024)?;
    /// let span = b.device_span()?;
    /// assert_eq!((span.device, span.bytes), (0, 4096));
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn device_span(&self) -> Result<DeviceSpan, DeviceError> {
        use cudarc::driver::DevicePtr;
        let (slice, stream, device) = self.storage.parts();
        let (address, record) = slice.device_ptr(stream);
        drop(record);
        stream.synchronize().map_err(driver("reading a device address", device))?;
        Ok(DeviceSpan { device, address, bytes: slice.num_bytes() })
    }
}

/// A range of device memory: its device, its address in the device's (unified) address space,
/// and its length in bytes. See [`Buf::device_span`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSpan {
    /// The device index.
    pub device: usize,
    /// The first byte's device address.
    pub address: u64,
    /// Length in bytes.
    pub bytes: usize,
}

impl<T: Element> WriteBack<T> for Buf<T, Cuda> {
    fn write_back(&mut self, host: &[T]) -> Result<(), DeviceError> {
        self.copy_from_host(host)
    }
}

impl<T: Element> SendBuf for Buf<T, Cuda> {
    type Elem = T;
    fn elems(&self) -> usize {
        self.len()
    }
    fn host_view(&self) -> Result<HostView<'_, T>, DeviceError> {
        Ok(HostView::Copied(self.to_host()?))
    }

    #[cfg(feature = "nccl")]
    fn nccl_source(&self) -> Option<crate::nccl_buffers::NcclSource<'_, T>> {
        crate::nccl_buffers::NcclSource::of(self)
    }
}

impl<T: Element> RecvBuf for Buf<T, Cuda> {
    fn host_stage(&mut self) -> Result<HostStage<'_, T>, DeviceError> {
        let host = self.to_host()?;
        Ok(HostStage::copied(host, self))
    }

    fn segment_stage(&mut self, segment: usize) -> Result<Box<dyn SegmentStage<T> + Send + '_>, DeviceError> {
        Ok(Box::new(CudaSegments::new(self, segment)))
    }

    #[cfg(feature = "nccl")]
    fn nccl_operand(&mut self) -> Option<crate::nccl_buffers::NcclOperand<'_, T>> {
        crate::nccl_buffers::NcclOperand::of(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (CI): a clear error, no panic. With one: a round trip.
    #[test]
    fn device_buffers_round_trip_or_report_why_not() {
        match Buf::<f32, Cuda>::from_host(0, &[1.0, 2.0, 3.0]) {
            Ok(b) => {
                assert_eq!(b.to_host().unwrap(), vec![1.0, 2.0, 3.0]);
                let mut z = Buf::<f32, Cuda>::zeros_on(0, 3).unwrap();
                z.copy_from_host(&[4.0, 5.0, 6.0]).unwrap();
                assert_eq!(z.host_view().unwrap()[..], [4.0, 5.0, 6.0]);
                // Chunked through pinned buffers: 64 KiB chunks, a partial last one.
                let adapter = CudaAdapter::new(64 << 10);
                let data: Vec<u32> = (0..100_003).collect();
                let mut big = Buf::<u32, Cuda>::zeros_on(0, data.len()).unwrap();
                adapter.upload(&mut big, &data).unwrap();
                let mut back = vec![0u32; data.len()];
                adapter.download(&big, &mut back).unwrap();
                assert_eq!(back, data);
                assert_eq!(big.to_host().unwrap(), data, "the global adapter agrees");
                let short = adapter.download(&big, &mut back[..10]).unwrap_err();
                assert!(matches!(short, DeviceError::LengthMismatch { buffer: 100_003, host: 10, .. }));
                // Segments through two pinned buffers, a shorter last one.
                {
                    let ranges: Vec<_> = crate::segment_ranges(big.len(), 40_000).collect();
                    let mut stage = big.segment_stage(40_000).unwrap();
                    stage.prefetch(ranges[0].clone()).unwrap();
                    for (k, range) in ranges.iter().enumerate() {
                        if let Some(next) = ranges.get(k + 1) {
                            stage.prefetch(next.clone()).unwrap();
                        }
                        let seg = stage.host().unwrap();
                        assert_eq!(seg.len(), range.len());
                        assert_eq!(seg, &data[range.clone()], "segment {k} arrived");
                        seg.iter_mut().for_each(|x| *x += 1);
                        stage.write_back().unwrap();
                    }
                    assert!(stage.write_back().is_err(), "nothing left to write back");
                    stage.finish().unwrap();
                }
                let back = big.to_host().unwrap();
                assert!(back.iter().zip(&data).all(|(b, d)| *b == d + 1), "every segment written back");
                // At size, through the default 4 MiB chunks and 8 MiB segments, several times
                // with new data: each host read waits for its own copy (a read that raced the
                // DMA was seen on an H100 before the copies had events of their own).
                for round in 0..3u32 {
                    let data: Vec<u32> = (0..24_000_003u32).map(|i| i.wrapping_mul(2_654_435_761) ^ round).collect();
                    let mut big = Buf::<u32, Cuda>::from_host(0, &data).unwrap();
                    assert!(big.to_host().unwrap() == data, "round {round}: chunked round trip");
                    let ranges: Vec<_> = crate::segment_ranges(big.len(), 2 << 20).collect();
                    let mut stage = big.segment_stage(2 << 20).unwrap();
                    stage.prefetch(ranges[0].clone()).unwrap();
                    for (k, range) in ranges.iter().enumerate() {
                        if let Some(next) = ranges.get(k + 1) {
                            stage.prefetch(next.clone()).unwrap();
                        }
                        let seg = stage.host().unwrap();
                        assert!(seg == &data[range.clone()], "round {round}: segment {k} arrived whole");
                        seg.iter_mut().for_each(|x| *x = x.wrapping_add(round));
                        stage.write_back().unwrap();
                    }
                    stage.finish().unwrap();
                    drop(stage);
                    let back = big.to_host().unwrap();
                    assert!(back.iter().zip(&data).all(|(b, d)| *b == d.wrapping_add(round)), "round {round}");
                }
            }
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains("CUDA driver") || text.contains("does not exist"), "{text}");
            }
        }
        let past = cuda_device_count().unwrap_or(0);
        assert!(Buf::<u8, Cuda>::zeros_on(past, 1).is_err(), "a device past the last one is an error");
    }
}
