//! The 16-bit wire formats of the compressed allreduce, and their error bounds: pure data, so
//! plans (which live in `proto`) can name them.

/// How [`NexarClient::all_reduce_compressed`](crate::NexarClient::all_reduce_compressed) encodes `f32` elements on the wire.
///
/// ```
/// use nexar::Compression;
/// // 4 ranks whose contributions to one element add up to 10.0 in magnitude:
/// assert!(Compression::Bf16.sum_error_bound(4, 10.0) < 0.16);
/// assert!(Compression::F16.sum_error_bound(4, 10.0) < 0.02);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Compression {
    /// bfloat16: `f32`'s range, 8 significant bits (unit roundoff 2⁻⁸). For gradients.
    Bf16,
    /// IEEE half precision: 11 significant bits (unit roundoff 2⁻¹¹), values within ±65504;
    /// a result beyond that fails with [`CollectiveError::Overflow`](crate::CollectiveError::Overflow).
    F16,
}

impl Compression {
    /// The unit roundoff `u` of the wire format: the largest relative error of one rounding.
    ///
    /// ```
    /// assert_eq!(nexar::Compression::Bf16.unit_roundoff(), 1.0 / 256.0);
    /// ```
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Compression::Bf16 => 2f64.powi(-8),
            Compression::F16 => 2f64.powi(-11),
        }
    }

    /// Half the spacing of the format's smallest (subnormal) values: the absolute error of a
    /// rounding near zero, where the relative bound does not hold.
    pub(crate) fn underflow(self) -> f64 {
        match self {
            Compression::Bf16 => 2f64.powi(-134),
            Compression::F16 => 2f64.powi(-25),
        }
    }

    /// A bound on `|result - exact|` for one element of a `Sum` over `ranks` ranks whose
    /// contributions to that element add up to `magnitude` in absolute value (`Σ|xᵢ|`):
    /// `γ·magnitude + ranks·η`, with `γ = n·u / (1 - n·u)` (Higham's bound for `n` roundings
    /// of a sum, whatever the order), `u` the [unit roundoff](Self::unit_roundoff) and `η`
    /// the format's underflow. Each contribution is rounded once, and each partial sum once
    /// more, so an element sees at most `ranks` roundings. `Max` and `Min` are rounded once:
    /// their error is at most `u·|result|`.
    ///
    /// ```
    /// let bound = nexar::Compression::Bf16.sum_error_bound(2, 1.0);
    /// assert!(bound > 2.0 / 256.0 && bound < 2.1 / 256.0);
    /// ```
    pub fn sum_error_bound(self, ranks: usize, magnitude: f64) -> f64 {
        let nu = ranks as f64 * self.unit_roundoff();
        let gamma = if nu < 1.0 { nu / (1.0 - nu) } else { f64::INFINITY };
        gamma * magnitude + ranks as f64 * self.underflow()
    }

    /// Lower-case name, as `explain` and errors write it.
    pub fn name(self) -> &'static str {
        match self {
            Compression::Bf16 => "bf16",
            Compression::F16 => "f16",
        }
    }
}
