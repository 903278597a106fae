//! `f32` data carried as bf16: the conversions and reductions of a compressed allreduce that
//! keeps its buffer in `f32` and rounds to bf16 only what it sends or combines.
//!
//! Every operand is rounded to bf16 as it is read and every result is rounded before it is
//! stored (as the `f32` of a bf16, so rounding it again changes nothing). A reduction through
//! these kernels therefore gives the bits a reduction of bf16 buffers would give, whether an
//! operand is a rank's own unrounded input or a partial result already rounded. Every loop is
//! branch-free so that it vectorises, and runs with the widest vector instructions the CPU has
//! ([`widest`]): rounding takes about ten vector operations per element.

use half::bf16;

use crate::element::DType;
use crate::op::{ReduceError, ReduceOp};
use crate::simd::{Kernel, widest};

/// `bf16` → `f32`, exactly: a bf16's bits are the upper half of the f32's (a NaN stays a NaN,
/// not quieted here; [`narrow`] quiets it).
#[inline(always)]
pub(crate) fn widen(h: bf16) -> f32 {
    f32::from_bits(u32::from(h.to_bits()) << 16)
}

/// `f32` → `bf16`, rounding to nearest, ties to even, as [`half::bf16::from_f32`] does (a NaN
/// stays a NaN, quieted; infinities stay infinite). Written without branches, so that the
/// loops over it vectorise: twice as fast as `half`'s slice conversions, which round one
/// element at a time.
#[inline(always)]
pub(crate) fn narrow(x: f32) -> bf16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((bits >> 16) | 0x0040) as u16;
    bf16::from_bits(if bits & 0x7FFF_FFFF > 0x7F80_0000 { quiet_nan } else { rounded })
}

/// `x` rounded to the nearest bf16, as an `f32`.
#[inline(always)]
fn round(x: f32) -> f32 {
    widen(narrow(x))
}

/// Rounds each of `from` to the nearest bf16 (ties to even, as [`bf16::from_f32`]) into `to`,
/// which is as long or longer.
///
/// ```
/// use nexar_types::{bf16, narrow_to_bf16};
/// let mut wire = [bf16::ZERO; 2];
/// narrow_to_bf16(&[1.0, 1.0 + 1.0 / 1024.0], &mut wire);
/// assert_eq!(wire, [bf16::ONE, bf16::ONE]);
/// ```
pub fn narrow_to_bf16(from: &[f32], to: &mut [bf16]) {
    widest(Convert { from, to, each: narrow_at });
}

/// `to[i] = each(&from[i])`, for [`widest`].
struct Convert<'a, A, B, F> {
    from: &'a [A],
    to: &'a mut [B],
    each: F,
}

impl<A, B, F: Fn(&A) -> B> Kernel for Convert<'_, A, B, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for (t, f) in self.to.iter_mut().zip(self.from) {
            *t = (self.each)(f);
        }
    }
}

#[inline(always)]
fn narrow_at(x: &f32) -> bf16 {
    narrow(*x)
}

/// Widens each of `from` into `to` (exactly: every bf16 is an `f32`).
///
/// ```
/// use nexar_types::{bf16, widen_bf16};
/// let mut wide = [0f32; 1];
/// widen_bf16(&[bf16::from_f32(2.5)], &mut wide);
/// assert_eq!(wide, [2.5]);
/// ```
pub fn widen_bf16(from: &[bf16], to: &mut [f32]) {
    widest(Convert { from, to, each: widen_at });
}

/// `acc[i] = round(op(round(acc[i]), other[i]))`, with `round` to the nearest bf16: the
/// combination of a received bf16 operand with an `f32` accumulator, computed in `f32` and
/// rounded once. `op` is `Sum`, `Prod`, `Min` or `Max`.
///
/// ```
/// use nexar_types::{ReduceOp, bf16, reduce_f32_with_bf16};
/// let mut acc = [1.0f32, 256.0];
/// reduce_f32_with_bf16(ReduceOp::Sum, &mut acc, &[bf16::from_f32(0.5), bf16::ONE]).unwrap();
/// assert_eq!(acc, [1.5, 256.0]); // 257 is not a bf16: it rounds to 256 (ties to even)
/// ```
pub fn reduce_f32_with_bf16(op: ReduceOp, acc: &mut [f32], other: &[bf16]) -> Result<(), ReduceError> {
    check(op, acc.len(), other.len())?;
    widest(Combine { op, acc, other, operand: widen_at });
    Ok(())
}

/// `acc[i] = round(op(round(acc[i]), round(other[i])))`: two `f32` operands combined as their
/// bf16 roundings would be, for a reduction between two of a rank's own buffers.
///
/// ```
/// use nexar_types::{ReduceOp, reduce_f32_as_bf16};
/// let mut acc = [3.0f32];
/// reduce_f32_as_bf16(ReduceOp::Max, &mut acc, &[3.005]).unwrap();
/// assert_eq!(acc, [3.0]); // 3.005 rounds to 3.0 in bf16
/// ```
pub fn reduce_f32_as_bf16(op: ReduceOp, acc: &mut [f32], other: &[f32]) -> Result<(), ReduceError> {
    check(op, acc.len(), other.len())?;
    widest(Combine { op, acc, other, operand: round_at });
    Ok(())
}

fn check(op: ReduceOp, left: usize, right: usize) -> Result<(), ReduceError> {
    if left != right {
        return Err(ReduceError::LengthMismatch { left, right });
    }
    if !op.supports(DType::BF16) {
        return Err(ReduceError::Unsupported { op, dtype: DType::BF16 });
    }
    Ok(())
}

/// `acc[i] = round(op(round(acc[i]), operand(other[i])))`, for [`widest`].
struct Combine<'a, B, F> {
    op: ReduceOp,
    acc: &'a mut [f32],
    other: &'a [B],
    operand: F,
}

impl<B, F: Fn(&B) -> f32 + Copy> Kernel for Combine<'_, B, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        apply(self.op, self.acc, self.other, self.operand);
    }
}

#[inline(always)]
fn widen_at(h: &bf16) -> f32 {
    widen(*h)
}

#[inline(always)]
fn round_at(x: &f32) -> f32 {
    round(*x)
}

#[inline(always)]
fn apply<B>(op: ReduceOp, acc: &mut [f32], other: &[B], operand: impl Fn(&B) -> f32 + Copy) {
    match op {
        ReduceOp::Sum => each(acc, other, operand, |a, b| a + b),
        ReduceOp::Prod => each(acc, other, operand, |a, b| a * b),
        ReduceOp::Min => each(acc, other, operand, |a, b| if b < a { b } else { a }),
        ReduceOp::Max => each(acc, other, operand, |a, b| if b > a { b } else { a }),
        // Refused by `check`.
        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {}
    }
}

/// One loop per operation, every function in it inlined (a function pointer here kept the
/// loop scalar: five times slower).
#[inline(always)]
fn each<B>(acc: &mut [f32], other: &[B], operand: impl Fn(&B) -> f32, f: impl Fn(f32, f32) -> f32) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a = round(f(round(*a), operand(b)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce_slice;

    fn sample(n: usize, scale: f32, phase: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 * phase).sin() * scale) + (i % 7) as f32 * 1e-3).collect()
    }

    #[test]
    fn conversions_round_as_half_does() {
        let xs = sample(5000, 3e4, 0.37);
        let mut wire = vec![bf16::ZERO; xs.len()];
        narrow_to_bf16(&xs, &mut wire);
        let mut back = vec![0f32; xs.len()];
        widen_bf16(&wire, &mut back);
        for (i, x) in xs.iter().enumerate() {
            assert_eq!(wire[i].to_bits(), bf16::from_f32(*x).to_bits(), "{x}");
            assert_eq!(back[i], bf16::from_f32(*x).to_f32(), "{x}");
        }
    }

    /// Combining in `f32` with rounding on every read and write gives the bits of combining
    /// the bf16 roundings with bf16's own kernels, for raw and already rounded accumulators.
    #[test]
    fn reductions_match_a_reduction_of_bf16_buffers() {
        let (a, b) = (sample(3000, 2e3, 0.37), sample(3000, 7e2, 0.11));
        let to_bf16 = |v: &[f32]| v.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>();
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            let mut expect = to_bf16(&a);
            reduce_slice(op, &mut expect, &to_bf16(&b)).unwrap();
            let mut with_wire = a.clone();
            reduce_f32_with_bf16(op, &mut with_wire, &to_bf16(&b)).unwrap();
            let mut both_f32 = a.clone();
            reduce_f32_as_bf16(op, &mut both_f32, &b).unwrap();
            for i in 0..a.len() {
                assert_eq!(with_wire[i].to_bits(), expect[i].to_f32().to_bits(), "{op} at {i}");
                assert_eq!(both_f32[i].to_bits(), expect[i].to_f32().to_bits(), "{op} at {i}");
            }
            // Rounding is idempotent: a rounded accumulator combined again gives the same.
            let mut again = with_wire.clone();
            reduce_f32_with_bf16(op, &mut again, &to_bf16(&b)).unwrap();
            let mut twice = expect.clone();
            reduce_slice(op, &mut twice, &to_bf16(&b)).unwrap();
            for i in 0..a.len() {
                assert_eq!(again[i].to_bits(), twice[i].to_f32().to_bits(), "{op} again at {i}");
            }
        }
    }

    #[test]
    fn misuse_is_an_error() {
        assert_eq!(
            reduce_f32_with_bf16(ReduceOp::Sum, &mut [1.0, 2.0], &[bf16::ONE]),
            Err(ReduceError::LengthMismatch { left: 2, right: 1 })
        );
        assert_eq!(
            reduce_f32_as_bf16(ReduceOp::BitOr, &mut [1.0], &[1.0]),
            Err(ReduceError::Unsupported { op: ReduceOp::BitOr, dtype: DType::BF16 })
        );
    }
}
