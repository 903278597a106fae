//! Times the element-wise kernels behind the reductions and the bf16 wire format, in cache
//! (64 Ki elements), best of seven runs of 200 calls each:
//!
//! ```text
//! cargo run --release -p nexar-types --example kernels
//! ```
//!
//! They run with the widest vector instructions the CPU has (AVX-512 or AVX2, chosen at run
//! time), so this is where a change in how they are compiled shows.

use std::time::Instant;

use nexar_types::{ReduceOp, bf16, f16, narrow_to_bf16, reduce_f32_with_bf16, reduce_slice, widen_bf16};

/// Nanoseconds per element of `f` over `n` elements: the best of seven runs.
fn time(name: &str, n: usize, mut f: impl FnMut()) {
    for _ in 0..50 {
        f();
    }
    let mut best = f64::MAX;
    for _ in 0..7 {
        let start = Instant::now();
        for _ in 0..200 {
            f();
        }
        best = best.min(start.elapsed().as_secs_f64() / 200.0);
    }
    println!("{name:>22}  {:.3} ns/element", best * 1e9 / n as f64);
}

fn main() -> Result<(), nexar_types::ReduceError> {
    let n = 64 * 1024;
    let (mut f32s, halves) = (vec![1.0f32; n], vec![0.5f32; n]);
    let (mut f64s, f64_halves) = (vec![1.0f64; n], vec![0.5f64; n]);
    let (mut ints, twos) = (vec![1i32; n], vec![2i32; n]);
    let (mut f16s, f16_ones) = (vec![f16::ONE; n], vec![f16::ONE; n]);
    let (mut bf16s, bf16_ones) = (vec![bf16::ONE; n], vec![bf16::ONE; n]);
    let mut wire = vec![bf16::ZERO; n];
    let mut failed = None;
    let mut check = |r: Result<(), nexar_types::ReduceError>| {
        if let Err(e) = r {
            failed.get_or_insert(e);
        }
    };
    time("f32 sum", n, || check(reduce_slice(ReduceOp::Sum, &mut f32s, &halves)));
    time("f64 sum", n, || check(reduce_slice(ReduceOp::Sum, &mut f64s, &f64_halves)));
    time("i32 max", n, || check(reduce_slice(ReduceOp::Max, &mut ints, &twos)));
    time("f16 sum", n, || {
        f16s.fill(f16::ONE);
        check(reduce_slice(ReduceOp::Sum, &mut f16s, &f16_ones))
    });
    time("bf16 sum", n, || {
        bf16s.fill(bf16::ONE);
        check(reduce_slice(ReduceOp::Sum, &mut bf16s, &bf16_ones))
    });
    time("f32 += bf16 (rounded)", n, || check(reduce_f32_with_bf16(ReduceOp::Sum, &mut f32s, &bf16_ones)));
    time("f32 -> bf16", n, || narrow_to_bf16(&halves, &mut wire));
    time("bf16 -> f32", n, || widen_bf16(&bf16_ones, &mut f32s));
    failed.map_or(Ok(()), Err)
}
