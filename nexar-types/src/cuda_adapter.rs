//! The CUDA [`DeviceAdapter`]: copies between device memory and host memory, staged through
//! two pinned (page-locked) host buffers for large buffers, so the DMA of one chunk overlaps
//! the host copy of the previous one. Pinned buffers are made once per device and element
//! type and reused.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};

use crate::adapter::{DeviceAdapter, same_length};
use crate::buf::{Buf, DeviceError};
use crate::cuda::driver;
use crate::element::Element;
use crate::space::Cuda;

/// Bytes of each pinned staging buffer of [`CudaAdapter::global`].
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// Idle pinned buffers kept per (device, element type, length).
const IDLE_PER_KEY: usize = 4;

/// (device, element type, length) of a pool of pinned buffers.
type PoolKey = (usize, TypeId, usize);

/// The adapter of CUDA device memory (feature `cuda`).
///
/// Buffers under 64 KiB move in one copy from or to pageable memory; larger ones through two
/// pinned host buffers of one chunk each, used in turn: while the GPU copies chunk `i + 1` into
/// one, the CPU copies chunk `i` out of the other. Every call waits for its last copy before it
/// returns.
///
/// ```no_run
/// use nexar_types::{Buf, Cuda, CudaAdapter, DeviceAdapter};
/// let grads = Buf::<f32, Cuda>::from_host(0, &vec![1.0; 1 << 24])?;
/// let mut host = vec![0.0f32; 1 << 24];
/// CudaAdapter::global().download(&grads, &mut host)?; // 16 × 4 MiB chunks, overlapped
/// # Ok::<(), nexar_types::DeviceError>(())
/// ```
#[derive(Debug)]
pub struct CudaAdapter {
    chunk_bytes: usize,
    /// Idle pinned buffers by (device, element type, length), each a `Vec<PinnedHostSlice<T>>`.
    pools: Mutex<HashMap<PoolKey, Box<dyn Any + Send>>>,
}

impl CudaAdapter {
    /// An adapter whose pinned buffers hold `chunk_bytes` each (at least 64 KiB).
    pub fn new(chunk_bytes: usize) -> CudaAdapter {
        CudaAdapter { chunk_bytes: chunk_bytes.max(64 << 10), pools: Mutex::default() }
    }

    /// The process-wide adapter (4 MiB chunks) that device buffers use in every operation.
    pub fn global() -> &'static CudaAdapter {
        static GLOBAL: OnceLock<CudaAdapter> = OnceLock::new();
        GLOBAL.get_or_init(|| CudaAdapter::new(DEFAULT_CHUNK_BYTES))
    }

    fn chunk_elems<T>(&self) -> usize {
        (self.chunk_bytes / size_of::<T>().max(1)).max(1)
    }

    /// A pinned buffer of `len` elements of `T` on `device`, from the pool or new.
    pub(crate) fn take_pinned<T: Element>(
        &self,
        device: usize,
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> Result<PinnedHostSlice<T>, DeviceError> {
        let key = (device, TypeId::of::<T>(), len);
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        let idle = pools.get_mut(&key).and_then(|p| p.downcast_mut::<Vec<PinnedHostSlice<T>>>()).and_then(Vec::pop);
        drop(pools);
        match idle {
            Some(pinned) => Ok(pinned),
            None => pinned_zeros(ctx, device, len),
        }
    }

    /// Keeps `pinned` for reuse (up to a few per key); every copy of it must have finished.
    pub(crate) fn give_pinned<T: Element>(&self, device: usize, pinned: PinnedHostSlice<T>) {
        let key = (device, TypeId::of::<T>(), pinned.len());
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        let pool = pools.entry(key).or_insert_with(|| Box::new(Vec::<PinnedHostSlice<T>>::new()));
        if let Some(pool) = pool.downcast_mut::<Vec<PinnedHostSlice<T>>>()
            && pool.len() < IDLE_PER_KEY
        {
            pool.push(pinned);
        }
    }

    /// Two pinned chunk buffers for `T` on `device`.
    fn take_pair<T: Element>(&self, device: usize, ctx: &Arc<CudaContext>) -> Result<PinnedPair<T>, DeviceError> {
        let len = self.chunk_elems::<T>();
        Ok([self.take_pinned(device, ctx, len)?, self.take_pinned(device, ctx, len)?])
    }

    fn give_pair<T: Element>(&self, device: usize, pair: PinnedPair<T>) {
        for pinned in pair {
            self.give_pinned(device, pinned);
        }
    }
}

/// Two pinned buffers of one element type on one device.
type PinnedPair<T> = [PinnedHostSlice<T>; 2];

/// `len` zeroed elements of pinned host memory on `device`.
fn pinned_zeros<T: Element>(
    ctx: &Arc<CudaContext>,
    device: usize,
    len: usize,
) -> Result<PinnedHostSlice<T>, DeviceError> {
    let fail = driver("allocating pinned host memory", device);
    // Plain page-locked memory: `alloc_pinned` would make it write-combined, which the GPU
    // reads fast but the CPU reads uncached, and the CPU reads every staged element.
    // SAFETY: allocating is unsafe only because the memory starts uninitialised; it is
    // zeroed here, through a raw pointer, before anything reads it.
    #[allow(unsafe_code)]
    let pinned = unsafe {
        let mut pinned = ctx.alloc_pinned_with_flags::<T>(len, 0).map_err(&fail)?;
        let ptr = pinned.as_mut_ptr().map_err(&fail)?;
        std::ptr::write_bytes(ptr, 0, len);
        pinned
    };
    Ok(pinned)
}

impl DeviceAdapter for CudaAdapter {
    type Space = Cuda;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn download<T: Element>(&self, buf: &Buf<T, Cuda>, out: &mut [T]) -> Result<(), DeviceError> {
        same_length(self.name(), buf.len(), out.len())?;
        let (slice, stream, device) = buf.storage.parts();
        self.download_at(slice, stream, device, 0, out)
    }

    fn upload<T: Element>(&self, buf: &mut Buf<T, Cuda>, data: &[T]) -> Result<(), DeviceError> {
        same_length(self.name(), buf.len(), data.len())?;
        let device = buf.device();
        let (slice, stream) = buf.storage.parts_mut();
        self.upload_at(slice, &stream, device, 0, data)
    }
}

impl CudaAdapter {
    /// Copies `out.len()` elements of `slice` from element `start` on to `out` (through the
    /// pinned pair from [`PINNED_FROM_BYTES`]) and waits for the copy. The caller checked that
    /// the range lies within `slice`.
    pub(crate) fn download_at<T: Element>(
        &self,
        slice: &CudaSlice<T>,
        stream: &Arc<CudaStream>,
        device: usize,
        start: usize,
        out: &mut [T],
    ) -> Result<(), DeviceError> {
        let fail = driver("copying to the host", device);
        if out.is_empty() {
            return Ok(());
        }
        if size_of_val(out) < PINNED_FROM_BYTES {
            stream.memcpy_dtoh(&slice.slice(start..start + out.len()), out).map_err(&fail)?;
            return stream.synchronize().map_err(fail);
        }
        let mut pair = self.take_pair::<T>(device, stream.context())?;
        let result = download_chunks(stream, slice, start, out, &mut pair, self.chunk_elems::<T>()).map_err(&fail);
        // Whatever happened, no copy into the pair may still be running when it is reused.
        let settled = stream.synchronize().map_err(&fail);
        if settled.is_ok() {
            self.give_pair(device, pair);
        }
        result.and(settled)
    }

    /// Copies `data` into `slice` from element `start` on (through the pinned pair from
    /// [`PINNED_FROM_BYTES`]) and waits for the copy. The caller checked that the range lies
    /// within `slice`.
    pub(crate) fn upload_at<T: Element>(
        &self,
        slice: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
        device: usize,
        start: usize,
        data: &[T],
    ) -> Result<(), DeviceError> {
        let fail = driver("copying to the device", device);
        if data.is_empty() {
            return Ok(());
        }
        if size_of_val(data) < PINNED_FROM_BYTES {
            stream.memcpy_htod(data, &mut slice.slice_mut(start..start + data.len())).map_err(&fail)?;
            return stream.synchronize().map_err(fail);
        }
        let mut pair = self.take_pair::<T>(device, stream.context())?;
        let result = upload_chunks(stream, slice, start, data, &mut pair, self.chunk_elems::<T>()).map_err(&fail);
        let settled = stream.synchronize().map_err(&fail);
        if settled.is_ok() {
            self.give_pair(device, pair);
        }
        result.and(settled)
    }
}

/// Copies of at least this many bytes go through pinned buffers; smaller ones straight
/// between device and pageable memory (measured on an H100: a 1 MiB round trip through pageable
/// memory took 536 µs).
const PINNED_FROM_BYTES: usize = 64 << 10;

/// Device → host in chunks: the copy of chunk `i + 1` into one pinned buffer runs while chunk
/// `i` is copied out of the other (`as_slice` waits for that buffer's own copy only).
fn download_chunks<T: Element>(
    stream: &Arc<CudaStream>,
    slice: &cudarc::driver::CudaSlice<T>,
    start: usize,
    out: &mut [T],
    pair: &mut PinnedPair<T>,
    chunk: usize,
) -> Result<(), cudarc::driver::DriverError> {
    let n = out.len();
    // Whole chunks go through the pinned pair, two in flight (a copy into a pinned buffer
    // moves the whole buffer's length; the shorter last chunk is handled after).
    let whole = n / chunk;
    let range = |i: usize| i * chunk..(i + 1) * chunk;
    let on_device = |r: std::ops::Range<usize>| r.start + start..r.end + start;
    // Each copy into a pinned buffer is followed by an event of our own, waited for before
    // the host reads it: cudarc records the buffer's own event only for contexts with several
    // streams, so `as_slice` alone would read memory the copy has not reached yet.
    let mut copied: [Option<CudaEvent>; 2] = [None, None];
    if whole > 0 {
        stream.memcpy_dtoh(&slice.slice(on_device(range(0))), &mut pair[0])?;
        copied[0] = Some(stream.record_event(None)?);
    }
    for i in 0..whole {
        if i + 1 < whole {
            stream.memcpy_dtoh(&slice.slice(on_device(range(i + 1))), &mut pair[(i + 1) % 2])?;
            copied[(i + 1) % 2] = Some(stream.record_event(None)?);
        }
        if let Some(done) = copied[i % 2].take() {
            done.synchronize()?;
        }
        let staged = pair[i % 2].as_slice()?;
        out[range(i)].copy_from_slice(staged);
    }
    // The shorter last chunk into part of a pinned buffer whose earlier copy was waited for
    // above (as a plain slice, so its length is the copy's), then waited for here.
    let rest = whole * chunk..n;
    if !rest.is_empty() {
        let staged = &mut pair[whole % 2].as_mut_slice()?[..rest.len()];
        stream.memcpy_dtoh(&slice.slice(on_device(rest.clone())), staged)?;
        stream.synchronize()?;
        out[rest].copy_from_slice(staged);
    }
    Ok(())
}

fn upload_chunks<T: Element>(
    stream: &Arc<CudaStream>,
    slice: &mut cudarc::driver::CudaSlice<T>,
    at: usize,
    data: &[T],
    pair: &mut PinnedPair<T>,
    chunk: usize,
) -> Result<(), cudarc::driver::DriverError> {
    let n = data.len();
    // The host refills a pinned buffer only once the copy out of it (two chunks back) is
    // done, known by an event of our own (see `download_chunks`).
    let mut sent: [Option<CudaEvent>; 2] = [None, None];
    for (i, start) in (0..n).step_by(chunk).enumerate() {
        let end = (start + chunk).min(n);
        let mut target = slice.slice_mut(at + start..at + end);
        if let Some(done) = sent[i % 2].take() {
            done.synchronize()?;
        }
        let pinned = &mut pair[i % 2];
        if end - start < chunk {
            // The shorter last chunk from part of the pinned buffer, as a plain slice so that
            // its length is the copy's (the caller waits for the stream).
            let staged = &mut pinned.as_mut_slice()?[..end - start];
            staged.copy_from_slice(&data[start..end]);
            stream.memcpy_htod(staged, &mut target)?;
            continue;
        }
        pinned.as_mut_slice()?.copy_from_slice(&data[start..end]);
        stream.memcpy_htod(pinned, &mut target)?;
        sent[i % 2] = Some(stream.record_event(None)?);
    }
    Ok(())
}
