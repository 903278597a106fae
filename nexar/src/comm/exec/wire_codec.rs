//! How a collective's elements travel: as they are, or converted to a narrower element type
//! on the wire while the caller's buffer keeps its own. The executor converts a message as it
//! sends it and as it reads it, a cache-sized block at a time, so a compressed allreduce makes
//! no pass of its own over the buffer to encode it or decode the result.

use nexar_types::{Element, ReduceError, ReduceOp, bf16, reduce_slice};

/// The conversion between a buffer of `T` and its elements on the wire.
pub(crate) trait WireCodec<T: Element> {
    /// The element type on the wire: what message headers name and lengths count.
    type Wire: Element;
    /// Elements travel as they are (`Wire` is `T`): sends borrow the caller's bytes.
    const AS_IS: bool;
    /// `to[i] = encode(from[i])`; `to` is as long as `from`.
    fn encode(from: &[T], to: &mut [Self::Wire]);
    /// `to[i] = decode(from[i])`; `to` is as long as `from`.
    fn decode(from: &[Self::Wire], to: &mut [T]);
    /// Combines a received block into `acc`.
    fn reduce_received(op: ReduceOp, acc: &mut [T], block: &[Self::Wire]) -> Result<(), ReduceError>;
    /// Combines two of this rank's own buffers.
    fn reduce_local(op: ReduceOp, acc: &mut [T], other: &[T]) -> Result<(), ReduceError>;
}

/// Elements travel as they are.
pub(crate) struct AsIs;

impl<T: Element> WireCodec<T> for AsIs {
    type Wire = T;
    const AS_IS: bool = true;

    fn encode(from: &[T], to: &mut [T]) {
        to.copy_from_slice(from);
    }

    fn decode(from: &[T], to: &mut [T]) {
        to.copy_from_slice(from);
    }

    fn reduce_received(op: ReduceOp, acc: &mut [T], block: &[T]) -> Result<(), ReduceError> {
        reduce_slice(op, acc, block)
    }

    fn reduce_local(op: ReduceOp, acc: &mut [T], other: &[T]) -> Result<(), ReduceError> {
        reduce_slice(op, acc, other)
    }
}

/// `f32` elements travel as bf16: every operand is rounded to bf16 as it is read and every
/// result as it is stored, so the buffer holds the bits a reduction of bf16 buffers would
/// (`nexar_types::reduce_f32_with_bf16`), whichever algorithm runs.
pub(crate) struct Bf16Wire;

impl WireCodec<f32> for Bf16Wire {
    type Wire = bf16;
    const AS_IS: bool = false;

    fn encode(from: &[f32], to: &mut [bf16]) {
        nexar_types::narrow_to_bf16(from, to);
    }

    fn decode(from: &[bf16], to: &mut [f32]) {
        nexar_types::widen_bf16(from, to);
    }

    fn reduce_received(op: ReduceOp, acc: &mut [f32], block: &[bf16]) -> Result<(), ReduceError> {
        nexar_types::reduce_f32_with_bf16(op, acc, block)
    }

    fn reduce_local(op: ReduceOp, acc: &mut [f32], other: &[f32]) -> Result<(), ReduceError> {
        nexar_types::reduce_f32_as_bf16(op, acc, other)
    }
}
