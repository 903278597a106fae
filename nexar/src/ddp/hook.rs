//! Comm hooks: how a bucket's gradients are summed over the ranks and averaged. One small
//! interface, as in PyTorch's DDP: a bucket in, the averaged bucket out, so compression is a
//! hook and not a fork of the reducer.

use nexar_types::Sum;

use super::flat::Flat;
use super::powersgd::{self, PowerSgd, PowerSgdState};
use crate::comm::{CollectiveError, Compression, ErrorFeedback, NexarClient};

/// How each bucket is reduced. The hooks other than [`Plain`](CommHook::Plain) apply to `f32`
/// buckets; buckets of other element types are reduced plainly under any hook.
///
/// ```
/// use nexar::ddp::{CommHook, PowerSgd};
/// let hooks = [
///     CommHook::Plain,
///     CommHook::Compressed(nexar::Compression::Bf16),
///     CommHook::TopK { ratio: 0.01 },
///     CommHook::PowerSgd(PowerSgd { rank: 2, ..Default::default() }),
/// ];
/// assert_eq!(hooks[1].name(), "bf16");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum CommHook {
    /// A sum over the ranks in the bucket's own element type, then a division by the world
    /// size: exactly the average, up to one rounding of the sum per rank.
    #[default]
    Plain,
    /// The bucket travels as 16-bit floats ([`NexarClient::all_reduce_compressed`]): half the
    /// bytes, with the error bound of [`Compression::sum_error_bound`] on the sum (torch's
    /// `bf16_compress_hook` / `fp16_compress_hook`).
    Compressed(Compression),
    /// Only the `ratio` share of elements of largest magnitude travels, the rest is kept per
    /// rank and sent later ([`NexarClient::all_reduce_topk`], deep gradient compression).
    TopK {
        /// The share of elements sent each step, in (0, 1].
        ratio: f64,
    },
    /// A low-rank approximation of each matrix-shaped gradient, with error feedback and warm
    /// start (torch's `powerSGD_hook`). See [`PowerSgd`].
    PowerSgd(PowerSgd),
}

impl CommHook {
    /// Lower-case name, as errors and logs write it.
    pub fn name(&self) -> &'static str {
        match self {
            CommHook::Plain => "plain",
            CommHook::Compressed(c) => c.name(),
            CommHook::TopK { .. } => "top-k",
            CommHook::PowerSgd(_) => "powersgd",
        }
    }

    /// What every rank must agree on, as text (it is digested for the registration check).
    pub(super) fn describe(&self) -> String {
        match self {
            CommHook::Plain => "plain".into(),
            CommHook::Compressed(c) => c.name().into(),
            CommHook::TopK { ratio } => format!("top-k {ratio}"),
            CommHook::PowerSgd(p) => format!(
                "powersgd rank {} from step {}, rate {}, feedback {}, warm {}, seed {}",
                p.rank, p.start_step, p.min_compression_rate, p.error_feedback, p.warm_start, p.seed
            ),
        }
    }

    /// Checks the settings before anything is sent.
    pub(super) fn validate(&self) -> Result<(), String> {
        match self {
            CommHook::TopK { ratio } if !(*ratio > 0.0 && *ratio <= 1.0) => {
                Err(format!("the top-k hook's ratio must lie in (0, 1], not {ratio}"))
            }
            CommHook::PowerSgd(p) if p.rank == 0 => Err("the PowerSGD hook's rank must be at least 1".into()),
            CommHook::PowerSgd(p) if p.min_compression_rate.is_nan() || p.min_compression_rate < 1.0 => Err(format!(
                "the PowerSGD hook's min_compression_rate must be at least 1, not {}",
                p.min_compression_rate
            )),
            _ => Ok(()),
        }
    }
}

/// A parameter inside a bucket, seen as a matrix: its first dimension by the product of the
/// others (a vector or scalar is one row).
#[derive(Clone, Copy, Debug)]
pub(super) struct MatrixPart {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
}

impl MatrixPart {
    pub(super) fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub(super) fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// What a hook keeps for one bucket from step to step.
#[derive(Debug, Default)]
pub(super) enum HookState {
    /// Nothing.
    #[default]
    Empty,
    /// The top-k residual.
    TopK(ErrorFeedback),
    /// PowerSGD's residual and `Q`s.
    PowerSgd(PowerSgdState),
}

/// Sums `data` over the ranks with `hook`, then divides by the world size. `step` is the
/// layer's step counter (PowerSGD starts at `start_step`).
pub(super) async fn reduce(
    comm: &NexarClient,
    hook: &CommHook,
    state: &mut HookState,
    data: &mut Flat,
    parts: &[MatrixPart],
    step: u64,
) -> Result<(), CollectiveError> {
    let world = comm.world_size();
    let v = match (hook, data) {
        (CommHook::Compressed(c), Flat::F32(v)) => {
            comm.all_reduce_compressed(&mut v[..], Sum, *c).await?;
            v
        }
        (CommHook::TopK { ratio }, Flat::F32(v)) => {
            if !matches!(state, HookState::TopK(_)) {
                *state = HookState::TopK(ErrorFeedback::new(*ratio));
            }
            if let HookState::TopK(feedback) = state {
                comm.all_reduce_topk(&mut v[..], Sum, feedback).await?;
            }
            v
        }
        (CommHook::PowerSgd(cfg), Flat::F32(v)) if step >= cfg.start_step => {
            if !matches!(state, HookState::PowerSgd(_)) {
                *state = HookState::PowerSgd(PowerSgdState::default());
            }
            if let HookState::PowerSgd(s) = state {
                // PowerSGD averages as it goes.
                return powersgd::reduce(comm, cfg, s, &mut v[..], parts).await;
            }
            return Ok(());
        }
        (_, data) => {
            match data {
                Flat::F32(v) => comm.all_reduce(&mut v[..], Sum).await?,
                Flat::F64(v) => comm.all_reduce(&mut v[..], Sum).await?,
                Flat::F16(v) => comm.all_reduce(&mut v[..], Sum).await?,
                Flat::Bf16(v) => comm.all_reduce(&mut v[..], Sum).await?,
            }
            data.divide(world);
            return Ok(());
        }
    };
    v.iter_mut().for_each(|x| *x /= world as f32);
    Ok(())
}
