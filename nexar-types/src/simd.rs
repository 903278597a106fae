//! The widest vector instructions the CPU has, chosen at run time for the element-wise
//! kernels (a program built for the default `x86_64` target may only assume SSE2).
//!
//! [`widest`] runs a kernel inside a function compiled for AVX-512 or AVX2 when the CPU has
//! them: the kernel, inlined there, is vectorised for them (the bf16 rounding loops run three
//! times faster with AVX-512 than with SSE2). The only `unsafe` is calling those functions,
//! which is sound once the CPU is known to have their features.
#![allow(unsafe_code)]

/// Runs `kernel`, compiled for the widest vector instructions this CPU has. `kernel` should
/// be a closure over `#[inline(always)]` loops, so that they are inlined where the wider
/// instructions are enabled.
///
/// ```text
/// simd::widest(|| for (a, b) in acc.iter_mut().zip(other) { *a += *b });
/// ```
#[inline(always)]
pub(crate) fn widest<R>(kernel: impl FnOnce() -> R) -> R {
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
    kernel()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn on_avx512<R>(kernel: impl FnOnce() -> R) -> R {
    kernel()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn on_avx2<R>(kernel: impl FnOnce() -> R) -> R {
    kernel()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_kernel_gives_the_same_result_whatever_runs_it() {
        let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let mut wide = a.clone();
        super::widest(|| wide.iter_mut().for_each(|x| *x *= 3.0));
        assert!(wide.iter().zip(&a).all(|(w, x)| *w == *x * 3.0));
        assert_eq!(super::widest(|| 7), 7);
    }
}
