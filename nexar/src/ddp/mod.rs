//! Data-parallel training: gradient synchronisation in the manner of PyTorch's
//! `DistributedDataParallel`, with no ML framework behind it (`nexar-candle` and framework
//! crates like it are thin layers over this).
//!
//! - **Registration.** [`Ddp::builder`] takes each parameter's name, shape and element type
//!   (`f32`, `f64`, `f16`, `bf16`); [`build`](DdpBuilder::build) checks on every rank that all
//!   ranks registered the same list in the same order, so two equal-sized parameters swapped
//!   between ranks are an error on every rank naming the first one, not silently mixed
//!   gradients.
//! - **Buckets** ([`Layout`]): torch's assignment (reverse registration order, one element type
//!   per bucket, a 1 MiB first bucket, then 25 MiB), the same on every rank.
//! - **Readiness.** [`Ddp::ready`] copies a gradient into its bucket; a complete bucket is sent
//!   at once, in bucket order. [`Ddp::finish`] waits, averages (sum, then divide by the world
//!   size) and lends the averages out ([`Averaged`]).
//! - **Hooks** ([`CommHook`]): plain, bf16/f16 on the wire, top-k with error feedback, and
//!   PowerSGD ([`PowerSgd`]).
//! - **Accumulation**: [`Ddp::no_sync`]. **Broadcast** of parameters and any state from any
//!   rank: [`Ddp::broadcast`], [`Ddp::broadcast_bytes`]. **After a failure**: `recover()`, then
//!   [`Ddp::rebuild`].
//! - **Data**: [`ShardSampler`] (each rank's share of an epoch) and [`mean_over_ranks`].
//!
//! # Synchronous training loops
//!
//! Framework training loops are plain blocking code. The layer's collectives run on the tokio
//! runtime it was built on, in a background task; the `_blocking` calls wait on it from the
//! calling thread. Run the framework's compute on that thread (or the framework's own pool),
//! **not** inside an async task of nexar's runtime: a task that computes for a second keeps
//! its worker from the heartbeats and messages it shares. A runtime with one or two worker
//! threads is enough for the communication; give the framework's pool the rest of the rank's
//! cores ([`crate::affinity::compute_threads`]).
//!
//! ```no_run
//! use nexar::DType;
//! use nexar::ddp::Ddp;
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
//!     let comm = runtime.block_on(nexar::NexarClient::init())?;
//!     let mut ddp = runtime.block_on(Ddp::builder().param("w", &[1024], DType::F32).build(&comm))?;
//!     for _step in 0..10 {
//!         let grad = vec![0.1f32; 1024]; // the framework's backward pass
//!         ddp.ready("w", &grad)?;
//!         let averaged = ddp.finish_blocking()?;
//!         let _w: &[f32] = averaged.get("w")?; // the optimizer's step
//!     }
//!     Ok(())
//! }
//! ```

mod averaged;
mod broadcast;
mod driver;
mod error;
mod flat;
mod hook;
mod layout;
mod params;
mod powersgd;
mod reducer;
mod sampler;

pub use averaged::{Averaged, GradView};
pub use error::DdpError;
pub use flat::GradElement;
pub use hook::CommHook;
pub use layout::{BucketSpec, Layout};
pub use params::{ParamSpec, StepAgreement};
pub use powersgd::PowerSgd;
pub use reducer::{DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, Ddp, DdpBuilder};
pub use sampler::{ShardSampler, mean_over_ranks};
