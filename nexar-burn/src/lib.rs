//! Data-parallel training for [burn](https://burn.dev) over nexar, in the manner of PyTorch's
//! `DistributedDataParallel`: every rank holds the whole model, trains on its share of each
//! batch, and averages the gradients with the others before the optimizer's step. A thin layer
//! over [`nexar::ddp`], which does the bucketing, the ordering, the cross-rank checks and the
//! comm hooks.
//!
//! ```no_run
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::{GradientsParams, SgdConfig};
//! use burn::tensor::{Device, Tensor};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let comm = nexar::NexarClient::init().await?;
//! let device = Device::flex().autodiff();
//! let model: Linear = LinearConfig::new(2, 3).init(&device);
//! // Registers the trainable parameters (checked against every rank) and gives every rank
//! // rank 0's initial weights.
//! let (mut ddp, mut model) = nexar_burn::Ddp::new(model, &comm).await?;
//! let mut optim = SgdConfig::new().init();
//! let x = Tensor::<2>::zeros([8, 2], &device);
//! let loss = model.forward(x).square().mean();
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! let grads = ddp.sync(&model, grads).await?; // every gradient is now the average over the ranks
//! model = optim.step(0.1, model, grads);
//! # Ok(()) }
//! ```
//!
//! # Which parameters
//!
//! The layer walks the model with burn's [`ModuleVisitor`](burn::module::ModuleVisitor): the
//! float parameters, in visit order, which the module's structure fixes, named by their module
//! path (`layers.0.weight`). Those that require a gradient are registered for averaging
//! (nexar checks on every rank that all ranks registered the same names, shapes and element
//! types); every float parameter, trainable or frozen, is broadcast from rank 0 at the start.
//! Integer and boolean parameters are neither.
//!
//! # What overlaps
//!
//! burn computes every gradient in one `backward()` call, and its own gradient hook (a backend's
//! `submit_gradient_sync`, which burn's multi-device strategy uses) belongs to a backend, not
//! to a library beside it, so communication does not start while the backward pass runs, as it
//! does in torch. What does overlap: [`Ddp::sync`] hands the gradients over in bucket order, and
//! each bucket is on the wire while the next ones are copied in. The copies are one from the
//! backend to the host (`into_data`, which a CPU backend may make without copying), one into
//! the bucket and one into each averaged gradient's tensor.
//!
//! # Blocking training loops
//!
//! burn's compute is blocking. Run the training loop on a thread of its own (the program's main
//! thread), not inside an async task, and let a small tokio runtime (one or two worker threads)
//! drive the communication: [`Ddp::new_blocking`] and [`Ddp::sync_blocking`]. Size the
//! backend's thread pool (rayon, for `flex`) to the rank's share of the host,
//! [`nexar::affinity::compute_threads`], not to every core: ranks on one host otherwise
//! oversubscribe it.

#![deny(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod walk;

use std::future::Future;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, TensorData};
use nexar::NexarClient;
use nexar::ddp::{CommHook, Ddp as Reducer, DdpBuilder, GradElement, ParamSpec, StepAgreement};
use nexar::{bf16, f16};

pub use error::Error;
pub use nexar::ddp::{PowerSgd, ShardSampler, mean_over_ranks};

use walk::{Found, Taken};

/// Data-parallel gradient averaging for a burn [`Module`].
///
/// Built from the model and a communicator on every rank; each step,
/// [`sync`](Self::sync) replaces the `GradientsParams` of the model's trainable parameters by
/// their averages over the ranks.
pub struct Ddp {
    reducer: Reducer,
    /// The trainable float parameters as registered (registration index = position).
    registered: Vec<Found>,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp").field("params", &self.registered.len()).field("reducer", &self.reducer).finish()
    }
}

/// Settings of a [`Ddp`]: the bucket caps and the comm hook of [`nexar::ddp`], and the rank whose
/// initial weights every rank starts from.
///
/// ```no_run
/// # async fn run(model: burn::nn::Linear, comm: nexar::NexarClient) -> Result<(), nexar_burn::Error> {
/// use nexar::ddp::CommHook;
/// let (ddp, model) = nexar_burn::Ddp::builder()
///     .hook(CommHook::Compressed(nexar::Compression::Bf16))
///     .bucket_cap_bytes(25 << 20)
///     .build(model, &comm)
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct Builder {
    cap: Option<usize>,
    first_cap: Option<usize>,
    hook: CommHook,
    root: usize,
}

impl Builder {
    /// The bucket cap in bytes (default 25 MiB).
    ///
    /// ```
    /// let builder = nexar_burn::Ddp::builder().bucket_cap_bytes(4 << 20);
    /// ```
    pub fn bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.cap = Some(bytes);
        self
    }

    /// The first bucket's cap in bytes (default 1 MiB).
    ///
    /// ```
    /// let builder = nexar_burn::Ddp::builder().first_bucket_bytes(256 << 10);
    /// ```
    pub fn first_bucket_bytes(mut self, bytes: usize) -> Self {
        self.first_cap = Some(bytes);
        self
    }

    /// The comm hook (default plain averaging).
    ///
    /// ```
    /// use nexar::ddp::CommHook;
    /// let builder = nexar_burn::Ddp::builder().hook(CommHook::PowerSgd(nexar_burn::PowerSgd::default()));
    /// ```
    pub fn hook(mut self, hook: CommHook) -> Self {
        self.hook = hook;
        self
    }

    /// The rank whose initial weights every rank starts from (default 0).
    ///
    /// ```
    /// let builder = nexar_burn::Ddp::builder().root(1);
    /// ```
    pub fn root(mut self, root: usize) -> Self {
        self.root = root;
        self
    }

    /// Registers `model`'s trainable parameters on every rank of `comm` (checking that all
    /// ranks have the same), then gives every rank the root's values of all its float
    /// parameters: the model comes back with them.
    ///
    /// ```no_run
    /// # async fn run(model: burn::nn::Linear, comm: nexar::NexarClient) -> Result<(), nexar_burn::Error> {
    /// let (ddp, model) = nexar_burn::Ddp::builder().root(0).build(model, &comm).await?;
    /// # Ok(()) }
    /// ```
    pub async fn build<M: Module>(self, model: M, comm: &NexarClient) -> Result<(Ddp, M), Error> {
        let registered: Vec<Found> = walk::float_params(&model).into_iter().filter(|p| p.trainable).collect();
        let mut specs = Vec::with_capacity(registered.len());
        for p in &registered {
            specs.push(ParamSpec::new(p.name.clone(), &p.shape, nexar_dtype(&p.name, p.dtype)?));
        }
        let mut builder: DdpBuilder = Reducer::builder().params(specs).hook(self.hook);
        if let Some(cap) = self.cap {
            builder = builder.bucket_cap_bytes(cap);
        }
        if let Some(first) = self.first_cap {
            builder = builder.first_bucket_bytes(first);
        }
        let reducer = builder.build(comm).await?;
        tracing::debug!(
            rank = comm.rank(),
            params = registered.len(),
            buckets = reducer.layout().buckets.len(),
            "nexar-burn: registered the model's trainable parameters"
        );
        // A rank joining a running job agrees with the members' `rebuild` on whose parameters
        // to take (theirs); at the start of a job every rank is at step 0 and takes `root`'s.
        let root = reducer.agreement().source.unwrap_or(self.root);
        let ddp = Ddp { reducer, registered };
        let model = ddp.broadcast_params(model, root).await?;
        Ok((ddp, model))
    }
}

/// nexar's element type for a burn one.
fn nexar_dtype(name: &str, dtype: DType) -> Result<nexar::DType, Error> {
    Ok(match dtype {
        DType::F32 => nexar::DType::F32,
        DType::F64 => nexar::DType::F64,
        DType::F16 => nexar::DType::F16,
        DType::BF16 => nexar::DType::BF16,
        other => return Err(Error::UnsupportedDtype { name: name.to_string(), dtype: other }),
    })
}

impl Ddp {
    /// Settings other than the defaults.
    ///
    /// ```
    /// let builder = nexar_burn::Ddp::builder();
    /// ```
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// With the default settings: registers `model`'s trainable parameters in visit order,
    /// checks them against every rank, and gives every rank rank 0's values of the model's
    /// float parameters (each process draws other initial weights unless it seeds burn's
    /// generator alike). The model comes back with those values.
    ///
    /// ```no_run
    /// # async fn run(model: burn::nn::Linear, comm: nexar::NexarClient) -> Result<(), nexar_burn::Error> {
    /// let (ddp, model) = nexar_burn::Ddp::new(model, &comm).await?;
    /// # Ok(()) }
    /// ```
    pub async fn new<M: Module>(model: M, comm: &NexarClient) -> Result<(Ddp, M), Error> {
        Builder::default().build(model, comm).await
    }

    /// [`new`](Self::new) from a synchronous program, on `runtime`.
    ///
    /// ```no_run
    /// # fn run(model: burn::nn::Linear) -> Result<(), Box<dyn std::error::Error>> {
    /// let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    /// let comm = runtime.block_on(nexar::NexarClient::init())?;
    /// let (ddp, model) = nexar_burn::Ddp::new_blocking(model, &comm, runtime.handle())?;
    /// # Ok(()) }
    /// ```
    pub fn new_blocking<M: Module>(
        model: M,
        comm: &NexarClient,
        runtime: &tokio::runtime::Handle,
    ) -> Result<(Ddp, M), Error> {
        runtime.block_on(Ddp::new(model, comm))
    }

    /// The reducer underneath (bucket layout, step counter, registered parameters, broadcasts
    /// of any state).
    ///
    /// ```no_run
    /// # fn run(ddp: nexar_burn::Ddp) {
    /// println!("{} buckets", ddp.reducer().layout().buckets.len());
    /// # }
    /// ```
    pub fn reducer(&self) -> &Reducer {
        &self.reducer
    }

    /// The reducer underneath, to change its step counter.
    ///
    /// ```no_run
    /// # fn run(mut ddp: nexar_burn::Ddp) {
    /// ddp.reducer_mut().set_step(100);
    /// # }
    /// ```
    pub fn reducer_mut(&mut self) -> &mut Reducer {
        &mut self.reducer
    }

    /// The registered (trainable) parameters' names, their module paths, in visit order.
    ///
    /// ```no_run
    /// # fn run(ddp: nexar_burn::Ddp) {
    /// for name in ddp.param_names() {
    ///     println!("{name}"); // weight, bias for a bare `Linear`
    /// }
    /// # }
    /// ```
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.registered.iter().map(|p| p.name.as_str())
    }

    /// Replaces the gradient of every trainable parameter of `model` in `grads` by its average
    /// over the ranks. A parameter that got no gradient takes part with zeros (it gets the
    /// others' average); entries of `grads` for anything else are left as they are.
    ///
    /// The gradients are read out of `grads` when this is called; the future sends them and
    /// waits for the averages (it does not hold `model`).
    ///
    /// After [`no_sync`](Self::no_sync) nothing is sent, and the gradients that come back are
    /// this rank's running sums (as `.grad` holds in torch): skip the optimizer's step.
    ///
    /// ```no_run
    /// # async fn run(mut ddp: nexar_burn::Ddp, model: burn::nn::Linear, loss: burn::tensor::Tensor<1>) -> Result<(), nexar_burn::Error> {
    /// let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
    /// let grads = ddp.sync(&model, grads).await?;
    /// # Ok(()) }
    /// ```
    pub fn sync<'a, M: Module>(
        &'a mut self,
        model: &M,
        mut grads: GradientsParams,
    ) -> impl Future<Output = Result<GradientsParams, Error>> + Send + use<'a, M> {
        let taken = walk::take_grads(model, &mut grads);
        async move {
            let taken = taken?;
            self.check_model(&taken)?;
            let layout = self.reducer.layout().clone();
            // Bucket by bucket, so each is on the wire while the next is copied in.
            for bucket in &layout.buckets {
                for &i in &bucket.members {
                    match &taken[i].grad {
                        Some(data) => hand_over(&mut self.reducer, i, &self.registered[i].name, data)?,
                        None => self.reducer.ready_zeros(i)?,
                    }
                }
            }
            let averaged = self.reducer.finish().await?;
            for (i, t) in taken.iter().enumerate() {
                t.put(&mut grads, average_of(&averaged, i, t)?);
            }
            Ok(grads)
        }
    }

    /// [`sync`](Self::sync) from a synchronous training loop: the runtime the layer was built
    /// on drives the buckets while this thread waits.
    ///
    /// ```no_run
    /// # fn run(mut ddp: nexar_burn::Ddp, model: burn::nn::Linear, loss: burn::tensor::Tensor<1>) -> Result<(), nexar_burn::Error> {
    /// let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
    /// let grads = ddp.sync_blocking(&model, grads)?;
    /// # Ok(()) }
    /// ```
    pub fn sync_blocking<M: Module>(&mut self, model: &M, grads: GradientsParams) -> Result<GradientsParams, Error> {
        let runtime = self.runtime_for_blocking()?;
        runtime.block_on(self.sync(model, grads))
    }

    /// Marks the step in progress as an accumulation step (torch's `no_sync`): its gradients
    /// are summed locally and sent with the next synchronising step's. Call it before the
    /// step's [`sync`](Self::sync).
    ///
    /// ```no_run
    /// # fn run(mut ddp: nexar_burn::Ddp) -> Result<(), nexar_burn::Error> {
    /// ddp.no_sync()?; // this step only accumulates
    /// # Ok(()) }
    /// ```
    pub fn no_sync(&mut self) -> Result<(), Error> {
        Ok(self.reducer.no_sync()?)
    }

    /// Gives every rank `root`'s values of `model`'s float parameters (after a rank joined, or
    /// to start from one rank's checkpoint); the model comes back with them, each parameter
    /// keeping its id, device, element type and whether it requires a gradient. Every rank
    /// passes a model of the same parameters; a difference is an error on every rank.
    ///
    /// ```no_run
    /// # async fn run(ddp: nexar_burn::Ddp, model: burn::nn::Linear) -> Result<(), nexar_burn::Error> {
    /// let model = ddp.broadcast_params(model, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn broadcast_params<M: Module>(&self, model: M, root: usize) -> Result<M, Error> {
        let mut values = walk::read_values(&model)?;
        for (name, data) in &values {
            nexar_dtype(name, data.dtype())?;
        }
        // One collective per element type, every rank calling each (with an empty list where it
        // has none): the collectives stay in step, and a rank whose list differs gets an error
        // naming the part.
        broadcast_typed::<f32>(&self.reducer, &mut values, DType::F32, root).await?;
        broadcast_typed::<f64>(&self.reducer, &mut values, DType::F64, root).await?;
        broadcast_typed::<f16>(&self.reducer, &mut values, DType::F16, root).await?;
        broadcast_typed::<bf16>(&self.reducer, &mut values, DType::BF16, root).await?;
        tracing::debug!(
            rank = self.reducer.comm().rank(),
            root,
            params = values.len(),
            "nexar-burn: parameters broadcast"
        );
        if self.reducer.comm().rank() == root {
            return Ok(model);
        }
        Ok(walk::write_values(model, values.into_iter().map(|(_, d)| d).collect()))
    }

    /// [`broadcast_params`](Self::broadcast_params) from synchronous code.
    ///
    /// ```no_run
    /// # fn run(ddp: nexar_burn::Ddp, model: burn::nn::Linear) -> Result<(), nexar_burn::Error> {
    /// let model = ddp.broadcast_params_blocking(model, 0)?;
    /// # Ok(()) }
    /// ```
    pub fn broadcast_params_blocking<M: Module>(&self, model: M, root: usize) -> Result<M, Error> {
        let runtime = self.runtime_for_blocking()?;
        runtime.block_on(self.broadcast_params(model, root))
    }

    /// Continues on `comm` after `recover()` or a grow: checks the registration there, agrees
    /// with the other ranks on the step to go on from ([`StepAgreement`]), and gives every rank
    /// the parameters of the agreement's source (rank 0 where every rank was at one step); the
    /// model comes back with them. A rank that joined builds its `Ddp` on `comm` meanwhile
    /// ([`Builder::build`]), which runs the same collectives and takes the same parameters. The
    /// step in progress is to be redone; optimizer state is the caller's to send from `source`
    /// (`ddp.reducer().broadcast_bytes`, with the optimizer's record).
    ///
    /// ```no_run
    /// # async fn run(mut ddp: nexar_burn::Ddp, model: burn::nn::Linear, comm: nexar::NexarClient) -> Result<(), Box<dyn std::error::Error>> {
    /// let comm = comm.recover().await?;
    /// let (agreed, model) = ddp.rebuild(model, &comm).await?;
    /// # Ok(()) }
    /// ```
    pub async fn rebuild<M: Module>(&mut self, model: M, comm: &NexarClient) -> Result<(StepAgreement, M), Error> {
        let agreed = self.reducer.rebuild(comm).await?;
        let model = self.broadcast_params(model, agreed.source.unwrap_or(0)).await?;
        Ok((agreed, model))
    }

    /// [`rebuild`](Self::rebuild) from synchronous code.
    ///
    /// ```no_run
    /// # fn run(mut ddp: nexar_burn::Ddp, model: burn::nn::Linear, comm: nexar::NexarClient) -> Result<(), Box<dyn std::error::Error>> {
    /// let comm = ddp.block_on(comm.recover())??;
    /// let (agreed, model) = ddp.rebuild_blocking(model, &comm)?;
    /// # Ok(()) }
    /// ```
    pub fn rebuild_blocking<M: Module>(&mut self, model: M, comm: &NexarClient) -> Result<(StepAgreement, M), Error> {
        let runtime = self.runtime_for_blocking()?;
        runtime.block_on(self.rebuild(model, comm))
    }

    /// What the ranks agreed on at the last build or rebuild (see [`rebuild`](Self::rebuild)).
    ///
    /// ```no_run
    /// # fn run(ddp: nexar_burn::Ddp) {
    /// let step = ddp.agreement().step;
    /// # }
    /// ```
    pub fn agreement(&self) -> StepAgreement {
        self.reducer.agreement()
    }

    /// Runs `future` on the layer's runtime from synchronous code (the communicator's own calls,
    /// such as `mean_over_ranks` or `recover()`, in a blocking training loop).
    ///
    /// ```no_run
    /// # fn run(ddp: nexar_burn::Ddp, comm: nexar::NexarClient) -> Result<(), Box<dyn std::error::Error>> {
    /// let loss = ddp.block_on(nexar_burn::mean_over_ranks(&comm, 0.25))??;
    /// # Ok(()) }
    /// ```
    pub fn block_on<F: Future>(&self, future: F) -> Result<F::Output, Error> {
        Ok(self.reducer.block_on(future)?)
    }

    fn runtime_for_blocking(&self) -> Result<tokio::runtime::Handle, Error> {
        // `block_on` refuses to run inside an async task; it is cheap on a ready future.
        self.reducer.block_on(std::future::ready(()))?;
        Ok(self.reducer.runtime().clone())
    }

    /// The gradients taken from the model match the registration (count, shapes, types).
    fn check_model(&self, taken: &[Taken]) -> Result<(), Error> {
        let rank = self.reducer.comm().rank();
        if taken.len() != self.registered.len() {
            return Err(Error::ModelChanged {
                rank,
                what: format!(
                    "{} trainable parameters were registered, the model has {}",
                    self.registered.len(),
                    taken.len()
                ),
            });
        }
        for (t, p) in taken.iter().zip(&self.registered) {
            if t.shape != p.shape || t.dtype != p.dtype {
                return Err(Error::ModelChanged {
                    rank,
                    what: format!(
                        "`{}` was registered as {:?} {:?}, the model's is {:?} {:?}",
                        p.name, p.shape, p.dtype, t.shape, t.dtype
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Hands gradient `data` of parameter `index` to the reducer (which checks its length and
/// element type against the registration).
fn hand_over(reducer: &mut Reducer, index: usize, name: &str, data: &TensorData) -> Result<(), Error> {
    fn slice<'d, T: burn::tensor::Element>(name: &str, data: &'d TensorData) -> Result<&'d [T], Error> {
        data.as_slice::<T>().map_err(|source| Error::Data { name: name.to_string(), source })
    }
    match data.dtype() {
        DType::F32 => reducer.ready_index(index, slice::<f32>(name, data)?)?,
        DType::F64 => reducer.ready_index(index, slice::<f64>(name, data)?)?,
        DType::F16 => reducer.ready_index(index, slice::<f16>(name, data)?)?,
        DType::BF16 => reducer.ready_index(index, slice::<bf16>(name, data)?)?,
        other => return Err(Error::UnsupportedDtype { name: name.to_string(), dtype: other }),
    }
    Ok(())
}

/// The averaged gradient of parameter `index` as tensor data shaped like the parameter.
fn average_of(averaged: &nexar::ddp::Averaged<'_>, index: usize, taken: &Taken) -> Result<TensorData, Error> {
    fn make<T: GradElement + burn::tensor::Element>(
        averaged: &nexar::ddp::Averaged<'_>,
        index: usize,
        taken: &Taken,
    ) -> Result<TensorData, Error> {
        Ok(TensorData::new(averaged.get_index::<T>(index)?.to_vec(), taken.shape.clone()))
    }
    match taken.dtype {
        DType::F32 => make::<f32>(averaged, index, taken),
        DType::F64 => make::<f64>(averaged, index, taken),
        DType::F16 => make::<f16>(averaged, index, taken),
        DType::BF16 => make::<bf16>(averaged, index, taken),
        other => Err(Error::UnsupportedDtype { name: format!("#{index}"), dtype: other }),
    }
}

/// Broadcasts the values of `dtype` among `values` from `root`, in place.
async fn broadcast_typed<T: nexar::Element + burn::tensor::Element>(
    reducer: &Reducer,
    values: &mut [(String, TensorData)],
    dtype: DType,
    root: usize,
) -> Result<(), Error> {
    let mut parts: Vec<&mut [T]> = Vec::new();
    for (name, data) in values.iter_mut().filter(|(_, d)| d.dtype() == dtype) {
        parts.push(data.as_mut_slice::<T>().map_err(|source| Error::Data { name: name.clone(), source })?);
    }
    reducer.broadcast(root, &mut parts).await?;
    Ok(())
}

/// The values of `model`'s float parameters in visit order, each flattened to `f64`: for tests
/// and logs (comparing weights across ranks).
///
/// ```
/// use burn::module::Param;
/// use burn::tensor::{Device, Tensor};
/// let p = Param::from_tensor(Tensor::<1>::from_floats([1.0, 2.0], &Device::flex()));
/// assert_eq!(nexar_burn::values(&p).unwrap(), vec![vec![1.0, 2.0]]);
/// ```
pub fn values<M: Module>(model: &M) -> Result<Vec<Vec<f64>>, Error> {
    walk::read_values(model)?
        .into_iter()
        .map(|(name, data)| data.convert::<f64>().try_to_vec::<f64>().map_err(|source| Error::Data { name, source }))
        .collect()
}
