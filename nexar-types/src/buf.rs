//! Typed owned buffers and the traits through which every buffer-like value reaches an operation.

use std::fmt;
use std::ops::{Deref, DerefMut};

use crate::element::Element;
use crate::segments::{SegmentStage, WholeStage};
use crate::space::{Host, MemorySpace};

/// An owned, typed buffer of `T` elements in memory space `M` (host memory by default).
///
/// Operations that keep a buffer beyond one call (non-blocking collectives, zero-copy paths) take
/// a `Buf` by value and hand it back, so no background task ever holds a borrow of user memory.
///
/// ```
/// use nexar_types::Buf;
/// let mut b = Buf::from_vec(vec![1.0f32, 2.0]);
/// b[1] = 5.0;
/// assert_eq!(b.as_slice(), &[1.0, 5.0]);
/// assert_eq!(b.into_vec(), vec![1.0, 5.0]);
/// ```
pub struct Buf<T: Element, M: MemorySpace = Host> {
    pub(crate) storage: M::Storage<T>,
}

impl<T: Element> Buf<T, Host> {
    /// Wraps a vector without copying.
    pub fn from_vec(data: Vec<T>) -> Self {
        Buf { storage: data }
    }

    /// A buffer of `len` zero elements.
    pub fn zeros(len: usize) -> Self {
        Buf { storage: vec![T::zeroed(); len] }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.storage.len()
    }

    /// `true` when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.storage.is_empty()
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> usize {
        std::mem::size_of_val(self.storage.as_slice())
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        &self.storage
    }

    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.storage
    }

    /// Gives the vector back without copying.
    pub fn into_vec(self) -> Vec<T> {
        self.storage
    }
}

impl<T: Element> Deref for Buf<T, Host> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.storage
    }
}

impl<T: Element> DerefMut for Buf<T, Host> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.storage
    }
}

impl<T: Element> From<Vec<T>> for Buf<T, Host> {
    fn from(data: Vec<T>) -> Self {
        Buf::from_vec(data)
    }
}

impl<T: Element> Clone for Buf<T, Host> {
    fn clone(&self) -> Self {
        Buf { storage: self.storage.clone() }
    }
}

impl<T: Element> PartialEq for Buf<T, Host> {
    fn eq(&self, other: &Self) -> bool {
        self.storage == other.storage
    }
}

impl<T: Element, M: MemorySpace> fmt::Debug for Buf<T, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buf")
            .field("dtype", &T::DTYPE)
            .field("space", &M::NAME)
            .field("storage", &self.storage)
            .finish()
    }
}

/// Failures of device memory: no driver, no such device, or a driver call that failed.
///
/// ```
/// let e = nexar_types::DeviceError::Unavailable { reason: "no CUDA driver (libcuda) on this host".into() };
/// assert!(e.to_string().contains("libcuda"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// Device memory cannot be used on this host or in this build.
    #[error("device memory is unavailable: {reason}")]
    Unavailable {
        /// Why, in words (no driver, feature not built, ...).
        reason: String,
    },
    /// The device index does not exist.
    #[error("device {index} does not exist (this host has {count})")]
    NoDevice {
        /// The index asked for.
        index: usize,
        /// Devices present.
        count: usize,
    },
    /// The host side of a copy is not as long as the buffer.
    #[error("{adapter} adapter: a buffer of {buffer} elements and {host} host elements")]
    LengthMismatch {
        /// The adapter asked to copy.
        adapter: &'static str,
        /// Elements in the buffer.
        buffer: usize,
        /// Elements on the host side.
        host: usize,
    },
    /// A driver call failed.
    #[error("{op} failed on device {device}: {reason}")]
    Driver {
        /// What was attempted.
        op: &'static str,
        /// The device.
        device: usize,
        /// What the driver said.
        reason: String,
    },
    /// A reduction of device buffers was refused: an operation the element type does not
    /// take, or operands of different lengths.
    #[error(transparent)]
    Reduce(#[from] crate::op::ReduceError),
    /// Two device buffers of one operation live on different devices.
    #[error(
        "the accumulator is on device {acc} and the other operand on device {other}; copy one to the other's device"
    )]
    CrossDevice {
        /// Device of the buffer reduced into.
        acc: usize,
        /// Device of the other operand.
        other: usize,
    },
    /// A GPU kernel did not compile.
    #[error("kernel {kernel} did not compile: {log}")]
    Compile {
        /// The kernel's name.
        kernel: String,
        /// What the compiler said.
        log: String,
    },
    /// A [`SegmentStage`](crate::SegmentStage) was used against its protocol (a bug in the
    /// operation driving it, reported instead of copying the wrong memory).
    #[error("segment stage used out of order: {what}")]
    StageOrder {
        /// What was asked.
        what: String,
    },
}

/// A buffer's elements as host memory, for reading: borrowed from host buffers, copied out of
/// device buffers.
///
/// ```
/// use nexar_types::SendBuf;
/// let v = vec![1u8, 2];
/// assert_eq!(&v.host_view().unwrap()[..], &[1, 2]);
/// ```
#[derive(Debug)]
pub enum HostView<'a, T> {
    /// Host memory, borrowed.
    Borrowed(&'a [T]),
    /// A host copy of device memory.
    Copied(Vec<T>),
}

impl<T> Deref for HostView<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            HostView::Borrowed(s) => s,
            HostView::Copied(v) => v,
        }
    }
}

/// Where a staged copy of device memory goes back to.
pub trait WriteBack<T>: Send {
    /// Copies `host` into the device memory, returning once the copy is complete.
    fn write_back(&mut self, host: &[T]) -> Result<(), DeviceError>;
}

enum Stage<'a, T> {
    Borrowed(&'a mut [T]),
    Copied { host: Vec<T>, target: &'a mut dyn WriteBack<T> },
}

/// A buffer's elements as host memory, for writing: borrowed from host buffers; for device
/// buffers, a host copy that [`commit`](Self::commit) writes back. An operation that fails
/// never commits, so device memory is only ever written by a complete, successful operation
/// and never after the operation has returned.
///
/// ```
/// use nexar_types::RecvBuf;
/// let mut v = vec![0i8; 2];
/// let mut stage = v.host_stage().unwrap();
/// stage.fill(3);
/// stage.commit().unwrap();
/// assert_eq!(v, [3, 3]);
/// ```
pub struct HostStage<'a, T> {
    stage: Stage<'a, T>,
}

impl<'a, T> HostStage<'a, T> {
    /// Host memory, borrowed: written in place.
    pub fn borrowed(data: &'a mut [T]) -> Self {
        HostStage { stage: Stage::Borrowed(data) }
    }

    /// A host copy of device memory, written back to `target` on commit.
    pub fn copied(host: Vec<T>, target: &'a mut dyn WriteBack<T>) -> Self {
        HostStage { stage: Stage::Copied { host, target } }
    }

    /// Makes the result visible in the buffer (a no-op for host buffers).
    pub fn commit(self) -> Result<(), DeviceError> {
        match self.stage {
            Stage::Borrowed(_) => Ok(()),
            Stage::Copied { host, target } => target.write_back(&host),
        }
    }
}

impl<T> Deref for HostStage<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.stage {
            Stage::Borrowed(s) => s,
            Stage::Copied { host, .. } => host,
        }
    }
}

impl<T> DerefMut for HostStage<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.stage {
            Stage::Borrowed(s) => s,
            Stage::Copied { host, .. } => host,
        }
    }
}

impl<T> fmt::Debug for HostStage<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.stage {
            Stage::Borrowed(_) => "borrowed",
            Stage::Copied { .. } => "copied",
        };
        f.debug_struct("HostStage").field("kind", &kind).field("len", &self.len()).finish()
    }
}

/// A value whose elements an operation can read: `Buf<T>` (host or device), `Vec<T>`, `[T]`
/// and `[T; N]`.
///
/// ```
/// use nexar_types::{Buf, SendBuf};
/// fn total<B: SendBuf<Elem = u32> + ?Sized>(b: &B) -> u32 { b.host_view().unwrap().iter().sum() }
/// assert_eq!(total(&vec![1, 2]), 3);
/// assert_eq!(total(&[4u32, 5][..]), 9);
/// assert_eq!(total(&Buf::from_vec(vec![7u32])), 7);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a buffer of nexar elements",
    label = "nexar cannot read elements from this value",
    note = "pass a `Buf<T>`, `Vec<T>`, `[T]` or `[T; N]` where `T` is one of f32, f64, f16, bf16, i8..i64, u8..u64"
)]
pub trait SendBuf {
    /// The element type.
    type Elem: Element;
    /// Number of elements, without touching them.
    fn elems(&self) -> usize;
    /// The elements as host memory (a copy for device buffers).
    fn host_view(&self) -> Result<HostView<'_, Self::Elem>, DeviceError>;

    /// The elements as the read side of an NCCL collective (feature `nccl`): `Some` only for
    /// a `Buf<T, Cuda>` whose element type NCCL has. Host memory answers `None` and is staged.
    #[cfg(feature = "nccl")]
    fn nccl_source(&self) -> Option<crate::nccl_buffers::NcclSource<'_, Self::Elem>> {
        None
    }
}

/// A value whose elements an operation can overwrite: `Buf<T>` (host or device), `Vec<T>`,
/// `[T]` and `[T; N]`.
///
/// ```
/// use nexar_types::RecvBuf;
/// fn fill<B: RecvBuf<Elem = i8> + ?Sized>(b: &mut B) {
///     let mut stage = b.host_stage().unwrap();
///     stage.fill(3);
///     stage.commit().unwrap();
/// }
/// let mut v = vec![0i8; 2];
/// fill(&mut v);
/// assert_eq!(v, [3, 3]);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a mutable buffer of nexar elements",
    label = "nexar cannot write elements into this value",
    note = "pass `&mut` to a `Buf<T>`, `Vec<T>`, `[T]` or `[T; N]` where `T` is one of f32, f64, f16, bf16, i8..i64, u8..u64"
)]
pub trait RecvBuf: SendBuf {
    /// The elements as host memory for writing, committed back by the operation on success.
    fn host_stage(&mut self) -> Result<HostStage<'_, Self::Elem>, DeviceError>;

    /// The elements for an operation that works on segments of at most `segment` elements at
    /// a time (see [`SegmentStage`]). Host memory is worked on in place; device buffers
    /// stage each segment through pinned host memory while the others are copied. The
    /// default stages the whole buffer once through [`host_stage`](Self::host_stage).
    fn segment_stage(&mut self, segment: usize) -> Result<Box<dyn SegmentStage<Self::Elem> + Send + '_>, DeviceError> {
        let _ = segment;
        Ok(Box::new(WholeStage::new(self.host_stage()?)))
    }

    /// The elements as an operand of an NCCL collective (feature `nccl`): `Some` only for a
    /// `Buf<T, Cuda>` whose element type NCCL has. Host memory answers `None` and is staged.
    #[cfg(feature = "nccl")]
    fn nccl_operand(&mut self) -> Option<crate::nccl_buffers::NcclOperand<'_, Self::Elem>> {
        None
    }
}

macro_rules! host_buffers {
    ($($(#[$m:meta])* [$($g:tt)*] $ty:ty;)*) => {$(
        impl<$($g)*> SendBuf for $ty {
            type Elem = T;
            fn elems(&self) -> usize {
                self[..].len()
            }
            fn host_view(&self) -> Result<HostView<'_, T>, DeviceError> {
                Ok(HostView::Borrowed(&self[..]))
            }
        }
        impl<$($g)*> RecvBuf for $ty {
            fn host_stage(&mut self) -> Result<HostStage<'_, T>, DeviceError> {
                Ok(HostStage::borrowed(&mut self[..]))
            }
        }
    )*};
}

host_buffers! {
    [T: Element] [T];
    [T: Element, const N: usize] [T; N];
    [T: Element] Vec<T>;
    [T: Element] Buf<T, Host>;
}
