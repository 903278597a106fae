//! What NCCL calls the element types and reductions nexar has (no I/O, no `unsafe`).

use cudarc::nccl::sys;

use crate::element::{DType, Element};
use crate::op::ReduceOp;

/// Whether NCCL can run a collective on elements of `dtype` with reduction `op` (`None` for a
/// collective that reduces nothing): NCCL has no 16-bit integers and no bitwise reductions.
///
/// ```
/// use nexar_types::{DType, ReduceOp, nccl_supports};
/// assert!(nccl_supports(DType::BF16, Some(ReduceOp::Sum)));
/// assert!(!nccl_supports(DType::U16, None));
/// assert!(!nccl_supports(DType::U32, Some(ReduceOp::BitXor)));
/// ```
pub fn nccl_supports(dtype: DType, op: Option<ReduceOp>) -> bool {
    nccl_dtype(dtype).is_some() && op.is_none_or(|op| nccl_op(op).is_some())
}

/// The NCCL type of elements of `dtype`, if NCCL has one (it has none for 16-bit integers).
pub(crate) fn nccl_dtype(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as N;
    Some(match dtype {
        DType::F32 => N::ncclFloat32,
        DType::F64 => N::ncclFloat64,
        DType::F16 => N::ncclFloat16,
        DType::BF16 => N::ncclBfloat16,
        DType::I8 => N::ncclInt8,
        DType::U8 => N::ncclUint8,
        DType::I32 => N::ncclInt32,
        DType::U32 => N::ncclUint32,
        DType::I64 => N::ncclInt64,
        DType::U64 => N::ncclUint64,
        DType::I16 | DType::U16 => return None,
    })
}

/// The NCCL reduction for `op`, if NCCL has one (it has no bitwise ones).
pub(crate) fn nccl_op(op: ReduceOp) -> Option<sys::ncclRedOp_t> {
    use sys::ncclRedOp_t as N;
    Some(match op {
        ReduceOp::Sum => N::ncclSum,
        ReduceOp::Prod => N::ncclProd,
        ReduceOp::Min => N::ncclMin,
        ReduceOp::Max => N::ncclMax,
        _ => return None,
    })
}

/// The NCCL type of `T`, for an operand already checked to have one.
pub(crate) fn buf_type<T: Element>() -> sys::ncclDataType_t {
    // Operands exist only for element types NCCL has (`NcclOperand::of`).
    nccl_dtype(T::DTYPE).unwrap_or(sys::ncclDataType_t::ncclUint8)
}
