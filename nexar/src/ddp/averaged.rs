//! What a finished step lends out: the averaged gradients, viewed in the buckets.

use nexar_types::{bf16, f16};

use super::DdpError;
use super::flat::{Flat, GradElement};
use super::params::ParamSpec;
use super::reducer::Ddp;

/// The averaged gradients of a finished step, lent out of the buckets (no copy). Holding it
/// holds the [`Ddp`]; drop it before the next step.
///
/// ```no_run
/// # async fn run(mut ddp: nexar::ddp::Ddp) -> Result<(), nexar::ddp::DdpError> {
/// let averaged = ddp.finish().await?;
/// for (param, grad) in averaged.iter() {
///     println!("{param}: {} elements", grad.len());
/// }
/// # Ok(()) }
/// ```
pub struct Averaged<'a> {
    pub(super) ddp: &'a Ddp,
    pub(super) synced: bool,
}

/// One parameter's averaged gradient, in its element type.
#[derive(Clone, Copy, Debug)]
pub enum GradView<'a> {
    /// `f32` elements.
    F32(&'a [f32]),
    /// `f64` elements.
    F64(&'a [f64]),
    /// `f16` elements.
    F16(&'a [f16]),
    /// `bf16` elements.
    Bf16(&'a [bf16]),
}

impl GradView<'_> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            GradView::F32(v) => v.len(),
            GradView::F64(v) => v.len(),
            GradView::F16(v) => v.len(),
            GradView::Bf16(v) => v.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> Averaged<'a> {
    /// Whether the step was synchronised (false after a `no_sync` step: the values are this
    /// rank's running sums).
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// The averaged gradient of `name`, as `T` (its registered element type).
    pub fn get<T: GradElement>(&self, name: &str) -> Result<&'a [T], DdpError> {
        let index = self.ddp.index_of(name).ok_or_else(|| DdpError::UnknownParameter {
            rank: self.ddp.comm().rank(),
            step: self.ddp.step(),
            name: name.to_string(),
        })?;
        self.get_index(index)
    }

    /// The averaged gradient of the parameter at `index`.
    pub fn get_index<T: GradElement>(&self, index: usize) -> Result<&'a [T], DdpError> {
        let ddp = self.ddp;
        let p = ddp.params().get(index).ok_or_else(|| DdpError::InvalidArgument {
            rank: ddp.comm().rank(),
            reason: format!("parameter index {index}: only {} are registered", ddp.params().len()),
        })?;
        let (bucket, offset) = ddp.layout().place[index];
        let view = ddp.bucket_data(bucket).and_then(T::view);
        view.map(|v| &v[offset..offset + p.numel()]).ok_or_else(|| DdpError::WrongGradient {
            rank: ddp.comm().rank(),
            step: ddp.step(),
            name: p.name().to_string(),
            expected: format!("{:?} {} ({} elements)", p.shape(), p.dtype(), p.numel()),
            got: format!("a request for {} elements", T::DTYPE),
        })
    }

    /// Every parameter with its averaged gradient, in registration order.
    pub fn iter(&self) -> impl Iterator<Item = (&'a ParamSpec, GradView<'a>)> + '_ {
        let ddp = self.ddp;
        ddp.params().iter().enumerate().map(move |(i, p)| {
            let (bucket, offset) = ddp.layout().place[i];
            let range = offset..offset + p.numel();
            let view = match ddp.bucket_data(bucket) {
                Some(Flat::F32(v)) => GradView::F32(&v[range]),
                Some(Flat::F64(v)) => GradView::F64(&v[range]),
                Some(Flat::F16(v)) => GradView::F16(&v[range]),
                Some(Flat::Bf16(v)) => GradView::Bf16(&v[range]),
                None => GradView::F32(&[]),
            };
            (p, view)
        })
    }
}
