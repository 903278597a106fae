//! PowerSGD (Vogels, Karimireddy and Jaggi, 2019), as PyTorch's `powerSGD_hook` runs it: each
//! matrix-shaped gradient `M` (`n × m`, a parameter's first dimension by the rest) travels as
//! two thin factors `P = M·Q` (`n × r`) and `Q = Mᵀ·P` (`m × r`), with `P` orthogonalised in
//! between, so a bucket sends `r·(n + m)` elements per matrix instead of `n·m`. What the
//! approximation leaves out is kept per rank (error feedback) and added to the next step's
//! gradient; `Q` is kept from step to step (warm start), so one power iteration a step tracks
//! the gradient's leading subspace. Vectors, and matrices too small to gain, are allreduced
//! whole in one collective of the bucket.

use rand::{Rng, SeedableRng};

use super::hook::MatrixPart;
use crate::comm::{CollectiveError, NexarClient};

/// PowerSGD's settings (torch's `PowerSGDState`).
///
/// ```
/// let hook = nexar::ddp::PowerSgd { rank: 4, start_step: 0, ..Default::default() };
/// assert!(hook.error_feedback && hook.warm_start);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerSgd {
    /// The approximation's rank `r` (torch's `matrix_approximation_rank`, default 1).
    pub rank: usize,
    /// Steps allreduced whole before compression starts (torch's `start_powerSGD_iter`; it
    /// defaults to 1,000 there, so that the model leaves its first, fast-changing phase
    /// uncompressed). Default 1,000.
    pub start_step: u64,
    /// A matrix is compressed only when `n·m > min_compression_rate · r·(n + m)`; default 2.
    pub min_compression_rate: f64,
    /// Keep what the approximation leaves out and add it to the next step's gradient.
    pub error_feedback: bool,
    /// Start each step's power iteration from the last step's `Q`.
    pub warm_start: bool,
    /// Seed of the first `Q` (the same on every rank, so that the ranks' `P`s add up).
    pub seed: u64,
}

impl Default for PowerSgd {
    fn default() -> Self {
        PowerSgd {
            rank: 1,
            start_step: 1000,
            min_compression_rate: 2.0,
            error_feedback: true,
            warm_start: true,
            seed: 0,
        }
    }
}

impl PowerSgd {
    /// Whether an `n × m` matrix is compressed, and at which rank.
    pub(super) fn rank_for(&self, n: usize, m: usize) -> Option<usize> {
        let r = self.rank.min(n).min(m);
        let whole = (n * m) as f64;
        (r > 0 && whole > self.min_compression_rate * (r * (n + m)) as f64).then_some(r)
    }
}

/// What a bucket keeps from step to step: the residual (per element of the bucket) and each
/// compressed matrix's `Q`.
#[derive(Debug, Default)]
pub(super) struct PowerSgdState {
    error: Vec<f32>,
    qs: Vec<Vec<f32>>,
}

/// Allreduces and averages a bucket's `data` with PowerSGD. `parts` lists its parameters
/// (offset, rows, columns); `world` ranks take part.
pub(super) async fn reduce(
    comm: &NexarClient,
    cfg: &PowerSgd,
    state: &mut PowerSgdState,
    data: &mut [f32],
    parts: &[MatrixPart],
) -> Result<(), CollectiveError> {
    let world = comm.world_size();
    if cfg.error_feedback {
        if state.error.len() != data.len() {
            state.error = vec![0.0; data.len()];
        }
        data.iter_mut().zip(&state.error).for_each(|(x, e)| *x += e);
    }
    let compressed: Vec<(&MatrixPart, usize)> =
        parts.iter().filter_map(|p| cfg.rank_for(p.rows, p.cols).map(|r| (p, r))).collect();
    let whole: Vec<&MatrixPart> = parts.iter().filter(|p| cfg.rank_for(p.rows, p.cols).is_none()).collect();

    // The parts sent whole: one flat allreduce.
    let mut flat: Vec<f32> = Vec::with_capacity(whole.iter().map(|p| p.len()).sum());
    for p in &whole {
        flat.extend_from_slice(&data[p.range()]);
    }
    // The compressed matrices' local values, for the residual.
    let local: Vec<Vec<f32>> = compressed.iter().map(|(p, _)| data[p.range()].to_vec()).collect();
    if state.qs.len() != compressed.len() || !cfg.warm_start {
        let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
        state.qs = compressed
            .iter()
            .map(|(p, r)| {
                let mut q: Vec<f32> = (0..p.cols * r).map(|_| rng.random::<f32>() - 0.5).collect();
                orthogonalise(&mut q, p.cols, *r);
                q
            })
            .collect();
    }
    // P = M·Q for every matrix, summed over the ranks in one allreduce with the whole parts.
    let mut ps: Vec<f32> = Vec::new();
    for ((p, r), q) in compressed.iter().zip(&state.qs) {
        let start = ps.len();
        ps.resize(start + p.rows * r, 0.0);
        mul(&data[p.range()], q, &mut ps[start..], p.rows, p.cols, *r);
    }
    let whole_len = flat.len();
    flat.extend_from_slice(&ps);
    if !flat.is_empty() {
        comm.all_reduce(&mut flat[..], nexar_types::Sum).await?;
    }
    let mut at = 0;
    for p in &whole {
        let out = &mut data[p.range()];
        out.iter_mut().zip(&flat[at..at + p.len()]).for_each(|(d, s)| *d = s / world as f32);
        at += p.len();
    }
    if compressed.is_empty() {
        state.error.iter_mut().for_each(|e| *e = 0.0);
        return Ok(());
    }
    let mut ps = flat.split_off(whole_len);
    // Orthogonalise each P, then Q = Mᵀ·P, summed over the ranks.
    let mut offsets = Vec::with_capacity(compressed.len());
    let mut at = 0;
    for (p, r) in &compressed {
        orthogonalise(&mut ps[at..at + p.rows * r], p.rows, *r);
        offsets.push(at);
        at += p.rows * r;
    }
    let mut qs: Vec<f32> = Vec::new();
    for (((p, r), &po), m) in compressed.iter().zip(&offsets).zip(&local) {
        let start = qs.len();
        qs.resize(start + p.cols * r, 0.0);
        mul_transposed(m, &ps[po..po + p.rows * r], &mut qs[start..], p.rows, p.cols, *r);
    }
    comm.all_reduce(&mut qs[..], nexar_types::Sum).await?;
    qs.iter_mut().for_each(|q| *q /= world as f32);
    // M ≈ P·Qᵀ (the average), and the residual of what this rank contributed.
    let mut qo = 0;
    for (i, ((p, r), &po)) in compressed.iter().zip(&offsets).enumerate() {
        let q = &qs[qo..qo + p.cols * r];
        let out = &mut data[p.range()];
        outer(&ps[po..po + p.rows * r], q, out, p.rows, p.cols, *r);
        state.qs[i] = q.to_vec();
        qo += p.cols * r;
    }
    if cfg.error_feedback {
        state.error.iter_mut().for_each(|e| *e = 0.0);
        for ((p, _), m) in compressed.iter().zip(&local) {
            let approx = &data[p.range()];
            for ((e, l), a) in state.error[p.range()].iter_mut().zip(m).zip(approx) {
                *e = l - a;
            }
        }
    }
    Ok(())
}

/// `out (n × r) = m (n × k) · q (k × r)`, row-major.
fn mul(m: &[f32], q: &[f32], out: &mut [f32], n: usize, k: usize, r: usize) {
    out.fill(0.0);
    for i in 0..n {
        let row = &m[i * k..(i + 1) * k];
        let o = &mut out[i * r..(i + 1) * r];
        for (c, &a) in row.iter().enumerate() {
            for (oj, qj) in o.iter_mut().zip(&q[c * r..(c + 1) * r]) {
                *oj += a * qj;
            }
        }
    }
}

/// `out (k × r) = mᵀ (k × n) · p (n × r)`, with `m` stored `n × k`.
fn mul_transposed(m: &[f32], p: &[f32], out: &mut [f32], n: usize, k: usize, r: usize) {
    out.fill(0.0);
    for i in 0..n {
        let pi = &p[i * r..(i + 1) * r];
        for (c, &a) in m[i * k..(i + 1) * k].iter().enumerate() {
            for (oj, pj) in out[c * r..(c + 1) * r].iter_mut().zip(pi) {
                *oj += a * pj;
            }
        }
    }
}

/// `out (n × k) = p (n × r) · qᵀ (r × k)`, with `q` stored `k × r`.
fn outer(p: &[f32], q: &[f32], out: &mut [f32], n: usize, k: usize, r: usize) {
    for i in 0..n {
        let pi = &p[i * r..(i + 1) * r];
        for (c, o) in out[i * k..(i + 1) * k].iter_mut().enumerate() {
            *o = pi.iter().zip(&q[c * r..(c + 1) * r]).map(|(a, b)| a * b).sum();
        }
    }
}

/// Orthonormalises the `r` columns of a row-major `n × r` matrix by Gram–Schmidt, each column
/// projected out twice ("twice is enough": one pass leaves a near-dependent column far from
/// orthogonal once normalised). A column that is (nearly) a combination of the ones before it
/// (its residual under 1e-4 of its norm) becomes zero instead of normalised rounding noise: a
/// gradient of lower rank than `r` then contributes exactly its own subspace.
fn orthogonalise(a: &mut [f32], n: usize, r: usize) {
    let norm = |a: &[f32], j: usize| (0..n).map(|i| a[i * r + j] * a[i * r + j]).sum::<f32>().sqrt();
    for j in 0..r {
        let before = norm(a, j);
        for _ in 0..2 {
            for k in 0..j {
                let dot: f32 = (0..n).map(|i| a[i * r + k] * a[i * r + j]).sum();
                (0..n).for_each(|i| a[i * r + j] -= dot * a[i * r + k]);
            }
        }
        let after = norm(a, j);
        let scale = if after > 1e-4 * before && after > 1e-30 { 1.0 / after } else { 0.0 };
        (0..n).for_each(|i| a[i * r + j] *= scale);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_come_out_orthonormal() {
        let (n, r) = (7, 3);
        let mut a: Vec<f32> = (0..n * r).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
        orthogonalise(&mut a, n, r);
        for j in 0..r {
            for k in 0..r {
                let dot: f32 = (0..n).map(|i| a[i * r + j] * a[i * r + k]).sum();
                let want = if j == k { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-5, "column {j}·{k} = {dot}");
            }
        }
    }

    #[test]
    fn a_dependent_column_becomes_zero_not_noise() {
        // The second column is twice the first: it carries nothing of its own.
        let mut a = vec![1.0f32, 2.0, -3.0, -6.0, 0.5, 1.0];
        orthogonalise(&mut a, 3, 2);
        assert!(a.iter().skip(1).step_by(2).all(|&x| x == 0.0), "{a:?}");
        let first: f32 = a.iter().step_by(2).map(|x| x * x).sum();
        assert!((first - 1.0).abs() < 1e-6);
    }

    #[test]
    fn a_rank_r_matrix_is_recovered_by_one_power_step() {
        // M = u·vᵀ (rank 1): P = M·Q ∝ u, Q' = Mᵀ·P̂ = v·(u·P̂), P̂·Q'ᵀ = M.
        let (n, k) = (5, 4);
        let u = [1.0f32, -2.0, 0.5, 3.0, 1.5];
        let v = [0.3f32, 1.0, -0.7, 2.0];
        let m: Vec<f32> = (0..n * k).map(|i| u[i / k] * v[i % k]).collect();
        let q = [0.4f32, 0.1, -0.3, 0.8];
        let mut p = vec![0.0; n];
        mul(&m, &q, &mut p, n, k, 1);
        orthogonalise(&mut p, n, 1);
        let mut q2 = vec![0.0; k];
        mul_transposed(&m, &p, &mut q2, n, k, 1);
        let mut back = vec![0.0; n * k];
        outer(&p, &q2, &mut back, n, k, 1);
        for (a, b) in back.iter().zip(&m) {
            assert!((a - b).abs() < 1e-5, "{a} against {b}");
        }
    }

    #[test]
    fn only_matrices_that_gain_are_compressed() {
        let cfg = PowerSgd { rank: 2, ..Default::default() };
        assert_eq!(cfg.rank_for(64, 64), Some(2));
        assert_eq!(cfg.rank_for(1, 1000), None); // a vector
        assert_eq!(cfg.rank_for(4, 4), None); // 16 against 2·2·8 = 32
    }
}
