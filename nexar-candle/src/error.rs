//! What the candle layer can fail with.

use nexar::ddp::DdpError;

/// Failures of [`Ddp`](crate::Ddp).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// candle failed (reading a gradient, making a tensor).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The data-parallel layer failed; the error names the rank, the step and the parameter or
    /// bucket.
    #[error(transparent)]
    Ddp(#[from] DdpError),
    /// A variable of an element type gradients are not averaged in (integers, fp8).
    #[error("variable `{name}` is {dtype:?}: nexar-candle averages f32, f64, f16 and bf16 gradients")]
    UnsupportedDtype {
        /// The variable.
        name: String,
        /// Its element type.
        dtype: candle_core::DType,
    },
    /// A variable or gradient on a device this crate does not move yet (CUDA, Metal): train on
    /// CPU tensors, or move the gradients to the CPU first.
    #[error("variable `{name}` is on {device}: nexar-candle moves CPU tensors")]
    UnsupportedDevice {
        /// The variable.
        name: String,
        /// Where it is.
        device: String,
    },
}
