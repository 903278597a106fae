//! Compiles only if nexar's CUDA support and cudarc with candle-core's features build together.

/// A device buffer of nexar's beside a cudarc type candle uses.
pub fn both(
    _nexar: Option<nexar::Buf<f32, nexar::Cuda>>,
    _candle: Option<std::sync::Arc<cudarc::driver::CudaContext>>,
) {
}
