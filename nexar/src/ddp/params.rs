//! Registered parameters, and the check that every rank registered the same ones.

use nexar_types::DType;

use super::DdpError;
use crate::comm::NexarClient;

/// A parameter as the data-parallel layer knows it: a name, a shape and an element type. The
/// gradient handed over for it has exactly `numel()` elements of `dtype`.
///
/// ```
/// use nexar::DType;
/// use nexar::ddp::ParamSpec;
/// let w = ParamSpec::new("fc1.weight", &[128, 64], DType::F32);
/// assert_eq!(w.numel(), 8192);
/// assert_eq!(w.to_string(), "`fc1.weight` [128, 64] f32");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
}

impl ParamSpec {
    /// A parameter named `name` (unique among the registered ones) of `shape` and `dtype`.
    pub fn new(name: impl Into<String>, shape: &[usize], dtype: DType) -> ParamSpec {
        ParamSpec { name: name.into(), shape: shape.to_vec(), dtype }
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shape (empty for a scalar).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of elements: the product of the shape (1 for a scalar, 0 if a dimension is).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The bytes of its gradient.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// A 64-bit digest of name, shape and element type, equal on every rank for equal specs.
    pub(super) fn digest(&self) -> u64 {
        let mut text = format!("{}\u{0}{:?}\u{0}", self.name, self.dtype);
        for d in &self.shape {
            text.push_str(&d.to_string());
            text.push(',');
        }
        nexar_types::stable_hash(text.as_bytes())
    }
}

impl std::fmt::Display for ParamSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` {:?} {}", self.name, self.shape, self.dtype)
    }
}

/// The longest description of one parameter that travels in a registration report.
const DESCRIBED_BYTES: usize = 192;

/// Checks that every rank of `comm` registered `params` (in this order) with the same
/// `settings` digest (bucket caps, hook). On a difference every rank returns the same
/// [`DdpError::Registration`], naming the first parameter that differs and the ranks: the
/// digests are gathered from every rank (8 bytes a parameter), then the first differing
/// parameter's description.
pub(super) async fn check_same_everywhere(
    comm: &NexarClient,
    params: &[ParamSpec],
    settings: u64,
    settings_text: &str,
) -> Result<(), DdpError> {
    let rank = comm.rank();
    let world = comm.world_size();
    let collective = |source| DdpError::Collective { rank, op: "registration check", source: Box::new(source) };
    // Counts and settings first: the digest lists that follow must have one length.
    let mut heads = vec![0u64; 2 * world];
    comm.all_gather(&[params.len() as u64, settings][..], &mut heads[..]).await.map_err(collective)?;
    let counts: Vec<usize> = heads.chunks(2).map(|h| h[0] as usize).collect();
    if let Some(r) = heads.chunks(2).position(|h| h[1] != heads[1]) {
        let describe = describe_settings(comm, settings_text).await?;
        return Err(DdpError::Registration {
            rank,
            what: format!("the settings differ: rank 0 has {}, rank {r} has {}", describe[0], describe[r]),
        });
    }
    let common = counts.iter().copied().min().unwrap_or(0);
    let mut mine: Vec<u64> = params.iter().take(common).map(ParamSpec::digest).collect();
    mine.resize(common, 0);
    let mut all = vec![0u64; common * world];
    comm.all_gather(&mine[..], &mut all[..]).await.map_err(collective)?;
    let first = (0..common).find(|&i| (1..world).any(|r| all[r * common + i] != all[i]));
    let index = match first {
        Some(i) => i,
        None if counts.iter().all(|&c| c == common) => return Ok(()),
        // Equal up to the shortest list: the first parameter past it.
        None => common,
    };
    let texts = describe_param(comm, params.get(index)).await?;
    let differing = (1..world).find(|&r| texts[r] != texts[0]).unwrap_or(0);
    let what = if index == common && counts[0] != counts[differing] {
        format!(
            "rank 0 registered {} parameters, rank {differing} registered {}; the first {common} agree, parameter {index} is {} on rank 0 and {} on rank {differing}",
            counts[0], counts[differing], texts[0], texts[differing]
        )
    } else {
        format!("parameter {index} is {} on rank 0 but {} on rank {differing}", texts[0], texts[differing])
    };
    Err(DdpError::Registration { rank, what })
}

/// Every rank's description of one parameter (`absent` where it has none), gathered.
async fn describe_param(comm: &NexarClient, param: Option<&ParamSpec>) -> Result<Vec<String>, DdpError> {
    let text = param.map_or_else(|| "absent (no parameter there)".to_string(), ParamSpec::to_string);
    gather_text(comm, &text, "registration report").await
}

async fn describe_settings(comm: &NexarClient, text: &str) -> Result<Vec<String>, DdpError> {
    gather_text(comm, text, "settings report").await
}

/// Every rank's `text`, cut to [`DESCRIBED_BYTES`] at a character boundary.
async fn gather_text(comm: &NexarClient, text: &str, op: &'static str) -> Result<Vec<String>, DdpError> {
    let rank = comm.rank();
    let mut cut = text.len().min(DESCRIBED_BYTES);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut block = [0u8; DESCRIBED_BYTES];
    block[..cut].copy_from_slice(&text.as_bytes()[..cut]);
    let mut all = vec![0u8; DESCRIBED_BYTES * comm.world_size()];
    comm.all_gather(&block[..], &mut all[..]).await.map_err(|source| DdpError::Collective {
        rank,
        op,
        source: Box::new(source),
    })?;
    Ok(all
        .chunks(DESCRIBED_BYTES)
        .map(|b| {
            let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
            String::from_utf8_lossy(&b[..end]).into_owned()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_tell_names_shapes_and_types_apart() {
        let a = ParamSpec::new("w", &[2, 3], DType::F32);
        assert_eq!(a.digest(), ParamSpec::new("w", &[2, 3], DType::F32).digest());
        assert_ne!(a.digest(), ParamSpec::new("v", &[2, 3], DType::F32).digest());
        assert_ne!(a.digest(), ParamSpec::new("w", &[3, 2], DType::F32).digest());
        assert_ne!(a.digest(), ParamSpec::new("w", &[6], DType::F32).digest());
        assert_ne!(a.digest(), ParamSpec::new("w", &[2, 3], DType::BF16).digest());
        // A name that ends in digits does not run into the shape.
        assert_ne!(ParamSpec::new("w1", &[2], DType::F32).digest(), ParamSpec::new("w", &[12], DType::F32).digest());
    }
}

/// What the ranks agreed on when a layer was built or rebuilt: the step to go on from, and
/// whose state to go on with.
///
/// After a failure the survivors need not be at one step: a rank whose last bucket completed
/// before the dead rank's link went down finished the step, while another, still waiting for
/// the dead rank's last message, failed it. The finished step stands (it averaged every rank's
/// gradient, the dead one's too), so every rank goes on from the newest step any of them
/// finished, with the parameters and optimizer state of the lowest rank that finished it.
///
/// ```no_run
/// # async fn run(mut ddp: nexar::ddp::Ddp, survivors: nexar::NexarClient) -> Result<(), nexar::ddp::DdpError> {
/// let agreed = ddp.rebuild(&survivors).await?;
/// if let Some(source) = agreed.source {
///     // Ranks were at different steps: take `source`'s parameters and optimizer state.
///     let mut momentum = vec![0f32; 1024];
///     ddp.broadcast(source, &mut [&mut momentum[..]]).await?;
/// }
/// assert_eq!(ddp.step(), agreed.step);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepAgreement {
    /// The newest step counter among the ranks; every rank's layer is set to it.
    pub step: u64,
    /// When the ranks were at different steps, the lowest rank at the newest one: the state to
    /// go on with is its. `None` when every rank was at `step` already.
    pub source: Option<usize>,
}

/// Agrees with every rank of `comm` on the step to go on from (see [`StepAgreement`]): one
/// allreduce of the step and its complement, and where they differ one more for the source.
pub(super) async fn agree_on_step(comm: &NexarClient, step: u64) -> Result<StepAgreement, DdpError> {
    let rank = comm.rank();
    let collective = |source| DdpError::Collective { rank, op: "step agreement", source: Box::new(source) };
    let mut steps = [step, !step];
    comm.all_reduce(&mut steps[..], nexar_types::Max).await.map_err(collective)?;
    let (newest, oldest) = (steps[0], !steps[1]);
    if newest == oldest {
        return Ok(StepAgreement { step: newest, source: None });
    }
    let mut source = [if step == newest { rank as u64 } else { u64::MAX }];
    comm.all_reduce(&mut source[..], nexar_types::Min).await.map_err(collective)?;
    tracing::info!(rank, newest, oldest, source = source[0], "ddp: the ranks were at different steps");
    Ok(StepAgreement { step: newest, source: Some(source[0] as usize) })
}
