//! Reductions on the GPU (feature `cuda`): `acc[i] = op(acc[i], other[i])` over two device
//! buffers, by a kernel generated for each element type and operation, compiled at run time
//! with NVRTC (loaded dynamically, like the driver) and cached per device.
//!
//! The kernels compute exactly what the host kernels of [`reduce_slice`](crate::reduce_slice)
//! compute: integers wrap, `Min`/`Max` keep the accumulator unless the other operand compares
//! smaller/greater (so NaN handling matches), and `f16`/`bf16` are widened to `f32`, combined,
//! and rounded back to nearest-even.
//!
//! Where this runs: a collective on a `Buf<T, Cuda>` stages the buffer through host memory
//! ([`CudaAdapter`](crate::CudaAdapter)), so its operands are on the host when they are
//! combined and the host kernels reduce them; copying them to the GPU to add them would only
//! add two transfers. The GPU kernel is for operands that are both in device memory already:
//! [`Buf::reduce_from`] (accumulating gradients of micro-batches, combining the result of a
//! collective with a local buffer) and receives that land in device memory.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use crate::buf::{Buf, DeviceError};
use crate::cuda::{context, driver};
use crate::element::{DType, Element};
use crate::op::{ReduceError, ReduceOp, Reduction};
use crate::space::Cuda;

/// Threads per block of a reduction launch.
const BLOCK_THREADS: u32 = 256;
/// Most blocks of one launch; each thread strides over the rest.
const MAX_BLOCKS: u32 = 4096;

/// How elements of one [`DType`] are stored and combined in CUDA C.
struct CType {
    /// The storage type.
    storage: &'static str,
    /// The type the operation is computed in (`float` for the half types).
    compute: &'static str,
    /// The unsigned type integer sums and products wrap in (none for floating point).
    wrap: Option<&'static str>,
    /// Functions that widen from and narrow to storage, for the half types.
    widen: Option<(&'static str, &'static str)>,
}

fn c_type(dtype: DType) -> CType {
    let int = |storage, wrap| CType { storage, compute: storage, wrap: Some(wrap), widen: None };
    let float = |storage| CType { storage, compute: storage, wrap: None, widen: None };
    match dtype {
        DType::F32 => float("float"),
        DType::F64 => float("double"),
        DType::F16 => CType {
            storage: "unsigned short",
            compute: "float",
            wrap: None,
            widen: Some(("nexar_f16_to_f32", "nexar_f32_to_f16")),
        },
        DType::BF16 => CType {
            storage: "unsigned short",
            compute: "float",
            wrap: None,
            widen: Some(("nexar_bf16_to_f32", "nexar_f32_to_bf16")),
        },
        // Narrow integers wrap through `unsigned int`: promoting them to `int` could overflow.
        DType::I8 => int("signed char", "unsigned int"),
        DType::I16 => int("short", "unsigned int"),
        DType::I32 => int("int", "unsigned int"),
        DType::I64 => int("long long", "unsigned long long"),
        DType::U8 => int("unsigned char", "unsigned int"),
        DType::U16 => int("unsigned short", "unsigned int"),
        DType::U32 => int("unsigned int", "unsigned int"),
        DType::U64 => int("unsigned long long", "unsigned long long"),
    }
}

/// Conversions between `f32` and the half types, without CUDA headers: PTX `cvt` for `f16`,
/// bit arithmetic for `bf16` (round to nearest-even, NaN kept quiet, as the `half` crate does).
const HALF_HELPERS: &str = r#"
__device__ __forceinline__ float nexar_f16_to_f32(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short nexar_f32_to_f16(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float nexar_bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short nexar_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
"#;

/// The name of the kernel for `dtype` and `op`.
fn kernel_name(dtype: DType, op: ReduceOp) -> String {
    format!("nexar_reduce_{}_{}", dtype.name(), op.name())
}

/// The CUDA C expression combining `a` and `b` (both of the compute type) with `op`.
fn combine(ty: &CType, op: ReduceOp) -> String {
    let (c, s) = (ty.compute, ty.storage);
    match (op, ty.wrap) {
        (ReduceOp::Sum, Some(w)) => format!("({s})(({w})a + ({w})b)"),
        (ReduceOp::Prod, Some(w)) => format!("({s})(({w})a * ({w})b)"),
        (ReduceOp::Sum, None) => format!("({c})(a + b)"),
        (ReduceOp::Prod, None) => format!("({c})(a * b)"),
        (ReduceOp::Min, _) => "(b < a) ? b : a".into(),
        (ReduceOp::Max, _) => "(b > a) ? b : a".into(),
        (ReduceOp::BitAnd, _) => format!("({s})(a & b)"),
        (ReduceOp::BitOr, _) => format!("({s})(a | b)"),
        (ReduceOp::BitXor, _) => format!("({s})(a ^ b)"),
    }
}

/// The CUDA C source of the kernel that reduces `other` into `acc` with `op`, for elements of
/// `dtype`: `extern "C" __global__ void nexar_reduce_<dtype>_<op>(acc, other, n)`.
///
/// A bitwise operation on floating-point elements is an error, as on the host.
///
/// ```
/// use nexar_types::{DType, ReduceOp, reduce_kernel_source};
/// let src = reduce_kernel_source(DType::I32, ReduceOp::Sum).unwrap();
/// assert!(src.contains("nexar_reduce_i32_sum"));
/// assert!(reduce_kernel_source(DType::F32, ReduceOp::BitXor).is_err());
/// ```
pub fn reduce_kernel_source(dtype: DType, op: ReduceOp) -> Result<String, ReduceError> {
    if !op.supports(dtype) {
        return Err(ReduceError::Unsupported { op, dtype });
    }
    let ty = c_type(dtype);
    let (load_a, load_b, store) = match ty.widen {
        Some((widen, narrow)) => (format!("{widen}(acc[i])"), format!("{widen}(other[i])"), format!("{narrow}(r)")),
        None => ("acc[i]".into(), "other[i]".into(), "r".into()),
    };
    let mut src = String::new();
    if ty.widen.is_some() {
        src.push_str(HALF_HELPERS);
    }
    let (s, c) = (ty.storage, ty.compute);
    let _ = write!(
        src,
        r#"
extern "C" __global__ void {name}({s}* __restrict__ acc, const {s}* __restrict__ other, unsigned long long n) {{
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {{
        {c} a = {load_a};
        {c} b = {load_b};
        {c} r = {expr};
        acc[i] = {store};
    }}
}}
"#,
        name = kernel_name(dtype, op),
        expr = combine(&ty, op),
    );
    Ok(src)
}

/// Whether the NVRTC library can be loaded on this host (checked once).
fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: this only tries to load the NVRTC library and reports whether it loaded;
        // none of its functions is called here (cudarc's would panic if it were missing).
        #[cfg(not(feature = "cuda-linked"))]
        #[allow(unsafe_code)]
        unsafe {
            cudarc::nvrtc::sys::is_culib_present()
        }
        // Linked when the program was built: it would not have started without the library.
        #[cfg(feature = "cuda-linked")]
        true
    })
}

/// Compiles the reduction kernel for `dtype` and `op` to PTX with NVRTC. Needs the NVRTC
/// library (`libnvrtc.so`), not a GPU.
///
/// ```no_run
/// use nexar_types::{DType, ReduceOp, compile_reduce_kernel};
/// let ptx = compile_reduce_kernel(DType::BF16, ReduceOp::Sum)?;
/// assert!(ptx.contains(".entry nexar_reduce_bf16_sum"));
/// # Ok::<(), nexar_types::DeviceError>(())
/// ```
pub fn compile_reduce_kernel(dtype: DType, op: ReduceOp) -> Result<String, DeviceError> {
    Ok(compile(dtype, op)?.to_src())
}

fn compile(dtype: DType, op: ReduceOp) -> Result<cudarc::nvrtc::Ptx, DeviceError> {
    let src = reduce_kernel_source(dtype, op)?;
    if !nvrtc_present() {
        return Err(DeviceError::Unavailable {
            reason: "no NVRTC library (libnvrtc.so) was found on this host to compile GPU reduction kernels".into(),
        });
    }
    // No flush-to-zero: subnormals combine as they do on the host.
    let opts =
        CompileOptions { ftz: Some(false), name: Some(format!("{}.cu", kernel_name(dtype, op))), ..Default::default() };
    compile_ptx_with_opts(&src, opts)
        .map_err(|e| DeviceError::Compile { kernel: kernel_name(dtype, op), log: e.to_string() })
}

/// The loaded kernel for `(device, dtype, op)`, compiled and loaded once per process.
fn kernel(device: usize, dtype: DType, op: ReduceOp) -> Result<CudaFunction, DeviceError> {
    type Cache = Mutex<HashMap<(usize, DType, ReduceOp), CudaFunction>>;
    static KERNELS: OnceLock<Cache> = OnceLock::new();
    let cache = KERNELS.get_or_init(Default::default);
    if let Some(f) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&(device, dtype, op)) {
        return Ok(f.clone());
    }
    let ptx = compile(dtype, op)?;
    let fail = driver("loading a reduction kernel", device);
    let module = context(device)?.load_module(ptx).map_err(&fail)?;
    let f = module.load_function(&kernel_name(dtype, op)).map_err(fail)?;
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert((device, dtype, op), f.clone());
    Ok(f)
}

/// The launch shape for `n` elements: full blocks up to [`MAX_BLOCKS`], then striding.
fn launch_config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK_THREADS as usize).clamp(1, MAX_BLOCKS as usize) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 }
}

impl<T: Element> Buf<T, Cuda> {
    /// Reduces `other` into this buffer on the GPU: `self[i] = op(self[i], other[i])`, with
    /// the same results as the host kernels. Both buffers must be on the same device and
    /// equally long. Returns once the kernel has finished.
    ///
    /// The kernel is compiled with NVRTC on first use for each element type and operation.
    ///
    /// ```no_run
    /// use nexar_types::{Buf, Cuda, Sum};
    /// let mut acc = Buf::<f32, Cuda>::from_host(0, &[1.0, 2.0])?;
    /// let grads = Buf::<f32, Cuda>::from_host(0, &[0.5, 0.5])?;
    /// acc.reduce_from(&grads, Sum)?;
    /// assert_eq!(acc.to_host()?, vec![1.5, 2.5]);
    /// # Ok::<(), nexar_types::DeviceError>(())
    /// ```
    pub fn reduce_from<O: Reduction<T>>(&mut self, other: &Buf<T, Cuda>, op: O) -> Result<(), DeviceError> {
        let op = op.op();
        if !op.supports(T::DTYPE) {
            return Err(ReduceError::Unsupported { op, dtype: T::DTYPE }.into());
        }
        if self.len() != other.len() {
            return Err(ReduceError::LengthMismatch { left: self.len(), right: other.len() }.into());
        }
        let device = self.device();
        if other.device() != device {
            return Err(DeviceError::CrossDevice { acc: device, other: other.device() });
        }
        let n = self.len();
        if n == 0 {
            return Ok(());
        }
        let f = kernel(device, T::DTYPE, op)?;
        let fail = driver("reducing on the device", device);
        let (src, src_stream, _) = other.storage.parts();
        let src_stream: Arc<_> = src_stream.clone();
        let (acc, stream) = self.storage.parts_mut();
        // The kernel reads `other` after every copy already queued on its stream.
        if !Arc::ptr_eq(&stream, &src_stream) {
            stream.join(&src_stream).map_err(&fail)?;
        }
        let len = n as u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(acc).arg(src).arg(&len);
        // SAFETY: the kernel was generated for `T` (its storage type has `T`'s size and
        // layout), takes exactly these three arguments (accumulator, operand, element count),
        // and touches indices below `n`, the length of both slices (checked above).
        #[allow(unsafe_code)]
        unsafe {
            launch.launch(launch_config(n)).map_err(&fail)?;
        }
        // Nothing runs on these buffers after this call returns.
        stream.synchronize().map_err(fail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_pair_has_a_kernel_and_bitwise_floats_have_none() {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                let src = reduce_kernel_source(dtype, op);
                if op.supports(dtype) {
                    let src = src.unwrap();
                    assert!(src.contains(&format!("void {}(", kernel_name(dtype, op))), "{src}");
                    assert_eq!(src.contains("nexar_f32_to_f16(r)"), dtype == DType::F16);
                    assert_eq!(src.contains("nexar_f32_to_bf16(r)"), dtype == DType::BF16);
                } else {
                    assert_eq!(src.unwrap_err(), ReduceError::Unsupported { op, dtype });
                }
            }
        }
    }

    #[test]
    fn narrow_integer_products_wrap_in_unsigned_arithmetic() {
        let src = reduce_kernel_source(DType::I16, ReduceOp::Prod).unwrap();
        assert!(src.contains("(short)((unsigned int)a * (unsigned int)b)"), "{src}");
        let src = reduce_kernel_source(DType::U64, ReduceOp::Sum).unwrap();
        assert!(src.contains("(unsigned long long)a + (unsigned long long)b"), "{src}");
    }

    #[test]
    fn launches_cover_every_element() {
        for n in [1usize, 255, 256, 257, 1 << 20, (MAX_BLOCKS as usize) * 256 * 3 + 1] {
            let c = launch_config(n);
            let threads = c.grid_dim.0 as usize * c.block_dim.0 as usize;
            assert!(threads >= n.min(MAX_BLOCKS as usize * BLOCK_THREADS as usize), "{n}");
            assert!(c.grid_dim.0 <= MAX_BLOCKS);
        }
    }

    /// With NVRTC present (CI installs it from PyPI), every kernel compiles to PTX with its
    /// entry point; without it, a clear error. No GPU is needed either way.
    #[test]
    fn every_kernel_compiles_with_nvrtc_or_reports_why_not() {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
                match compile_reduce_kernel(dtype, op) {
                    Ok(ptx) => {
                        assert!(ptx.contains(&format!(".entry {}", kernel_name(dtype, op))), "{ptx}");
                        if let Some(dir) = std::env::var_os("NEXAR_PTX_DIR") {
                            let path = std::path::Path::new(&dir).join(format!("{}.ptx", kernel_name(dtype, op)));
                            std::fs::write(path, &ptx).unwrap();
                        }
                    }
                    Err(DeviceError::Unavailable { reason }) => {
                        assert!(reason.contains("NVRTC"), "{reason}");
                        // CI installs NVRTC and sets this, so the kernels are compiled there.
                        assert!(std::env::var_os("NEXAR_REQUIRE_NVRTC").is_none(), "{reason}");
                    }
                    Err(e) => panic!("{} did not compile: {e}", kernel_name(dtype, op)),
                }
            }
        }
        assert!(matches!(
            compile_reduce_kernel(DType::F64, ReduceOp::BitAnd),
            Err(DeviceError::Reduce(ReduceError::Unsupported { .. }))
        ));
    }

    /// With a GPU: every element type and operation gives exactly the host kernel's result.
    /// Without one: a clear error.
    #[test]
    fn device_reductions_match_the_host_or_report_why_not() {
        let data: Vec<i64> = (0..100_003).map(|i| (i * 7919) % 2001 - 1000).collect();
        let other: Vec<i64> = data.iter().rev().copied().collect();
        macro_rules! check {
            ($t:ty, $conv:expr) => {{
                let conv = $conv;
                let a: Vec<$t> = data.iter().map(|v| conv(*v)).collect();
                let b: Vec<$t> = other.iter().map(|v| conv(*v)).collect();
                for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(<$t>::DTYPE)) {
                    let mut want = a.clone();
                    crate::reduce_slice(op, &mut want, &b).unwrap();
                    let mut acc = match Buf::<$t, Cuda>::from_host(0, &a) {
                        Ok(acc) => acc,
                        Err(e) => {
                            let text = e.to_string();
                            assert!(text.contains("CUDA driver") || text.contains("does not exist"), "{text}");
                            return;
                        }
                    };
                    let src = Buf::<$t, Cuda>::from_host(0, &b).unwrap();
                    acc.reduce_from(&src, op).unwrap();
                    let got = acc.to_host().unwrap();
                    assert!(
                        bytemuck::cast_slice::<$t, u8>(&got) == bytemuck::cast_slice::<$t, u8>(&want),
                        "{} {op}",
                        <$t>::DTYPE
                    );
                }
            }};
        }
        check!(f32, |v: i64| v as f32 * 0.37);
        check!(f64, |v: i64| v as f64 * 1e-3);
        check!(crate::f16, |v: i64| crate::f16::from_f32(v as f32 * 0.013));
        check!(crate::bf16, |v: i64| crate::bf16::from_f32(v as f32 * 0.77));
        check!(i8, |v: i64| v as i8);
        check!(i16, |v: i64| (v * 31) as i16);
        check!(i32, |v: i64| (v * 99_991) as i32);
        check!(i64, |v: i64| v.wrapping_mul(0x9e37_79b9_7f4a_7c15u64 as i64));
        check!(u8, |v: i64| v as u8);
        check!(u16, |v: i64| (v * 37) as u16);
        check!(u32, |v: i64| (v * 65_537) as u32);
        check!(u64, |v: i64| (v as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut a = Buf::<f32, Cuda>::zeros_on(0, 4).unwrap();
        let b = Buf::<f32, Cuda>::zeros_on(0, 5).unwrap();
        assert!(matches!(
            a.reduce_from(&b, crate::Sum),
            Err(DeviceError::Reduce(ReduceError::LengthMismatch { left: 4, right: 5 }))
        ));
    }
}
