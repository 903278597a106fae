//! The compressed allreduce: `f32` elements travel as 16-bit floats (half the bytes on the
//! wire) and every partial result is accumulated in `f32` and rounded once to 16 bits before it
//! travels on, so the result's error has a bound a program can check against
//! ([`Compression::sum_error_bound`]).
//!
//! bf16 runs the allreduce on the caller's `f32` buffer itself, the executor converting each
//! message as it sends it and each received block as it reads it ([`Bf16Wire`]): no pass over
//! the buffer to encode it first or to decode the result, which on a machine whose memory
//! bandwidth is the limit cost more than the halved payload saved. Its kernels round every
//! operand and every result to bf16, so the result has the bits an allreduce of the
//! bf16-rounded buffers would have, whichever algorithm runs.
//!
//! f16 runs as an allreduce of a 16-bit copy, decoded once every segment is done, so that a sum
//! beyond f16's range fails with the buffer as it was (bf16 has `f32`'s range).

use nexar_types::{Element, RecvBuf, ReduceOp, Reduction, f16, segment_ranges};

use super::CollectiveError;
use crate::comm::NexarClient;
use crate::comm::exec::CollCall;
use crate::comm::exec::pieces::Data;
use crate::comm::exec::wire_codec::Bf16Wire;
use crate::proto::algo::Collective;

pub use crate::proto::compression::Compression;

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

wire16!(f16);

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
        match compression {
            // Every message's header carries the whole length, which the receiver checks.
            Compression::Bf16 => self.reduce_through_bf16(&mut stage, op).await?,
            Compression::F16 => {
                self.lengths_agree(stage.len()).await?;
                self.reduce_as::<f16>(&mut stage, op, compression).await?
            }
        }
        let done = stage.commit().map_err(|source| CollectiveError::Device { rank, op: OP, source });
        self.reported(OP, done)
    }

    /// Every rank's buffer has `len` elements (the f16 path's segments are allreduces of their
    /// own, whose headers carry only the segment's length: a rank with one segment more would
    /// wait for a partner that never comes): one small allreduce of the length and its
    /// complement, whose maxima tell the largest and the smallest length.
    async fn lengths_agree(&self, len: usize) -> Result<(), CollectiveError> {
        let mut lens = [len as u64, !(len as u64)];
        self.staged(Collective::AllReduce, Some(ReduceOp::Max), &mut lens[..]).await?;
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

    /// The allreduce of `data` with bf16 on the wire, run on `data` itself in segments of the
    /// configured size ([`NexarConfig::segment_bytes`](crate::NexarConfig::segment_bytes),
    /// counted in `f32` bytes) under one sequence number, as a plain allreduce's are; the size
    /// table picks the algorithm for the bytes on the wire. A failure leaves the segments done
    /// reduced, as a plain allreduce does.
    async fn reduce_through_bf16(&self, data: &mut [f32], op: ReduceOp) -> Result<(), CollectiveError> {
        let kind = Collective::AllReduce;
        let total = data.len();
        let seq = self.comm.next_seq();
        let segment = self.segment_len::<f32>(kind, total);
        let ranges: Vec<_> = segment_ranges(total, segment.unwrap_or(total.max(1))).collect();
        for (part, range) in ranges.into_iter().enumerate() {
            let call = CollCall {
                kind,
                op: Some(op),
                count: range.len() as u64,
                total: total as u64,
                fingerprint: 0,
                segment: segment.unwrap_or(0) as u64,
                part: part as u32,
            };
            let schedule = self.schedule_for::<nexar_types::bf16>(seq, &call, None)?;
            let mut piece = Data::Flat(&mut data[range]);
            self.execute::<f32, Bf16Wire>(seq, call, &schedule, &mut piece, &[]).await?;
        }
        if self.world_size() == 1 {
            // No message: round here, as every element would have been on its way.
            for x in data.iter_mut() {
                *x = nexar_types::bf16::from_f32(*x).to_f32();
            }
        }
        Ok(())
    }

    /// The reduction of `data` as `W` on the wire, in segments of the configured size
    /// ([`NexarConfig::segment_bytes`](crate::NexarConfig::segment_bytes), counted in `f32`
    /// bytes): each segment is encoded and allreduced as `W` (the size table picks the
    /// algorithm, as for any allreduce), in a buffer from the rank's pool (no fresh pages per
    /// call). The reduced 16-bit values are decoded into `data` only once every segment is
    /// done, so a failure (an f16 overflow included) leaves `data` as it was.
    async fn reduce_as<W: Wire16>(
        &self,
        data: &mut [f32],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<(), CollectiveError> {
        let n = data.len();
        let segment = match self.config().segment_bytes / size_of::<f32>() {
            0 => n,
            elems => elems,
        }
        .max(1);
        let mut wire_loan = self.inner.pool.lend(n * size_of::<W>());
        let wire: &mut [W] = wire_loan.slice_mut(n);
        for (from, to) in data.chunks(segment).zip(wire.chunks_mut(segment)) {
            W::encode(from, to);
            self.staged(Collective::AllReduce, Some(op), &mut *to).await?;
        }
        if compression == Compression::F16
            && let Some(i) = wire[..n].iter().position(|w| !w.is_finite())
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
        W::decode(&wire[..n], data);
        Ok(())
    }
}
