//! GPUDirect RDMA (feature `gpudirect`): registering device memory with a NIC, so the NIC
//! reads and writes GPU memory without a copy through the host.
//!
//! A [`GpuRegion`] takes the device buffer by value for as long as it is registered (the NIC
//! may touch it at any moment, so nobody else may free or reuse it) and gives it back when it
//! is deregistered. Registration needs an RDMA device, a GPU, and the kernel's peer-memory
//! module (`nvidia_peermem`, or the older `nv_peer_mem`), which lets the NIC's driver resolve
//! device addresses; [`gpudirect_support`] says which is missing.
//!
//! The RDMA transport of collectives ([`attach`](crate::attach)) still moves host memory: a
//! collective on a `Buf<T, Cuda>` stages it through host memory first (see the README's
//! "hardware back ends"). A region's keys and span are what a one-sided transfer into or out
//! of the GPU needs.

use std::fmt;
use std::path::Path;

use nexar::{Buf, Cuda, DeviceSpan, Element};

use crate::RdmaError;
use crate::verbs::{DeviceRegistration, discover};

/// Kernel paths whose presence means device memory can be registered with a NIC.
const PEER_MEMORY_PATHS: [&str; 2] = ["/sys/module/nvidia_peermem", "/sys/kernel/mm/memory_peers/nv_mem/version"];

/// Whether this host can register GPU memory with a NIC: an RDMA device, a CUDA device and the
/// kernel's peer-memory support. The error says which is missing.
///
/// ```
/// match nexar_rdma::gpudirect_support() {
///     Ok(()) => println!("GPUDirect RDMA available"),
///     Err(e) => println!("{e}"), // e.g. "no RDMA device: ibverbs lists 0 devices"
/// }
/// ```
pub fn gpudirect_support() -> Result<(), RdmaError> {
    discover()?;
    let gpus = nexar::cuda_device_count().map_err(|e| RdmaError::GpuDirect { reason: e.to_string() })?;
    if gpus == 0 {
        return Err(RdmaError::GpuDirect { reason: "the CUDA driver lists 0 devices".into() });
    }
    peer_memory_in(PEER_MEMORY_PATHS.iter().map(Path::new))
}

/// `Ok` when one of `paths` exists (the peer-memory module is loaded).
fn peer_memory_in<'a>(mut paths: impl Iterator<Item = &'a Path>) -> Result<(), RdmaError> {
    if paths.any(Path::exists) {
        return Ok(());
    }
    Err(RdmaError::GpuDirect {
        reason: "the kernel has no GPU peer-memory support (load nvidia_peermem: `modprobe nvidia_peermem`)".into(),
    })
}

/// A device buffer registered with a NIC (feature `gpudirect`).
///
/// ```no_run
/// use nexar::{Buf, Cuda};
/// use nexar_rdma::GpuRegion;
/// let grads = Buf::<f32, Cuda>::zeros_on(0, 1 << 20)?;
/// let region = GpuRegion::register(grads, None).map_err(|refused| refused.error)?;
/// println!("rkey {:#x} at {:#x}", region.rkey(), region.span().address);
/// let grads = region.into_buf()?; // deregistered; the buffer is the caller's again
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GpuRegion<T: Element> {
    /// Always `Some` until `into_buf` takes it; leaked (never freed) if deregistering fails.
    buf: Option<Buf<T, Cuda>>,
    span: DeviceSpan,
    registration: DeviceRegistration,
}

impl<T: Element> fmt::Debug for GpuRegion<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuRegion").field("span", &self.span).field("rkey", &self.rkey()).finish()
    }
}

impl<T: Element> Drop for GpuRegion<T> {
    fn drop(&mut self) {
        if !self.registration.release()
            && let Some(buf) = self.buf.take()
        {
            // The NIC may still write this memory: it must never be freed or reused.
            std::mem::forget(buf);
        }
    }
}

/// A registration that did not happen: why, and the buffer, returned unchanged.
pub struct Refused<T: Element> {
    /// Why the buffer was not registered.
    pub error: RdmaError,
    /// The buffer, as it was passed in.
    pub buf: Buf<T, Cuda>,
}

impl<T: Element> fmt::Debug for Refused<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refused").field("error", &self.error).field("buf", &self.buf).finish()
    }
}

impl<T: Element> fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device buffer of {} elements not registered: {}", self.buf.len(), self.error)
    }
}

impl<T: Element> std::error::Error for Refused<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T: Element> GpuRegion<T> {
    /// Registers `buf` with `nic` (a device name such as `mlx5_0`, or the first NIC) for
    /// local writes and remote reads and writes. On failure the buffer comes back in
    /// [`Refused`] with the reason.
    pub fn register(buf: Buf<T, Cuda>, nic: Option<&str>) -> Result<GpuRegion<T>, Box<Refused<T>>> {
        let refuse = |error, buf| Box::new(Refused { error, buf });
        if buf.is_empty() {
            return Err(refuse(RdmaError::GpuDirect { reason: "an empty buffer cannot be registered".into() }, buf));
        }
        if let Err(error) = gpudirect_support() {
            return Err(refuse(error, buf));
        }
        let span = match buf.device_span() {
            Ok(span) => span,
            Err(e) => return Err(refuse(RdmaError::GpuDirect { reason: e.to_string() }, buf)),
        };
        match DeviceRegistration::register(nic, span.address, span.bytes) {
            Ok(registration) => Ok(GpuRegion { buf: Some(buf), span, registration }),
            Err(error) => Err(refuse(error, buf)),
        }
    }

    /// The registered device memory.
    pub fn span(&self) -> DeviceSpan {
        self.span
    }

    /// The local key, for work requests posted on this NIC.
    pub fn lkey(&self) -> u32 {
        self.registration.keys().0
    }

    /// The remote key, for peers writing into or reading from this memory.
    pub fn rkey(&self) -> u32 {
        self.registration.keys().1
    }

    /// Deregisters the memory and returns the buffer. If the NIC refuses to deregister, the
    /// buffer is leaked (never freed, since the NIC may still write it) and this is an error.
    pub fn into_buf(mut self) -> Result<Buf<T, Cuda>, RdmaError> {
        if !self.registration.release() {
            // Dropping `self` leaks the buffer.
            return Err(RdmaError::Verbs {
                call: "ibv_dereg_mr (device memory)",
                reason: "the NIC kept the registration, so the buffer is leaked".into(),
            });
        }
        self.buf.take().ok_or_else(|| RdmaError::GpuDirect { reason: "the buffer was already taken".into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_hardware_support_is_refused_with_the_reason() {
        match gpudirect_support() {
            Ok(()) => {}
            Err(RdmaError::NoDevice { reason }) => assert!(!reason.is_empty()),
            Err(RdmaError::GpuDirect { reason }) => {
                assert!(reason.contains("CUDA") || reason.contains("peer-memory"), "{reason}")
            }
            Err(e) => panic!("unexpected: {e}"),
        }
    }

    #[test]
    fn peer_memory_is_found_by_its_kernel_paths() {
        let err = peer_memory_in([Path::new("/nonexistent/nvidia_peermem")].into_iter()).unwrap_err();
        assert!(err.to_string().contains("modprobe nvidia_peermem"), "{err}");
        peer_memory_in([Path::new("/nonexistent"), Path::new("/proc/self")].into_iter()).unwrap();
    }
}
