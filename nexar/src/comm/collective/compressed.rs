//! The compressed allreduce: `f32` elements travel as 16-bit floats (half the bytes on the
//! wire) and every partial result is accumulated in `f32` and rounded once to 16 bits before it
//! travels on, so the result's error has a bound a program can check against
//! ([`Compression::sum_error_bound`]).
//!
//! It runs as a reduce-scatter of the 16-bit elements (each rank ends with the reduction of
//! one block), then an all-gather of the reduced blocks, which copies them exactly.

use nexar_types::{Element, RecvBuf, ReduceOp, Reduction, bf16, f16};

use super::CollectiveError;
use crate::NexarClient;

/// How [`NexarClient::all_reduce_compressed`] encodes `f32` elements on the wire.
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
    /// a result beyond that fails with [`CollectiveError::Overflow`].
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
    fn underflow(self) -> f64 {
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

    fn name(self) -> &'static str {
        match self {
            Compression::Bf16 => "bf16",
            Compression::F16 => "f16",
        }
    }
}

/// A 16-bit wire format for `f32` elements, converted a slice at a time (`half`'s slice
/// conversions, which use the CPU's conversion instructions where it has them).
trait Wire16: Element {
    fn encode(from: &[f32], to: &mut [Self]);
    fn decode(from: &[Self], to: &mut [f32]);
    fn is_finite(self) -> bool;
    fn value(self) -> f32;
}

macro_rules! wire16 {
    ($($t:ty),*) => {$(
        impl Wire16 for $t {
            fn encode(from: &[f32], to: &mut [Self]) {
                use half::slice::HalfFloatSliceExt;
                to.convert_from_f32_slice(from);
            }
            fn decode(from: &[Self], to: &mut [f32]) {
                use half::slice::HalfFloatSliceExt;
                from.convert_to_f32_slice(to);
            }
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            fn value(self) -> f32 {
                self.to_f32()
            }
        }
    )*};
}

wire16!(bf16, f16);

const OP: &str = "all_reduce_compressed";

impl NexarClient {
    /// Allreduces `f32` elements sent as 16-bit floats: half the bytes of
    /// [`all_reduce`](Self::all_reduce) on the wire, at a documented cost in precision
    /// ([`Compression::sum_error_bound`]). `Sum`, `Max` and `Min` are supported; every rank
    /// calls it with the same length, reduction and compression, and gets the same result.
    ///
    /// ```no_run
    /// use nexar::{Compression, NexarClient, Sum};
    /// # async fn run(comm: NexarClient) -> Result<(), nexar::CollectiveError> {
    /// let mut grads = vec![0.5f32; 1 << 20];
    /// comm.all_reduce_compressed(&mut grads, Sum, Compression::Bf16).await?;
    /// # Ok(()) }
    /// ```
    pub async fn all_reduce_compressed<B, O>(
        &self,
        buf: &mut B,
        op: O,
        compression: Compression,
    ) -> Result<(), CollectiveError>
    where
        B: RecvBuf<Elem = f32> + ?Sized,
        O: Reduction<f32>,
    {
        let rank = self.rank();
        let op = op.op();
        if !matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min) {
            return Err(CollectiveError::InvalidArgument {
                rank,
                op: OP,
                reason: format!(
                    "{} is not offered compressed (a product's error grows with its factors): use Sum, Max or Min",
                    op.name()
                ),
            });
        }
        let mut stage = buf.host_stage().map_err(|source| CollectiveError::Device { rank, op: OP, source })?;
        self.lengths_agree(stage.len()).await?;
        match compression {
            Compression::Bf16 => self.reduce_as::<bf16>(&mut stage, op, compression).await?,
            Compression::F16 => self.reduce_as::<f16>(&mut stage, op, compression).await?,
        }
        stage.commit().map_err(|source| CollectiveError::Device { rank, op: OP, source })
    }

    /// Every rank's buffer has `len` elements (the reduce-scatter's blocks could hide a
    /// difference smaller than the world size): one small allreduce of the length and its
    /// complement, whose maxima tell the largest and the smallest length.
    async fn lengths_agree(&self, len: usize) -> Result<(), CollectiveError> {
        let mut lens = [len as u64, !(len as u64)];
        self.all_reduce(&mut lens[..], nexar_types::Max).await?;
        let (largest, smallest) = (lens[0], !lens[1]);
        if largest != smallest {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank(),
                op: OP,
                reason: format!(
                    "ranks disagree on the length: buffers of {smallest} to {largest} elements (this rank: {len})"
                ),
            });
        }
        Ok(())
    }

    async fn reduce_as<W: Wire16>(
        &self,
        data: &mut [f32],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<(), CollectiveError> {
        let world = self.world_size();
        let block = data.len().div_ceil(world).max(1);
        let mut wire: Vec<W> = vec![W::zeroed(); block * world];
        W::encode(data, &mut wire[..data.len()]);
        let mut mine = vec![W::zeroed(); block];
        self.reduce_scatter(&wire[..], &mut mine[..], op).await?;
        self.all_gather(&mine[..], &mut wire[..]).await?;
        if compression == Compression::F16
            && let Some(i) = wire[..data.len()].iter().position(|w| !w.is_finite())
        {
            return Err(CollectiveError::Overflow {
                rank: self.rank(),
                op: OP,
                what: format!(
                    "element {i} is {} after the {} reduction: beyond f16's range (±65504), or a contribution was not finite; use Compression::Bf16",
                    wire[i].value(),
                    compression.name()
                ),
            });
        }
        W::decode(&wire[..data.len()], data);
        Ok(())
    }
}
