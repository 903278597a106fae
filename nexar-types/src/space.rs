//! Memory spaces as types.

use std::fmt::Debug;

mod sealed {
    pub trait Sealed {}
}

/// Where a buffer's elements live.
///
/// The space is part of a buffer's type (`Buf<f32>` is `Buf<f32, Host>`), so a buffer in one
/// space cannot be passed where another is expected. Only [`Host`] exists today; device memory
/// spaces are added by the runtime's optional back ends.
///
/// ```
/// use nexar_types::{Host, MemorySpace};
/// assert_eq!(Host::NAME, "host");
/// ```
pub trait MemorySpace: sealed::Sealed + Copy + Debug + Default + Send + Sync + 'static {
    /// Lower-case name used in messages.
    const NAME: &'static str;
    /// What holds `T` elements in this space.
    type Storage<T: crate::Element>: Debug + Send + Sync;
}

/// Ordinary host (CPU) memory.
///
/// ```
/// use nexar_types::{Buf, Host};
/// let b: Buf<u8, Host> = Buf::zeros(4);
/// assert_eq!(b.as_slice(), &[0, 0, 0, 0]);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Host;

impl sealed::Sealed for Host {}
impl MemorySpace for Host {
    const NAME: &'static str = "host";
    type Storage<T: crate::Element> = Vec<T>;
}

/// NVIDIA GPU memory (feature `cuda`), on the device a buffer was made for.
///
/// ```no_run
/// use nexar_types::{Buf, Cuda};
/// let grads: Buf<f32, Cuda> = Buf::<f32, Cuda>::zeros_on(0, 1 << 20)?; // device 0
/// # Ok::<(), nexar_types::DeviceError>(())
/// ```
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cuda;

#[cfg(feature = "cuda")]
impl sealed::Sealed for Cuda {}
#[cfg(feature = "cuda")]
impl MemorySpace for Cuda {
    const NAME: &'static str = "cuda";
    type Storage<T: crate::Element> = crate::cuda::CudaStorage<T>;
}
