//! Each rank's share of a data set, in the manner of PyTorch's `DistributedSampler`, and the
//! average of a metric over the ranks.

use rand::SeedableRng;
use rand::seq::SliceRandom;

use crate::comm::{CollectiveError, NexarClient};

/// Splits the indices `0..len` of a data set among `world` ranks, reshuffled each epoch with
/// a seed every rank shares, so that the ranks' shares are disjoint and together cover the
/// data set. As in torch: without `drop_last`, the list is padded with its own first indices
/// up to a multiple of `world` (every rank gets the same count, so collectives stay in step);
/// with it, the tail that does not divide evenly is dropped.
///
/// ```
/// use nexar::ddp::ShardSampler;
/// let a = ShardSampler::new(10, 0, 3).seed(7);
/// let b = ShardSampler::new(10, 1, 3).seed(7);
/// let c = ShardSampler::new(10, 2, 3).seed(7);
/// let mut all: Vec<usize> = [a.indices(0), b.indices(0), c.indices(0)].concat();
/// assert_eq!(all.len(), 12); // 10 padded to 12
/// all.sort();
/// all.dedup();
/// assert_eq!(all, (0..10).collect::<Vec<_>>());
/// assert_ne!(a.indices(0), a.indices(1)); // reshuffled per epoch
/// ```
#[derive(Clone, Debug)]
pub struct ShardSampler {
    len: usize,
    rank: usize,
    world: usize,
    seed: u64,
    shuffle: bool,
    drop_last: bool,
}

impl ShardSampler {
    /// The share of `rank` among `world` ranks of a data set of `len` items; shuffled, seed 0,
    /// padded.
    pub fn new(len: usize, rank: usize, world: usize) -> ShardSampler {
        ShardSampler { len, rank, world: world.max(1), seed: 0, shuffle: true, drop_last: false }
    }

    /// The share of this rank of `comm`.
    pub fn for_comm(len: usize, comm: &NexarClient) -> ShardSampler {
        ShardSampler::new(len, comm.rank(), comm.world_size())
    }

    /// The seed of the shuffle (the same on every rank).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Whether to shuffle (default true); unshuffled, rank `r` gets `r, r + world, …`.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Drop the tail that does not divide evenly instead of padding (default false).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// How many indices each rank gets per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last { self.len / self.world } else { self.len.div_ceil(self.world) }
    }

    /// This rank's indices for `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(epoch));
            all.shuffle(&mut rng);
        }
        let total = self.num_samples() * self.world;
        if total > all.len() && !all.is_empty() {
            let pad: Vec<usize> = all.iter().copied().cycle().take(total - all.len()).collect();
            all.extend(pad);
        }
        all.truncate(total);
        all.into_iter().skip(self.rank).step_by(self.world).collect()
    }
}

/// The mean of `value` over the ranks of `comm` (a loss or an accuracy for the log): every rank
/// gets it.
///
/// ```no_run
/// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::CollectiveError> {
/// let loss = nexar::ddp::mean_over_ranks(&comm, 0.25).await?;
/// if comm.rank() == 0 {
///     println!("loss {loss:.4}");
/// }
/// # Ok(()) }
/// ```
pub async fn mean_over_ranks(comm: &NexarClient, value: f64) -> Result<f64, CollectiveError> {
    let mut v = [value];
    comm.all_reduce(&mut v[..], nexar_types::Sum).await?;
    Ok(v[0] / comm.world_size() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_disjoint_and_cover_the_set_without_padding_when_dropping_the_tail() {
        for (len, world) in [(0, 2), (1, 4), (7, 2), (100, 8), (101, 8)] {
            let shares: Vec<Vec<usize>> =
                (0..world).map(|r| ShardSampler::new(len, r, world).seed(3).drop_last(true).indices(5)).collect();
            let mut all: Vec<usize> = shares.concat();
            assert!(shares.iter().all(|s| s.len() == len / world), "{len} over {world}");
            all.sort();
            let before = all.len();
            all.dedup();
            assert_eq!(all.len(), before, "an index twice ({len} over {world})");
        }
    }

    #[test]
    fn unshuffled_shares_interleave() {
        assert_eq!(ShardSampler::new(7, 1, 3).shuffle(false).indices(0), [1, 4, 0]);
    }
}
