//! A bucket's memory: one flat vector of one of the element types gradients come in.

use nexar_types::{DType, Element, bf16, f16};

/// The element types whose gradients the data-parallel layer averages: `f32`, `f64`, `f16`
/// and `bf16`. Sealed: the buckets know exactly these.
pub trait GradElement: Element + sealed::Sealed {
    #[doc(hidden)]
    fn view(flat: &Flat) -> Option<&[Self]>;
    #[doc(hidden)]
    fn view_mut(flat: &mut Flat) -> Option<&mut [Self]>;
}

mod sealed {
    pub trait Sealed {}
}

/// A bucket's elements.
#[doc(hidden)]
#[derive(Debug)]
pub enum Flat {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

macro_rules! grad_elements {
    ($($t:ty => $v:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl GradElement for $t {
            fn view(flat: &Flat) -> Option<&[Self]> {
                match flat {
                    Flat::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn view_mut(flat: &mut Flat) -> Option<&mut [Self]> {
                match flat {
                    Flat::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    )*};
}

grad_elements!(f32 => F32, f64 => F64, f16 => F16, bf16 => Bf16);

impl Flat {
    /// `elems` zeros of `dtype`, or `None` for a type gradients do not come in.
    pub(super) fn zeros(dtype: DType, elems: usize) -> Option<Flat> {
        Some(match dtype {
            DType::F32 => Flat::F32(vec![0.0; elems]),
            DType::F64 => Flat::F64(vec![0.0; elems]),
            DType::F16 => Flat::F16(vec![f16::ZERO; elems]),
            DType::BF16 => Flat::Bf16(vec![bf16::ZERO; elems]),
            _ => return None,
        })
    }

    /// Copies (`add == false`) or adds `src` into `range` of the bucket, converting nothing:
    /// the caller checked the element type.
    pub(super) fn put<T: GradElement>(&mut self, at: usize, src: &[T], add: bool) {
        let Some(dst) = T::view_mut(self) else { return };
        let dst = &mut dst[at..at + src.len()];
        if add {
            // `reduce_slice`'s Sum: the same kernel (and rounding) as the collectives'.
            let _ = nexar_types::reduce_slice(nexar_types::ReduceOp::Sum, dst, src);
        } else {
            dst.copy_from_slice(src);
        }
    }

    /// Sets `len` elements from `at` to zero.
    pub(super) fn zero(&mut self, at: usize, len: usize) {
        match self {
            Flat::F32(v) => v[at..at + len].fill(0.0),
            Flat::F64(v) => v[at..at + len].fill(0.0),
            Flat::F16(v) => v[at..at + len].fill(f16::ZERO),
            Flat::Bf16(v) => v[at..at + len].fill(bf16::ZERO),
        }
    }

    /// Divides every element by `n` (the world size): in the element's own precision for
    /// `f32` and `f64`, through `f32` for the 16-bit types.
    pub(super) fn divide(&mut self, n: usize) {
        match self {
            Flat::F32(v) => v.iter_mut().for_each(|x| *x /= n as f32),
            Flat::F64(v) => v.iter_mut().for_each(|x| *x /= n as f64),
            Flat::F16(v) => v.iter_mut().for_each(|x| *x = f16::from_f32(x.to_f32() / n as f32)),
            Flat::Bf16(v) => v.iter_mut().for_each(|x| *x = bf16::from_f32(x.to_f32() / n as f32)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_copies_or_adds_and_divide_averages() {
        let mut flat = Flat::zeros(DType::F64, 4).unwrap();
        flat.put(1, &[1.0f64, 2.0], false);
        flat.put(1, &[3.0f64, 4.0], true);
        flat.divide(2);
        assert_eq!(f64::view(&flat).unwrap(), &[0.0, 2.0, 3.0, 0.0]);
        assert!(f32::view(&flat).is_none());
        flat.zero(1, 2);
        assert_eq!(f64::view(&flat).unwrap(), &[0.0; 4]);
        assert!(Flat::zeros(DType::I32, 1).is_none());
    }
}
