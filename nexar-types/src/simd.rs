//! The widest vector instructions the CPU has, chosen at run time for the element-wise
//! kernels (a program built for the default `x86_64` target may only assume SSE2).
//!
//! [`widest`] runs a [`Kernel`] inside a function compiled for AVX-512 or AVX2 when the CPU
//! has them: the kernel, inlined there, is vectorised for them (the bf16 rounding loops run three
//! times faster with AVX-512 than with SSE2). The only `unsafe` is calling those functions,
//! which is sound once the CPU is known to have their features.
#![allow(unsafe_code)]

/// An element-wise loop to run with the widest vector instructions ([`widest`]).
///
/// Implementations mark [`run`](Kernel::run) `#[inline(always)]` and call only inlined code
/// in it, so that the whole loop is compiled inside the functions that enable the wider
/// instructions. (A closure would not do: the compiler need not inline it there, and for
/// the larger loops did not, leaving them on SSE2.)
pub(crate) trait Kernel {
    /// What the loop gives back.
    type Output;
    /// The loop.
    fn run(self) -> Self::Output;
}

/// Runs `kernel`, compiled for the widest vector instructions this CPU has.
///
/// ```text
/// struct Triple<'a>(&'a mut [f32]);
/// impl Kernel for Triple<'_> {
///     type Output = ();
///     #[inline(always)]
///     fn run(self) { self.0.iter_mut().for_each(|x| *x *= 3.0) }
/// }
/// simd::widest(Triple(&mut buf));
/// ```
#[inline(always)]
pub(crate) fn widest<K: Kernel>(kernel: K) -> K::Output {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bw") && std::arch::is_x86_feature_detected!("avx512vl") {
            // SAFETY: `on_avx512` is compiled for AVX-512F, BW and VL, which the CPU has (BW
            // and VL were checked just above, and both imply F).
            return unsafe { on_avx512(kernel) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: `on_avx2` is compiled for AVX2, which the CPU has (checked just above).
            return unsafe { on_avx2(kernel) };
        }
    }
    kernel.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn on_avx512<K: Kernel>(kernel: K) -> K::Output {
    kernel.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn on_avx2<K: Kernel>(kernel: K) -> K::Output {
    kernel.run()
}

#[cfg(test)]
mod tests {
    use super::Kernel;

    struct Triple<'a>(&'a mut [f32]);

    impl Kernel for Triple<'_> {
        type Output = usize;
        #[inline(always)]
        fn run(self) -> usize {
            self.0.iter_mut().for_each(|x| *x *= 3.0);
            self.0.len()
        }
    }

    #[test]
    fn a_kernel_gives_the_same_result_whatever_runs_it() {
        let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let mut wide = a.clone();
        assert_eq!(super::widest(Triple(&mut wide)), 1000);
        assert!(wide.iter().zip(&a).all(|(w, x)| *w == *x * 3.0));
    }
}
