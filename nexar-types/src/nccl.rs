//! NCCL for device buffers (feature `nccl`): communicators among the GPUs of one host, with the
//! library loaded at run time, so builds and hosts without NCCL are unaffected.
//!
//! The runtime (`nexar`) hands out the unique id over its own links, makes one
//! [`NcclComm`] per communicator and host, and runs a `Buf<T, Cuda>` collective as an
//! [`NcclInFlight`] that it polls without blocking its tasks. An operation still in flight when
//! its `NcclInFlight` is dropped (the caller's future dropped, or a deadline passed) aborts the
//! communicator and waits for the stream, so the GPU never writes into the buffer after the
//! borrow ends.
//!
//! Every block of `unsafe` here calls into libnccl with a raw communicator this module owns
//! and device addresses taken from live `CudaSlice`s; each says why it holds.

use std::fmt;
use std::sync::Mutex;

use cudarc::driver::{DevicePtr, DevicePtrMut};

pub use crate::nccl_buffers::{DeviceWindow, NcclOperand, NcclScratch, NcclSource};
pub use crate::nccl_in_flight::NcclInFlight;
pub use crate::nccl_types::nccl_supports;
use crate::nccl_types::{buf_type, nccl_op};
use cudarc::nccl::{result, sys};

use crate::buf::DeviceError;
use crate::cuda::{context, driver};
use crate::element::Element;
use crate::op::ReduceOp;

/// Whether NCCL can be used on this host: the CUDA driver and libnccl load, and the library
/// reports its version as `(major, minor, patch)`.
///
/// nexar looks for the library under the names cudarc tries (`libnccl.so`, from a
/// `libnccl-dev` package or a link to `libnccl.so.2`), on the usual search path and
/// `LD_LIBRARY_PATH`.
///
/// ```
/// match nexar_types::nccl_version() {
///     Ok((major, minor, patch)) => println!("NCCL {major}.{minor}.{patch}"),
///     Err(e) => println!("no NCCL here: {e}"),
/// }
/// ```
pub fn nccl_version() -> Result<(u32, u32, u32), DeviceError> {
    // Asked before every device collective: found once per process.
    static FOUND: std::sync::OnceLock<Result<(u32, u32, u32), DeviceError>> = std::sync::OnceLock::new();
    FOUND.get_or_init(find_nccl).clone()
}

fn find_nccl() -> Result<(u32, u32, u32), DeviceError> {
    crate::cuda::cuda_device_count()?;
    if !library_present() {
        let dirs = crate::nccl_missing::library_dirs(std::env::var_os("LD_LIBRARY_PATH").as_deref());
        return Err(DeviceError::Unavailable { reason: crate::nccl_missing::not_found_reason(&dirs) });
    }
    let code = result::get_nccl_version().map_err(nccl_error("reading the NCCL version", 0))?;
    let code = u32::try_from(code).unwrap_or(0);
    // NCCL >= 2.9 encodes MAJOR * 10000 + MINOR * 100 + PATCH.
    Ok((code / 10_000, (code / 100) % 100, code % 100))
}

fn library_present() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: only tries to open the library and reports whether it opened; no NCCL
        // function is called. cudarc's entry points panic when the library is missing, so
        // every path to them checks this first.
        #[allow(unsafe_code)]
        unsafe {
            sys::is_culib_present()
        }
    })
}

fn nccl_error(op: &'static str, device: usize) -> impl Fn(result::NcclError) -> DeviceError {
    move |e| DeviceError::Driver { op, device, reason: format!("NCCL: {:?}", e.0) }
}

/// The 128-byte id that names one NCCL communicator: made by one rank, sent to the others.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl NcclId {
    /// A fresh id (asks libnccl, which opens its bootstrap listener on this host).
    ///
    /// ```no_run
    /// let id = nexar_types::NcclId::new()?;
    /// let bytes = *id.as_bytes(); // send these to the other ranks
    /// assert_eq!(nexar_types::NcclId::from_bytes(bytes), id);
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn new() -> Result<Self, DeviceError> {
        nccl_version()?;
        let id = result::get_uniqueid().map_err(nccl_error("making an NCCL id", 0))?;
        Ok(NcclId(id.internal.map(|c| c as u8)))
    }

    /// An id received from the rank that made it.
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        NcclId(bytes)
    }

    /// The bytes to send.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NcclId(..)")
    }
}

/// One rank's member of an NCCL communicator on one device.
pub struct NcclComm {
    raw: sys::ncclComm_t,
    device: usize,
    rank: usize,
    size: usize,
    /// `true` once the communicator was aborted (NCCL then frees it: `raw` must not be used
    /// again). Every use of `raw` holds this lock, so uses are one at a time and none follows
    /// the abort.
    aborted: Mutex<bool>,
}

// SAFETY: an NCCL communicator handle may be used from any thread, one call at a time.
#[allow(unsafe_code)]
unsafe impl Send for NcclComm {}
// SAFETY: every call through `&NcclComm` that uses the handle (enqueue, abort, asking for the
// asynchronous error) holds the `aborted` lock and checks it first, so calls from several
// threads are one at a time and none reaches a handle that an abort freed. (The order of
// collectives across ranks is the caller's to keep, as with NCCL itself; a wrong order is a
// hang or an NCCL error, not a memory error.)
#[allow(unsafe_code)]
unsafe impl Sync for NcclComm {}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("device", &self.device)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `size` on `device`. Blocks until every rank has
    /// joined (run it off the async runtime's threads).
    ///
    /// ```no_run
    /// use nexar_types::{NcclComm, NcclId};
    /// let id = NcclId::new()?;
    /// let comm = NcclComm::join(0, 0, 1, &id)?; // a communicator of one
    /// assert_eq!((comm.rank(), comm.size()), (0, 1));
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn join(device: usize, rank: usize, size: usize, id: &NcclId) -> Result<Self, DeviceError> {
        nccl_version()?;
        if rank >= size {
            return Err(DeviceError::Unavailable { reason: format!("NCCL rank {rank} of {size}") });
        }
        let (n, r) = match (i32::try_from(size), i32::try_from(rank)) {
            (Ok(n), Ok(r)) => (n, r),
            _ => return Err(DeviceError::Unavailable { reason: format!("{size} NCCL ranks") }),
        };
        context(device)?.bind_to_thread().map_err(driver("joining an NCCL communicator", device))?;
        let unique = sys::ncclUniqueId { internal: id.0.map(|b| b as ::core::ffi::c_char) };
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid place for the handle; the id is 128 bytes by type; the
        // device's context is current on this thread, as ncclCommInitRank requires.
        #[allow(unsafe_code)]
        unsafe { result::comm_init_rank(&mut raw, n, unique, r) }.map_err(|e| DeviceError::Driver {
            op: "joining an NCCL communicator",
            device,
            reason: format!("NCCL: {:?}{}", e.0, last_error()),
        })?;
        Ok(NcclComm { raw, device, rank, size, aborted: Mutex::new(false) })
    }

    /// This rank's index in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device this member runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Whether the communicator was aborted (a failed, timed-out or dropped operation); it
    /// takes no more work.
    pub fn is_aborted(&self) -> bool {
        *self.live()
    }

    /// Starts an in-place allreduce of `buf` on its stream.
    pub fn all_reduce<'a, T: Element>(
        &'a self,
        buf: &'a mut NcclOperand<'_, T>,
        op: ReduceOp,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        let nop = self.reduction(op)?;
        let count = buf.len();
        self.start(buf, None, "an NCCL allreduce", |comm, at, stream| {
            // SAFETY: send and receive are the same live allocation of `count` elements of the
            // operand's type on this communicator's device (checked in `start`), ordered on
            // its stream, and kept borrowed until the operation completed or was aborted.
            #[allow(unsafe_code)]
            unsafe {
                result::all_reduce(at.recv(0), at.recv(0), count, buf_type::<T>(), nop, comm, stream)
            }
        })
    }

    /// Starts an in-place broadcast of `root`'s `buf` on its stream.
    pub fn broadcast<'a, T: Element>(
        &'a self,
        buf: &'a mut NcclOperand<'_, T>,
        root: usize,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        let root = self.member(root)?;
        let count = buf.len();
        self.start(buf, None, "an NCCL broadcast", |comm, at, stream| {
            // SAFETY: as for `all_reduce`: one live allocation of `count` elements on this
            // communicator's device, borrowed until the operation is over.
            #[allow(unsafe_code)]
            unsafe {
                result::broadcast(at.recv(0), at.recv(0), count, buf_type::<T>(), root, comm, stream)
            }
        })
    }

    /// Starts an in-place reduction of every rank's `buf` into `root`'s `buf`.
    pub fn reduce<'a, T: Element>(
        &'a self,
        buf: &'a mut NcclOperand<'_, T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        self.reduce_on(None, buf, op, root)
    }

    /// Starts an in-place reduce-scatter: `buf` holds `size()` blocks of `buf.len() / size()`
    /// elements, and this rank's block (block `rank()`) ends as the reduction of every rank's
    /// block of that index. `buf.len()` must be a multiple of `size()`.
    pub fn reduce_scatter<'a, T: Element>(
        &'a self,
        buf: &'a mut NcclOperand<'_, T>,
        op: ReduceOp,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        let nop = self.reduction(op)?;
        let block = self.block(buf.len())?;
        let mine = self.rank * block;
        self.start(buf, None, "an NCCL reduce-scatter", |comm, at, stream| {
            // SAFETY: as for `all_reduce`; this rank's block lies inside the allocation
            // (`block * size == len`, checked), which is NCCL's in-place form.
            #[allow(unsafe_code)]
            unsafe {
                result::reduce_scatter(at.recv(0), at.recv(mine), block, buf_type::<T>(), nop, comm, stream)
            }
        })
    }

    /// Starts an in-place all-gather: every rank's block `rank()` of `buf` (blocks of
    /// `buf.len() / size()` elements) reaches every rank's `buf`.
    pub fn all_gather<'a, T: Element>(
        &'a self,
        buf: &'a mut NcclOperand<'_, T>,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        let block = self.block(buf.len())?;
        let mine = self.rank * block;
        self.start(buf, None, "an NCCL all-gather", |comm, at, stream| {
            // SAFETY: as for `reduce_scatter`: NCCL's in-place form, inside the allocation.
            #[allow(unsafe_code)]
            unsafe {
                result::all_gather(at.recv(mine), at.recv(0), block, buf_type::<T>(), comm, stream)
            }
        })
    }

    /// Starts a reduction of every rank's `send` into `root`'s `recv` (as long as `send`;
    /// other ranks' `recv` is not written). `send` is only read.
    ///
    /// ```no_run
    /// use nexar_types::{Buf, Cuda, NcclComm, NcclId, RecvBuf, ReduceOp, SendBuf};
    /// let comm = NcclComm::join(0, 0, 1, &NcclId::new()?)?;
    /// let grads = Buf::<f32, Cuda>::from_host(0, &[0.5; 8])?;
    /// let mut sum = Buf::<f32, Cuda>::zeros_on(0, 8)?;
    /// let (send, mut recv) = (grads.nccl_source().unwrap(), sum.nccl_operand().unwrap());
    /// let mut flight = comm.reduce_from(&send, &mut recv, ReduceOp::Sum, 0)?;
    /// while !flight.poll()? {}
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn reduce_from<'a, T: Element>(
        &'a self,
        send: &'a NcclSource<'_, T>,
        recv: &'a mut NcclOperand<'_, T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        lengths(send.len(), recv.len(), 1)?;
        self.reduce_on(Some(send), recv, op, root)
    }

    /// A reduce from `send` (or in place, from `recv` itself) into `root`'s `recv`.
    fn reduce_on<'a, T: Element>(
        &'a self,
        send: Option<&'a NcclSource<'_, T>>,
        recv: &'a mut NcclOperand<'_, T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        let (nop, root) = (self.reduction(op)?, self.member(root)?);
        let count = recv.len();
        self.start(recv, send, "an NCCL reduce", |comm, at, stream| {
            // SAFETY: the send side (`recv` itself in place) and `recv` are live allocations
            // of `count` elements of the operands' type on this communicator's device (checked
            // in `start` and by the callers), ordered on the receiving stream and borrowed
            // until the operation is over.
            #[allow(unsafe_code)]
            unsafe {
                result::reduce(at.send(0), at.recv(0), count, buf_type::<T>(), nop, root, comm, stream)
            }
        })
    }

    /// Starts a reduce-scatter from `send` (`size()` blocks as long as `recv`) into `recv`:
    /// this rank's `recv` ends as the reduction of every rank's block `rank()`. `send` is only
    /// read.
    ///
    /// ```no_run
    /// use nexar_types::{Buf, Cuda, NcclComm, NcclId, RecvBuf, ReduceOp, SendBuf};
    /// let comm = NcclComm::join(0, 0, 1, &NcclId::new()?)?;
    /// let full = Buf::<f32, Cuda>::from_host(0, &[1.0; 8])?;
    /// let mut mine = Buf::<f32, Cuda>::zeros_on(0, 8 / comm.size())?;
    /// let (send, mut recv) = (full.nccl_source().unwrap(), mine.nccl_operand().unwrap());
    /// let mut flight = comm.reduce_scatter_from(&send, &mut recv, ReduceOp::Max)?;
    /// while !flight.poll()? {}
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn reduce_scatter_from<'a, T: Element>(
        &'a self,
        send: &'a NcclSource<'_, T>,
        recv: &'a mut NcclOperand<'_, T>,
        op: ReduceOp,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        let nop = self.reduction(op)?;
        let block = lengths(recv.len(), send.len(), self.size)?;
        self.start(recv, Some(send), "an NCCL reduce-scatter", |comm, at, stream| {
            // SAFETY: as for `reduce_from`; `send` holds `size * block` elements, `recv`
            // `block` (checked above).
            #[allow(unsafe_code)]
            unsafe {
                result::reduce_scatter(at.send(0), at.recv(0), block, buf_type::<T>(), nop, comm, stream)
            }
        })
    }

    /// Starts an all-gather of every rank's `send` into `recv` (`size()` blocks as long as
    /// `send`, in rank order). `send` is only read.
    ///
    /// ```no_run
    /// use nexar_types::{Buf, Cuda, NcclComm, NcclId, RecvBuf, SendBuf};
    /// let comm = NcclComm::join(0, 0, 1, &NcclId::new()?)?;
    /// let mine = Buf::<f32, Cuda>::from_host(0, &[1.0; 4])?;
    /// let mut all = Buf::<f32, Cuda>::zeros_on(0, 4)?;
    /// let (send, mut recv) = (mine.nccl_source().unwrap(), all.nccl_operand().unwrap());
    /// let mut flight = comm.all_gather_from(&send, &mut recv)?;
    /// while !flight.poll()? {}
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn all_gather_from<'a, T: Element>(
        &'a self,
        send: &'a NcclSource<'_, T>,
        recv: &'a mut NcclOperand<'_, T>,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        let block = lengths(send.len(), recv.len(), self.size)?;
        self.start(recv, Some(send), "an NCCL all-gather", |comm, at, stream| {
            // SAFETY: as for `reduce_from`; `send` holds `block` elements, `recv`
            // `size * block` (checked above).
            #[allow(unsafe_code)]
            unsafe {
                result::all_gather(at.send(0), at.recv(0), block, buf_type::<T>(), comm, stream)
            }
        })
    }

    fn reduction(&self, op: ReduceOp) -> Result<sys::ncclRedOp_t, DeviceError> {
        nccl_op(op).ok_or_else(|| DeviceError::Unavailable { reason: format!("NCCL has no {op:?} reduction") })
    }

    fn member(&self, root: usize) -> Result<i32, DeviceError> {
        match i32::try_from(root) {
            Ok(r) if root < self.size => Ok(r),
            _ => Err(DeviceError::Unavailable { reason: format!("NCCL root {root} of {} ranks", self.size) }),
        }
    }

    fn block(&self, len: usize) -> Result<usize, DeviceError> {
        if !len.is_multiple_of(self.size) {
            return Err(DeviceError::Unavailable {
                reason: format!("{len} elements do not split into {} equal NCCL blocks", self.size),
            });
        }
        Ok(len / self.size)
    }

    /// Enqueues one operation on the operand's stream; `enqueue` gets the raw communicator, a
    /// function from an element offset to its device address, and the stream.
    fn start<'a, T: Element>(
        &'a self,
        operand: &'a mut NcclOperand<'_, T>,
        source: Option<&'a NcclSource<'_, T>>,
        what: &'static str,
        enqueue: impl FnOnce(
            sys::ncclComm_t,
            &Addresses,
            sys::cudaStream_t,
        ) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<NcclInFlight<'a>, DeviceError> {
        for device in std::iter::once(operand.device).chain(source.map(|s| s.device)) {
            if device != self.device {
                return Err(DeviceError::Unavailable {
                    reason: format!("a buffer on device {device} for an NCCL communicator on device {}", self.device),
                });
            }
        }
        let stream = operand.stream.clone();
        stream.context().bind_to_thread().map_err(driver(what, self.device))?;
        {
            let aborted = self.live();
            if *aborted {
                return Err(DeviceError::Unavailable { reason: "this NCCL communicator was aborted".into() });
            }
            // The records order later work on these buffers after the operation once dropped,
            // which is after the enqueue (and the source's earlier writes before it).
            let (recv, _record) = operand.slice.device_ptr_mut(&stream);
            let (send, _read) = match source {
                Some(source) => {
                    let (send, read) = source.slice.device_ptr(&stream);
                    (send, Some(read))
                }
                None => (recv, None),
            };
            let at = Addresses { send, recv, elem: size_of::<T>() };
            enqueue(self.raw, &at, stream.cu_stream() as _).map_err(|e| DeviceError::Driver {
                op: what,
                device: self.device,
                reason: format!("NCCL: {:?}{}", e.0, last_error()),
            })?;
        }
        let done = stream.record_event(None).map_err(driver(what, self.device))?;
        Ok(NcclInFlight::new(self, stream, done, what))
    }

    /// Stops every operation of this communicator; it takes no more work.
    pub fn abort(&self) {
        let mut aborted = self.live();
        if !*aborted {
            *aborted = true;
            // SAFETY: `raw` came from ncclCommInitRank and is aborted once, under the lock that
            // every other use of it takes and checks first; `drop` skips its destruction.
            #[allow(unsafe_code)]
            let _ = unsafe { result::comm_abort(self.raw) };
        }
    }

    /// The lock every use of `raw` holds; `true` inside once the communicator was aborted.
    fn live(&self) -> std::sync::MutexGuard<'_, bool> {
        self.aborted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The communicator's asynchronous error, if it has one.
    pub(crate) fn async_error(&self) -> Result<(), DeviceError> {
        let aborted = self.live();
        if *aborted {
            return Err(DeviceError::Unavailable { reason: "this NCCL communicator was aborted".into() });
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is live (not aborted, checked under the lock held here) and `state` a
        // valid place for the result.
        #[allow(unsafe_code)]
        let asked = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) };
        drop(aborted);
        match (asked, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => {
                Ok(())
            }
            (sys::ncclResult_t::ncclSuccess, failed) | (failed, _) => Err(DeviceError::Driver {
                op: "an NCCL operation",
                device: self.device,
                reason: format!("NCCL: {failed:?}{}", last_error()),
            }),
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !*self.live() {
            // SAFETY: `raw` came from ncclCommInitRank, was not aborted, and is destroyed once;
            // every operation on it was waited for by its `NcclInFlight`, which borrows `self`.
            #[allow(unsafe_code)]
            let _ = unsafe { result::comm_destroy(self.raw) };
        }
    }
}

/// The device addresses of an operation's two sides, by element offset (the same allocation
/// for the in-place forms).
struct Addresses {
    send: u64,
    recv: u64,
    elem: usize,
}

impl Addresses {
    fn send(&self, elems: usize) -> *const ::core::ffi::c_void {
        (self.send + (elems * self.elem) as u64) as *const ::core::ffi::c_void
    }

    fn recv(&self, elems: usize) -> *mut ::core::ffi::c_void {
        (self.recv + (elems * self.elem) as u64) as *mut ::core::ffi::c_void
    }
}

/// `block` when `long == block * blocks`, the error naming both lengths otherwise.
fn lengths(block: usize, long: usize, blocks: usize) -> Result<usize, DeviceError> {
    if block.checked_mul(blocks) != Some(long) {
        return Err(DeviceError::Unavailable {
            reason: format!("NCCL buffers of {block} and {long} elements for {blocks} ranks"),
        });
    }
    Ok(block)
}

/// NCCL's own words for its last error, after ": ", or nothing.
fn last_error() -> String {
    // SAFETY: ncclGetLastError(NULL) returns a pointer to a NUL-terminated string owned by the
    // library (or null); it is copied at once.
    #[allow(unsafe_code)]
    let text = unsafe {
        let p = sys::ncclGetLastError(std::ptr::null_mut());
        if p.is_null() { String::new() } else { std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned() }
    };
    if text.is_empty() { String::new() } else { format!(": {text}") }
}
