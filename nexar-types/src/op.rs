//! Reduction operations: marker types checked at compile time, a runtime enum, and the
//! element-wise kernels.

use std::fmt;

use crate::bf16_wire::{narrow as bf16_narrow, widen as bf16_widen};
use crate::element::{DType, Element};

/// A reduction chosen at run time.
///
/// The marker types ([`Sum`], [`BitAnd`], …) are checked by the compiler; `ReduceOp` is for
/// operations read from configuration or a command line. A bitwise `ReduceOp` on floating-point
/// elements is a runtime [`ReduceError`] instead of a compile error.
///
/// ```
/// use nexar_types::{ReduceOp, reduce_slice};
/// let mut acc = [1i32, 6, 3];
/// reduce_slice(ReduceOp::Max, &mut acc, &[4, 5, 2]).unwrap();
/// assert_eq!(acc, [4, 6, 3]);
/// assert!(reduce_slice(ReduceOp::BitXor, &mut [1.0f32], &[2.0]).is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Element-wise sum (wrapping for integers).
    Sum = 1,
    /// Element-wise product (wrapping for integers).
    Prod = 2,
    /// Element-wise minimum.
    Min = 3,
    /// Element-wise maximum.
    Max = 4,
    /// Bitwise and (integers only).
    BitAnd = 5,
    /// Bitwise or (integers only).
    BitOr = 6,
    /// Bitwise exclusive or (integers only).
    BitXor = 7,
}

impl ReduceOp {
    /// Every operation, in wire-code order.
    pub const ALL: [ReduceOp; 7] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
    ];

    /// The byte that represents this operation on the wire.
    pub const fn to_wire(self) -> u8 {
        self as u8
    }

    /// Decodes a wire byte; `None` for an unknown code.
    pub const fn from_wire(code: u8) -> Option<ReduceOp> {
        if code >= 1 && code <= 7 { Some(ReduceOp::ALL[(code - 1) as usize]) } else { None }
    }

    /// `true` for the operations that only integers accept.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor)
    }

    /// Whether this operation can reduce elements of `dtype`.
    pub const fn supports(self, dtype: DType) -> bool {
        !self.is_bitwise() || dtype.is_integer()
    }

    /// Lower-case name, as used in error messages and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::BitAnd => "bitand",
            ReduceOp::BitOr => "bitor",
            ReduceOp::BitXor => "bitxor",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a reduction could not run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReduceError {
    /// A bitwise operation was asked of floating-point elements.
    #[error("reduction {op} is not defined for {dtype} elements (bitwise operations take integers)")]
    Unsupported {
        /// The operation asked for.
        op: ReduceOp,
        /// The element type it was asked of.
        dtype: DType,
    },
    /// The two operands have different lengths.
    #[error("reduction operands differ in length: {left} and {right} elements")]
    LengthMismatch {
        /// Length of the accumulator.
        left: usize,
        /// Length of the incoming operand.
        right: usize,
    },
}

/// A reduction that applies to elements of type `T`.
///
/// The marker types implement it only where it makes sense, so `BitAnd` on `f32` does not
/// compile. [`ReduceOp`] implements it for every element type and is checked at run time.
///
/// ```
/// use nexar_types::{Reduction, ReduceOp, Sum, BitXor};
/// fn op_of<T: nexar_types::Element, O: Reduction<T>>(o: O) -> ReduceOp { o.op() }
/// assert_eq!(op_of::<f32, _>(Sum), ReduceOp::Sum);
/// assert_eq!(op_of::<u8, _>(BitXor), ReduceOp::BitXor);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot reduce `{T}` elements",
    label = "`{Self}` is not a reduction over `{T}`",
    note = "bitwise reductions (BitAnd, BitOr, BitXor) take integer elements only; Sum, Prod, Min and Max take every element type",
    note = "for an operation chosen at run time pass a `nexar::ReduceOp`, which is checked when the call runs"
)]
pub trait Reduction<T: Element>: Copy + Send + Sync + 'static {
    /// The runtime operation this reduction performs.
    fn op(&self) -> ReduceOp;
}

impl<T: Element> Reduction<T> for ReduceOp {
    fn op(&self) -> ReduceOp {
        *self
    }
}

macro_rules! marker_ops {
    ($($(#[$doc:meta])* $name:ident => $variant:ident,)*) => {
        $(
            $(#[$doc])*
            #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
            pub struct $name;

            impl From<$name> for ReduceOp {
                fn from(_: $name) -> ReduceOp {
                    ReduceOp::$variant
                }
            }
        )*
    };
}

marker_ops! {
    /// Element-wise sum; every element type (wrapping for integers).
    ///
    /// ```
    /// use nexar_types::{ReduceOp, Sum};
    /// assert_eq!(ReduceOp::from(Sum), ReduceOp::Sum);
    /// ```
    Sum => Sum,
    /// Element-wise product; every element type (wrapping for integers).
    ///
    /// ```
    /// use nexar_types::{ReduceOp, Prod};
    /// assert_eq!(ReduceOp::from(Prod), ReduceOp::Prod);
    /// ```
    Prod => Prod,
    /// Element-wise minimum; every element type.
    ///
    /// ```
    /// use nexar_types::{ReduceOp, Min};
    /// assert_eq!(ReduceOp::from(Min), ReduceOp::Min);
    /// ```
    Min => Min,
    /// Element-wise maximum; every element type.
    ///
    /// ```
    /// use nexar_types::{ReduceOp, Max};
    /// assert_eq!(ReduceOp::from(Max), ReduceOp::Max);
    /// ```
    Max => Max,
    /// Bitwise and; integer elements only.
    ///
    /// ```
    /// use nexar_types::{ReduceOp, BitAnd};
    /// assert_eq!(ReduceOp::from(BitAnd), ReduceOp::BitAnd);
    /// ```
    BitAnd => BitAnd,
    /// Bitwise or; integer elements only.
    ///
    /// ```
    /// use nexar_types::{ReduceOp, BitOr};
    /// assert_eq!(ReduceOp::from(BitOr), ReduceOp::BitOr);
    /// ```
    BitOr => BitOr,
    /// Bitwise exclusive or; integer elements only.
    ///
    /// ```
    /// use nexar_types::{ReduceOp, BitXor};
    /// assert_eq!(ReduceOp::from(BitXor), ReduceOp::BitXor);
    /// ```
    BitXor => BitXor,
}

macro_rules! impl_reduction {
    ($op:ident for $($t:ty),*) => {
        $(impl Reduction<$t> for $op {
            fn op(&self) -> ReduceOp {
                ReduceOp::$op
            }
        })*
    };
}

macro_rules! numeric_ops {
    ($($t:ty),*) => {
        impl_reduction!(Sum for $($t),*);
        impl_reduction!(Prod for $($t),*);
        impl_reduction!(Min for $($t),*);
        impl_reduction!(Max for $($t),*);
    };
}

numeric_ops!(f32, f64, half::f16, half::bf16, i8, i16, i32, i64, u8, u16, u32, u64);
impl_reduction!(BitAnd for i8, i16, i32, i64, u8, u16, u32, u64);
impl_reduction!(BitOr for i8, i16, i32, i64, u8, u16, u32, u64);
impl_reduction!(BitXor for i8, i16, i32, i64, u8, u16, u32, u64);

/// Combines `other` into `acc` with a reduction checked at compile time:
/// `acc[i] = op(acc[i], other[i])`.
///
/// `reduce(BitAnd, &mut floats, ..)` does not compile; with a runtime [`ReduceOp`] the check
/// happens when the call runs.
///
/// ```
/// use nexar_types::{BitXor, Sum, reduce};
/// let mut acc = [1u8, 2, 3];
/// reduce(BitXor, &mut acc, &[1, 1, 1]).unwrap();
/// assert_eq!(acc, [0, 3, 2]);
/// let mut f = [0.5f32];
/// reduce(Sum, &mut f, &[0.25]).unwrap();
/// assert_eq!(f, [0.75]);
/// ```
pub fn reduce<T: Element, O: Reduction<T>>(op: O, acc: &mut [T], other: &[T]) -> Result<(), ReduceError> {
    reduce_slice(op.op(), acc, other)
}

/// Combines `other` into `acc` element by element: `acc[i] = op(acc[i], other[i])`.
///
/// The loops are written so the compiler vectorises them; `f16` and `bf16` are widened to `f32`
/// in blocks, reduced, and narrowed back.
///
/// ```
/// use nexar_types::{ReduceOp, reduce_slice, f16};
/// let mut acc = [f16::from_f32(1.5); 3];
/// reduce_slice(ReduceOp::Sum, &mut acc, &[f16::from_f32(2.0); 3]).unwrap();
/// assert_eq!(acc[2].to_f32(), 3.5);
/// ```
pub fn reduce_slice<T: Element>(op: ReduceOp, acc: &mut [T], other: &[T]) -> Result<(), ReduceError> {
    if acc.len() != other.len() {
        return Err(ReduceError::LengthMismatch { left: acc.len(), right: other.len() });
    }
    if !op.supports(T::DTYPE) {
        return Err(ReduceError::Unsupported { op, dtype: T::DTYPE });
    }
    crate::simd::widest(Reduce { op, acc, other });
    Ok(())
}

/// [`reduce_slice`]'s loop, for [`crate::simd::widest`].
struct Reduce<'a, T> {
    op: ReduceOp,
    acc: &'a mut [T],
    other: &'a [T],
}

impl<T: Kernels> crate::simd::Kernel for Reduce<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        T::reduce_unchecked(self.op, self.acc, self.other);
    }
}

/// The per-type kernels behind [`reduce_slice`]; `op` has already been checked.
pub trait Kernels: Sized {
    /// `acc[i] = op(acc[i], other[i])` for an `op` already checked against the type.
    fn reduce_unchecked(op: ReduceOp, acc: &mut [Self], other: &[Self]);
}

#[inline(always)]
fn zip_apply<T: Copy>(acc: &mut [T], other: &[T], f: impl Fn(T, T) -> T) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a = f(*a, *b);
    }
}

macro_rules! int_kernels {
    ($($t:ty),*) => {$(
        impl Kernels for $t {
            #[inline(always)]
            fn reduce_unchecked(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                match op {
                    ReduceOp::Sum => zip_apply(acc, other, <$t>::wrapping_add),
                    ReduceOp::Prod => zip_apply(acc, other, <$t>::wrapping_mul),
                    ReduceOp::Min => zip_apply(acc, other, |a, b| if b < a { b } else { a }),
                    ReduceOp::Max => zip_apply(acc, other, |a, b| if b > a { b } else { a }),
                    ReduceOp::BitAnd => zip_apply(acc, other, |a, b| a & b),
                    ReduceOp::BitOr => zip_apply(acc, other, |a, b| a | b),
                    ReduceOp::BitXor => zip_apply(acc, other, |a, b| a ^ b),
                }
            }
        }
    )*};
}

int_kernels!(i8, i16, i32, i64, u8, u16, u32, u64);

macro_rules! float_kernels {
    ($($t:ty),*) => {$(
        impl Kernels for $t {
            #[inline(always)]
            fn reduce_unchecked(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                match op {
                    ReduceOp::Sum => zip_apply(acc, other, |a, b| a + b),
                    ReduceOp::Prod => zip_apply(acc, other, |a, b| a * b),
                    ReduceOp::Min => zip_apply(acc, other, |a, b| if b < a { b } else { a }),
                    ReduceOp::Max => zip_apply(acc, other, |a, b| if b > a { b } else { a }),
                    // Rejected by `reduce_slice` before we get here.
                    ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {}
                }
            }
        }
    )*};
}

float_kernels!(f32, f64);

const HALF_BLOCK: usize = 512;

macro_rules! half_kernels {
    ($($t:ty),*) => {$(
        impl Kernels for $t {
            #[inline(always)]
            fn reduce_unchecked(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                use half::slice::HalfFloatSliceExt;
                let mut wide_acc = [0f32; HALF_BLOCK];
                let mut wide_other = [0f32; HALF_BLOCK];
                for (a, b) in acc.chunks_mut(HALF_BLOCK).zip(other.chunks(HALF_BLOCK)) {
                    let n = a.len();
                    a.convert_to_f32_slice(&mut wide_acc[..n]);
                    b.convert_to_f32_slice(&mut wide_other[..n]);
                    f32::reduce_unchecked(op, &mut wide_acc[..n], &wide_other[..n]);
                    a.convert_from_f32_slice(&wide_acc[..n]);
                }
            }
        }
    )*};
}

half_kernels!(half::f16);

impl Kernels for half::bf16 {
    #[inline(always)]
    fn reduce_unchecked(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
        let through_f32 = |f: fn(f32, f32) -> f32| move |a, b| bf16_narrow(f(bf16_widen(a), bf16_widen(b)));
        match op {
            ReduceOp::Sum => zip_apply(acc, other, through_f32(|a, b| a + b)),
            ReduceOp::Prod => zip_apply(acc, other, through_f32(|a, b| a * b)),
            ReduceOp::Min => zip_apply(acc, other, through_f32(|a, b| if b < a { b } else { a })),
            ReduceOp::Max => zip_apply(acc, other, through_f32(|a, b| if b > a { b } else { a })),
            // Rejected by `reduce_slice` before we get here.
            ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn integer_ops_match_scalar_definitions() {
        let a = [1i32, -5, 7, i32::MAX];
        let b = [3i32, 2, -9, 1];
        let expect = |f: fn(i32, i32) -> i32| a.iter().zip(&b).map(|(x, y)| f(*x, *y)).collect::<Vec<_>>();
        for (op, f) in [
            (ReduceOp::Sum, i32::wrapping_add as fn(i32, i32) -> i32),
            (ReduceOp::Prod, i32::wrapping_mul),
            (ReduceOp::Min, std::cmp::min),
            (ReduceOp::Max, std::cmp::max),
            (ReduceOp::BitAnd, |x, y| x & y),
            (ReduceOp::BitOr, |x, y| x | y),
            (ReduceOp::BitXor, |x, y| x ^ y),
        ] {
            let mut acc = a;
            reduce_slice(op, &mut acc, &b).unwrap();
            assert_eq!(acc.to_vec(), expect(f), "{op}");
        }
    }

    #[test]
    fn half_types_reduce_through_f32_across_block_edges() {
        let n = HALF_BLOCK * 2 + 3;
        let mut acc: Vec<f16> = (0..n).map(|i| f16::from_f32((i % 100) as f32)).collect();
        let other: Vec<f16> = vec![f16::from_f32(0.5); n];
        reduce_slice(ReduceOp::Sum, &mut acc, &other).unwrap();
        for (i, v) in acc.iter().enumerate() {
            assert_eq!(v.to_f32(), (i % 100) as f32 + 0.5);
        }
        let mut acc = vec![bf16::from_f32(3.0); 7];
        reduce_slice(ReduceOp::Max, &mut acc, &[bf16::from_f32(4.0); 7]).unwrap();
        assert!(acc.iter().all(|v| v.to_f32() == 4.0));
    }

    #[test]
    fn bf16_kernels_round_as_half_does() {
        // Every bf16 widens exactly and narrows back to itself (NaNs to a quiet NaN).
        for bits in 0..=u16::MAX {
            let h = bf16::from_bits(bits);
            if h.is_nan() {
                assert!(bf16_widen(h).is_nan(), "{bits:#x}");
            } else {
                assert_eq!(bf16_widen(h).to_bits(), h.to_f32().to_bits(), "{bits:#x}");
            }
            assert_eq!(bf16_narrow(bf16_widen(h)).to_bits(), bf16::from_f32(h.to_f32()).to_bits(), "{bits:#x}");
        }
        // f32 values across the whole range, ties and their neighbours included.
        let mut x = 0x9E37_79B9u32;
        for i in 0..4_000_000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let bits = match i % 4 {
                0 => x,
                1 => (x & 0xFFFF_0000) | 0x8000,
                2 => (x & 0xFFFF_0000) | 0x7FFF,
                _ => (x & 0xFFFF_0000) | 0x8001,
            };
            let f = f32::from_bits(bits);
            assert_eq!(bf16_narrow(f).to_bits(), bf16::from_f32(f).to_bits(), "{bits:#x}");
        }
        // The kernels agree with reducing one element at a time through `half`.
        let a: Vec<bf16> = (0..1000).map(|i| bf16::from_f32((i as f32 * 0.37).sin() * 3e3)).collect();
        let b: Vec<bf16> = (0..1000).map(|i| bf16::from_f32((i as f32 * 0.11).cos() * 7e2)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            let mut acc = a.clone();
            reduce_slice(op, &mut acc, &b).unwrap();
            for i in 0..a.len() {
                let mut one = [a[i].to_f32()];
                reduce_slice(op, &mut one, &[b[i].to_f32()]).unwrap();
                assert_eq!(acc[i].to_bits(), bf16::from_f32(one[0]).to_bits(), "{op} at {i}");
            }
        }
    }

    #[test]
    fn misuse_is_an_error_not_a_panic() {
        assert_eq!(
            reduce_slice(ReduceOp::BitAnd, &mut [1.0f64], &[2.0]),
            Err(ReduceError::Unsupported { op: ReduceOp::BitAnd, dtype: DType::F64 })
        );
        assert_eq!(
            reduce_slice(ReduceOp::Sum, &mut [1u8, 2], &[2]),
            Err(ReduceError::LengthMismatch { left: 2, right: 1 })
        );
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_wire(op.to_wire()), Some(op));
        }
        assert_eq!(ReduceOp::from_wire(0), None);
        assert_eq!(ReduceOp::from_wire(8), None);
    }
}
