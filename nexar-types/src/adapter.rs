//! How each memory space's elements reach host memory and go back: the [`DeviceAdapter`] of
//! the space. Operations work on host memory; an adapter moves a buffer's elements into a
//! host copy before and back after. [`CpuAdapter`] copies host memory; `CudaAdapter`
//! (feature `cuda`) stages through two pinned host buffers so that one chunk's DMA overlaps
//! the copy of the one before.

use crate::buf::{Buf, DeviceError};
use crate::element::Element;
use crate::space::{Host, MemorySpace};

/// Moves the elements of buffers in one memory space to and from host memory.
///
/// Both directions return once the copy is complete: nothing is written into `out` or the
/// buffer afterwards.
///
/// ```
/// use nexar_types::{Buf, CpuAdapter, DeviceAdapter};
/// let mut b = Buf::from_vec(vec![1u32, 2, 3]);
/// let mut out = [0u32; 3];
/// CpuAdapter.download(&b, &mut out).unwrap();
/// CpuAdapter.upload(&mut b, &[4, 5, 6]).unwrap();
/// assert_eq!((out, b.as_slice()), ([1, 2, 3], &[4, 5, 6][..]));
/// ```
pub trait DeviceAdapter: Send + Sync {
    /// The memory space this adapter serves.
    type Space: MemorySpace;

    /// A short name for messages ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// Copies every element of `buf` into `out` (which must be as long).
    fn download<T: Element>(&self, buf: &Buf<T, Self::Space>, out: &mut [T]) -> Result<(), DeviceError>;

    /// Overwrites every element of `buf` with `data` (which must be as long).
    fn upload<T: Element>(&self, buf: &mut Buf<T, Self::Space>, data: &[T]) -> Result<(), DeviceError>;
}

/// The adapter of host memory: plain copies.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuAdapter;

impl DeviceAdapter for CpuAdapter {
    type Space = Host;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn download<T: Element>(&self, buf: &Buf<T>, out: &mut [T]) -> Result<(), DeviceError> {
        same_length(self.name(), buf.len(), out.len())?;
        out.copy_from_slice(buf.as_slice());
        Ok(())
    }

    fn upload<T: Element>(&self, buf: &mut Buf<T>, data: &[T]) -> Result<(), DeviceError> {
        same_length(self.name(), buf.len(), data.len())?;
        buf.as_mut_slice().copy_from_slice(data);
        Ok(())
    }
}

/// The error for a host side that is not as long as the buffer.
pub(crate) fn same_length(adapter: &'static str, buffer: usize, host: usize) -> Result<(), DeviceError> {
    if buffer == host {
        return Ok(());
    }
    Err(DeviceError::LengthMismatch { adapter, buffer, host })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_adapter_copies_both_ways_and_refuses_other_lengths() {
        let mut b = Buf::from_vec((0..1000u64).collect());
        let mut out = vec![0u64; 1000];
        CpuAdapter.download(&b, &mut out).unwrap();
        assert_eq!(out, b.as_slice());
        let err = CpuAdapter.download(&b, &mut out[..999]).unwrap_err();
        assert_eq!(err, DeviceError::LengthMismatch { adapter: "cpu", buffer: 1000, host: 999 });
        assert!(CpuAdapter.upload(&mut b, &[1, 2]).unwrap_err().to_string().contains("2 host elements"));
        CpuAdapter.upload(&mut b, &vec![7; 1000]).unwrap();
        assert!(b.iter().all(|v| *v == 7));
    }
}
