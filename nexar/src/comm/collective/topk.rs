//! The sparse allreduce with error feedback (deep gradient compression): each rank sends only
//! the `k` elements of largest magnitude of its buffer plus what it held back before, as
//! `(index, value)` pairs, and keeps the rest as its residual, which the next call adds back.
//! Nothing is lost, only delayed: at every moment the ranks' results so far plus their
//! residuals add up exactly to the sum of everything they contributed (up to `f32` rounding).
//!
//! The residual belongs to one buffer (one gradient tensor), so the caller holds it next to
//! that buffer, as an [`ErrorFeedback`]: a value it owns, that cannot be applied to another
//! tensor by mistake, and whose memory it sees.

use nexar_types::{RecvBuf, ReduceOp, Reduction};

use super::{CollectiveError, Exchange};
use crate::comm::NexarClient;
use crate::proto::algo::Collective;

const OP: &str = "all_reduce_topk";

/// The residual of one buffer for [`NexarClient::all_reduce_topk`]: what this rank has not sent
/// yet, added to the buffer's next contribution.
///
/// ```
/// let feedback = nexar::ErrorFeedback::new(0.01);
/// assert_eq!(feedback.ratio(), 0.01);
/// assert!(feedback.residual().is_empty()); // sized by the first call
/// ```
#[derive(Clone, Debug)]
pub struct ErrorFeedback {
    ratio: f64,
    residual: Vec<f32>,
}

impl ErrorFeedback {
    /// A residual for a buffer of which each call sends the `ratio` share of elements of
    /// largest magnitude (at least one). Every rank uses the same ratio.
    pub fn new(ratio: f64) -> ErrorFeedback {
        ErrorFeedback { ratio, residual: Vec::new() }
    }

    /// The share of elements each call sends.
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// What this rank holds back, per element (empty before the first call).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Forgets what was held back (for a new tensor, or after a rank's parameters were reset).
    pub fn clear(&mut self) {
        self.residual.clear();
    }

    /// The elements a call sends for a buffer of `len`.
    fn k(&self, len: usize) -> usize {
        ((len as f64 * self.ratio).ceil() as usize).clamp(1, len.max(1))
    }
}

impl NexarClient {
    /// Sums `f32` buffers sending only a `feedback.ratio()` share of their elements: each rank
    /// adds its residual to `buf`, sends the elements of largest magnitude as `(index, value)`
    /// pairs (8 bytes each, against 4 per element for [`all_reduce`](Self::all_reduce)), keeps
    /// the rest in `feedback`, and every rank ends with the same `buf`: the sum of what the
    /// ranks sent, added in rank order. What a call held back goes out in later calls, so no
    /// contribution is lost, only delayed. Only `Sum` is offered.
    ///
    /// Each rank receives `world_size() × k` pairs: that must fit
    /// [`max_message_bytes`](crate::NexarConfig::max_message_bytes), checked before anything
    /// is sent. Every rank calls it with the same length and ratio. When it fails, `buf`'s
    /// contribution is in `feedback` (the next call sends it) and `buf` holds zeros.
    ///
    /// ```no_run
    /// use nexar::{ErrorFeedback, NexarClient, Sum};
    /// # async fn run(comm: NexarClient) -> Result<(), nexar::CollectiveError> {
    /// let mut grads = vec![0.5f32; 1 << 20];
    /// let mut feedback = ErrorFeedback::new(0.01); // kept with `grads` from step to step
    /// comm.all_reduce_topk(&mut grads, Sum, &mut feedback).await?;
    /// # Ok(()) }
    /// ```
    pub async fn all_reduce_topk<B, O>(
        &self,
        buf: &mut B,
        op: O,
        feedback: &mut ErrorFeedback,
    ) -> Result<(), CollectiveError>
    where
        B: RecvBuf<Elem = f32> + ?Sized,
        O: Reduction<f32>,
    {
        let rank = self.rank();
        let invalid = |reason: String| CollectiveError::InvalidArgument { rank, op: OP, reason };
        if op.op() != ReduceOp::Sum {
            return Err(invalid(format!(
                "{} is not offered sparse: only Sum adds up what was held back",
                op.op().name()
            )));
        }
        if !(feedback.ratio > 0.0 && feedback.ratio <= 1.0) {
            return Err(invalid(format!("the ratio must lie in (0, 1], not {}", feedback.ratio)));
        }
        let mut stage = buf.host_stage().map_err(|source| CollectiveError::Device { rank, op: OP, source })?;
        let len = stage.len();
        if u32::try_from(len).is_err() {
            return Err(invalid(format!("{len} elements: a sparse allreduce indexes at most 2^32 - 1")));
        }
        if !feedback.residual.is_empty() && feedback.residual.len() != len {
            return Err(invalid(format!(
                "the feedback holds a residual of {} elements, the buffer has {len}: one ErrorFeedback per buffer",
                feedback.residual.len()
            )));
        }
        let k = feedback.k(len);
        let gathered = self.world_size() as u64 * k as u64 * 8;
        if gathered > self.config().max_message_bytes {
            return Err(invalid(format!(
                "{} ranks x {k} pairs = {gathered} bytes to receive, over max_message_bytes ({}): lower the ratio",
                self.world_size(),
                self.config().max_message_bytes
            )));
        }
        self.shapes_agree(len, k).await?;
        if len == 0 {
            let done = stage.commit().map_err(|source| CollectiveError::Device { rank, op: OP, source });
            return self.reported(OP, done);
        }
        feedback.residual.resize(len, 0.0);
        let pairs = take_largest(&mut stage, &mut feedback.residual, k);
        let mut all = vec![0u32; 2 * k * self.world_size()];
        if let Err(e) = self.exchange_host(Exchange::AllGather, &pairs[..], &mut all[..]).await {
            // Nothing of this call is lost: what it was to send goes back to the residual.
            for pair in pairs.chunks_exact(2) {
                feedback.residual[pair[0] as usize] += f32::from_bits(pair[1]);
            }
            return Err(e);
        }
        add_pairs(&all, k, &mut stage).map_err(|(peer, what)| CollectiveError::Mismatch {
            rank,
            op: OP,
            peer,
            what,
        })?;
        let done = stage.commit().map_err(|source| CollectiveError::Device { rank, op: OP, source });
        self.reported(OP, done)
    }

    /// Every rank has the same length and `k`: one small allreduce of both and their
    /// complements, whose maxima give the largest and the smallest of each.
    async fn shapes_agree(&self, len: usize, k: usize) -> Result<(), CollectiveError> {
        let mut v = [len as u64, !(len as u64), k as u64, !(k as u64)];
        self.staged(Collective::AllReduce, Some(ReduceOp::Max), &mut v[..]).await?;
        if v[0] != !v[1] || v[2] != !v[3] {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank(),
                op: OP,
                reason: format!(
                    "ranks disagree: lengths {} to {} and {} to {} pairs per rank (this rank: {len} elements, {k} pairs); use the same length and ratio everywhere",
                    !v[1], v[0], !v[3], v[2]
                ),
            });
        }
        Ok(())
    }
}

/// Adds `buf` into `residual`, moves the `k` entries of largest magnitude out of it (their
/// residual becomes zero) as `(index, value bits)` pairs, and zeroes `buf`.
fn take_largest(buf: &mut [f32], residual: &mut [f32], k: usize) -> Vec<u32> {
    for (r, b) in residual.iter_mut().zip(buf.iter_mut()) {
        *r += *b;
        *b = 0.0;
    }
    let mut magnitudes: Vec<f32> = residual.iter().map(|v| v.abs()).collect();
    let nth = residual.len() - k;
    let (_, threshold, _) = magnitudes.select_nth_unstable_by(nth, f32::total_cmp);
    let threshold = *threshold;
    drop(magnitudes);
    // Those above the threshold, then as many equal to it as `k` leaves room for.
    let above = residual.iter().filter(|v| v.abs().total_cmp(&threshold).is_gt()).count();
    let mut ties = k - above;
    let mut pairs = Vec::with_capacity(2 * k);
    for (i, r) in residual.iter_mut().enumerate() {
        let order = r.abs().total_cmp(&threshold);
        let take = order.is_gt() || (order.is_eq() && ties > 0);
        if take {
            if order.is_eq() {
                ties -= 1;
            }
            pairs.push(i as u32);
            pairs.push(r.to_bits());
            *r = 0.0;
        }
    }
    pairs
}

/// Adds every rank's pairs (`k` per rank, in rank order) into `buf`; `Err((rank, what))` for a
/// rank whose index is out of range.
fn add_pairs(all: &[u32], k: usize, buf: &mut [f32]) -> Result<(), (usize, String)> {
    let len = buf.len();
    for (peer, pairs) in all.chunks_exact(2 * k).enumerate() {
        for pair in pairs.chunks_exact(2) {
            let (i, v) = (pair[0] as usize, f32::from_bits(pair[1]));
            let slot = buf
                .get_mut(i)
                .ok_or_else(|| (peer, format!("rank {peer} sent index {i} for a buffer of {len} elements")))?;
            *slot += v;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_magnitudes_go_and_the_rest_stays_behind() {
        let mut buf = vec![1.0, -9.0, 3.0, 0.5, 7.0, -2.0];
        let mut residual = vec![0.0, 0.0, 0.0, 0.0, 0.0, 3.0];
        let pairs = take_largest(&mut buf, &mut residual, 2);
        let sent: Vec<(u32, f32)> = pairs.chunks(2).map(|p| (p[0], f32::from_bits(p[1]))).collect();
        assert_eq!(sent, vec![(1, -9.0), (4, 7.0)]);
        assert_eq!(residual, vec![1.0, 0.0, 3.0, 0.5, 0.0, 1.0]);
        assert!(buf.iter().all(|b| *b == 0.0));
    }

    #[test]
    fn ties_at_the_threshold_fill_exactly_k() {
        let mut buf = vec![2.0; 10];
        let mut residual = vec![0.0; 10];
        let pairs = take_largest(&mut buf, &mut residual, 3);
        assert_eq!(pairs.len(), 6);
        assert_eq!(residual.iter().filter(|r| **r == 0.0).count(), 3);
        assert_eq!(residual.iter().sum::<f32>() + 3.0 * 2.0, 20.0);
    }

    #[test]
    fn a_peer_index_out_of_range_is_refused_naming_the_peer() {
        let mut buf = vec![0.0f32; 4];
        let all = [0u32, 1f32.to_bits(), 9, 1f32.to_bits()];
        let (peer, what) = add_pairs(&all, 1, &mut buf).unwrap_err();
        assert_eq!(peer, 1);
        assert!(what.contains("index 9"), "{what}");
    }
}
