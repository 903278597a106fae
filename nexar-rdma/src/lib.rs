//! RDMA and GPU-memory back ends for nexar.
//!
//! The ibverbs transport and the CUDA adapter arrive with the hardware back-end work. Until then
//! this crate only reports which back ends it was built with.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// Names of the optional back ends compiled into this build (none yet).
///
/// ```
/// assert!(nexar_rdma::compiled_backends().is_empty());
/// ```
pub fn compiled_backends() -> &'static [&'static str] {
    &[]
}
