//! What the burn layer can fail with.

use nexar::ddp::DdpError;

/// Failures of [`Ddp`](crate::Ddp).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The data-parallel layer failed; the error names the rank, the step and the parameter or
    /// bucket. A model whose parameters differ between ranks (a shape, a count) is this error's
    /// `Registration` variant, on every rank.
    #[error(transparent)]
    Ddp(#[from] DdpError),
    /// burn could not read a tensor back to the host (an execution error of its backend).
    #[error("parameter `{name}`: burn could not read the tensor: {source}")]
    Read {
        /// The parameter, by its module path.
        name: String,
        /// What burn reported.
        #[source]
        source: burn::tensor::TensorReadError,
    },
    /// A tensor's data could not be viewed as its element type.
    #[error("parameter `{name}`: {source}")]
    Data {
        /// The parameter, by its module path.
        name: String,
        /// What burn reported.
        #[source]
        source: burn::tensor::DataError,
    },
    /// A parameter of an element type gradients are not averaged in (quantized, `flex32`).
    #[error("parameter `{name}` is {dtype:?}: nexar-burn averages f32, f64, f16 and bf16 gradients")]
    UnsupportedDtype {
        /// The parameter, by its module path.
        name: String,
        /// Its element type.
        dtype: burn::tensor::DType,
    },
    /// The model handed to `sync` or `broadcast_params` is not the one the layer was built
    /// from: another number of trainable parameters, or one of another shape or element type
    /// (a layer frozen or unfrozen since, another model). Reported on this rank only, before
    /// anything is sent: build the layer again for the new model.
    #[error("rank {rank}: the model differs from the one registered: {what}")]
    ModelChanged {
        /// The rank reporting.
        rank: usize,
        /// The first difference, naming the parameter.
        what: String,
    },
}
