//! Typed owned buffers and the traits through which every buffer-like value reaches an operation.

use std::fmt;
use std::ops::{Deref, DerefMut};

use crate::element::Element;
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
    storage: M::Storage<T>,
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

/// A value whose elements an operation can read: `Buf<T>`, `Vec<T>`, `[T]` and `[T; N]`.
///
/// ```
/// use nexar_types::{Buf, SendBuf};
/// fn total<B: SendBuf<Elem = u32> + ?Sized>(b: &B) -> u32 { b.elements().iter().sum() }
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
    /// The elements, in host memory.
    fn elements(&self) -> &[Self::Elem];
}

/// A value whose elements an operation can overwrite: `Buf<T>`, `Vec<T>`, `[T]` and `[T; N]`.
///
/// ```
/// use nexar_types::RecvBuf;
/// fn fill<B: RecvBuf<Elem = i8> + ?Sized>(b: &mut B) { b.elements_mut().fill(3) }
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
    /// The elements, in host memory, for writing.
    fn elements_mut(&mut self) -> &mut [Self::Elem];
}

impl<T: Element> SendBuf for [T] {
    type Elem = T;
    fn elements(&self) -> &[T] {
        self
    }
}
impl<T: Element> RecvBuf for [T] {
    fn elements_mut(&mut self) -> &mut [T] {
        self
    }
}
impl<T: Element, const N: usize> SendBuf for [T; N] {
    type Elem = T;
    fn elements(&self) -> &[T] {
        self
    }
}
impl<T: Element, const N: usize> RecvBuf for [T; N] {
    fn elements_mut(&mut self) -> &mut [T] {
        self
    }
}
impl<T: Element> SendBuf for Vec<T> {
    type Elem = T;
    fn elements(&self) -> &[T] {
        self
    }
}
impl<T: Element> RecvBuf for Vec<T> {
    fn elements_mut(&mut self) -> &mut [T] {
        self
    }
}
impl<T: Element> SendBuf for Buf<T, Host> {
    type Elem = T;
    fn elements(&self) -> &[T] {
        &self.storage
    }
}
impl<T: Element> RecvBuf for Buf<T, Host> {
    fn elements_mut(&mut self) -> &mut [T] {
        &mut self.storage
    }
}
