//! Types shared by the nexar runtime and its macros.
//!
//! - [`Element`]: the plain-old-data element types nexar moves, each with a wire [`DType`].
//! - Reduction operations as types ([`Sum`], [`Prod`], [`Min`], [`Max`], [`BitAnd`], [`BitOr`],
//!   [`BitXor`]) so that a bitwise reduction of floats fails to compile, plus the runtime
//!   [`ReduceOp`] for operations chosen at run time.
//! - Memory spaces as types ([`Host`]) and the typed, owned buffer [`Buf<T, M>`], with the
//!   [`DeviceAdapter`] of each space that moves elements to host memory and back.
//! - [`SendBuf`] / [`RecvBuf`]: the one pair of traits through which `Buf<T>`, `Vec<T>`, `[T]` and
//!   `[T; N]` reach every operation.
//! - [`stable_id`]: the `const fn` hash that turns names into stable 64-bit ids.
//!
//! ```
//! use nexar_types::{Buf, DType, Element, Sum, ReduceOp, Reduction};
//!
//! let b: Buf<f32> = Buf::from_vec(vec![1.0, 2.0, 3.0]);
//! assert_eq!(b.len(), 3);
//! assert_eq!(<f32 as Element>::DTYPE, DType::F32);
//! assert_eq!(Reduction::<f32>::op(&Sum), ReduceOp::Sum);
//! ```
// `unsafe` is denied but for a few modules that allow it. Always: calling the element-wise
// kernels compiled for AVX2 or AVX-512 once the CPU is known to have them (`simd.rs`). Behind
// the `cuda` feature: asking whether the CUDA driver library can be
// loaded (`cuda.rs`), zeroing freshly allocated pinned host memory (`cuda_adapter.rs`), and
// loading NVRTC and launching the generated reduction kernels (`cuda_reduce.rs`), and calling
// libnccl (`nccl.rs`, feature `nccl`).
#![deny(unsafe_code)]
#![warn(missing_docs)]
// docs.rs (`--cfg docsrs`, nightly) marks each item that needs a feature with that feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod adapter;
mod bf16_wire;
mod buf;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_adapter;
#[cfg(feature = "cuda")]
mod cuda_reduce;
#[cfg(feature = "cuda")]
mod cuda_segments;
mod element;
mod id;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "nccl")]
mod nccl_buffers;
#[cfg(feature = "nccl")]
mod nccl_in_flight;
#[cfg(feature = "nccl")]
mod nccl_missing;
#[cfg(feature = "nccl")]
mod nccl_types;
mod op;
mod segments;
mod simd;
mod space;

pub use adapter::{CpuAdapter, DeviceAdapter};
pub use bf16_wire::{narrow_to_bf16, reduce_f32_as_bf16, reduce_f32_with_bf16, widen_bf16};
pub use buf::{Buf, DeviceError, HostStage, HostView, RecvBuf, SendBuf, WriteBack};
#[cfg(feature = "cuda")]
pub use cuda::{CudaStorage, DeviceSpan, cuda_device_count};
#[cfg(feature = "cuda")]
pub use cuda_adapter::{CudaAdapter, DEFAULT_CHUNK_BYTES};
#[cfg(feature = "cuda")]
pub use cuda_reduce::{compile_reduce_kernel, reduce_kernel_source};
pub use element::{DType, Element, UnknownDType};
pub use id::{stable_hash, stable_id};
#[cfg(feature = "nccl")]
pub use nccl::{
    DeviceWindow, NcclComm, NcclId, NcclInFlight, NcclOperand, NcclScratch, NcclSource, nccl_supports, nccl_version,
};
pub use op::{BitAnd, BitOr, BitXor, Max, Min, Prod, ReduceError, ReduceOp, Reduction, Sum, reduce, reduce_slice};
pub use segments::{SegmentStage, WholeStage, segment_ranges};
#[cfg(feature = "cuda")]
pub use space::Cuda;
pub use space::{Host, MemorySpace};

/// Re-exported so generated code and users name the same `half` types.
pub use half::{bf16, f16};
