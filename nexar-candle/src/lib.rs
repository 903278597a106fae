//! Data-parallel training for [candle](https://github.com/huggingface/candle) over nexar, in
//! the manner of PyTorch's `DistributedDataParallel`: every rank holds the whole model, trains
//! on its share of each batch, and averages the gradients with the others before the
//! optimizer's step. A thin layer over [`nexar::ddp`], which does the bucketing, the ordering,
//! the cross-rank checks and the comm hooks.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{Module, Optimizer, VarBuilder, VarMap};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let comm = nexar::NexarClient::init().await?;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let model = candle_nn::linear(2, 3, vb.pp("fc"))?;
//! // Orders the variables by name (VarMap's order differs from process to process) and
//! // gives every rank rank 0's initial weights.
//! let mut ddp = nexar_candle::Ddp::new(&varmap, &comm).await?;
//! let mut opt = candle_nn::SGD::new(varmap.all_vars(), 0.1)?;
//! let x = Tensor::zeros((8, 2), DType::F32, &Device::Cpu)?;
//! let loss = model.forward(&x)?.sqr()?.mean_all()?;
//! let mut grads = loss.backward()?;
//! ddp.sync(&mut grads).await?; // every variable's gradient is now the average over the ranks
//! opt.step(&grads)?;
//! # Ok(()) }
//! ```
//!
//! # What overlaps
//!
//! candle computes every gradient in one `backward()` call and has no per-parameter hook, so
//! communication cannot start while the backward pass runs, as it does in torch. What does
//! overlap: [`Ddp::sync`] hands the gradients over in bucket order, and each bucket is on the
//! wire while the next ones are copied in; the averages are then written back bucket by bucket
//! as they arrive. The copies are one into the bucket (read straight from the gradient's CPU
//! storage) and one back into a new gradient tensor.
//!
//! # Blocking training loops
//!
//! candle's compute is blocking. Run the training loop on a thread of its own (the program's
//! main thread), not inside an async task, and let a small tokio runtime (one or two worker
//! threads) drive the communication: [`Ddp::new_blocking`] and [`Ddp::sync_blocking`]. Size
//! candle's thread pool (rayon) to the rank's share of the host,
//! [`nexar::affinity::compute_threads`], not to every core: ranks on one host otherwise
//! oversubscribe it.

#![deny(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod grads;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use nexar::NexarClient;
use nexar::ddp::{CommHook, Ddp as Reducer, DdpBuilder, ParamSpec};

pub use error::Error;
pub use nexar::ddp::{PowerSgd, ShardSampler, mean_over_ranks};

/// Data-parallel gradient averaging for the variables of a [`VarMap`].
///
/// The variables are registered by name, in name order: a `VarMap` is a `HashMap`, whose order
/// differs between processes, and nexar checks on every rank that all of them registered the
/// same names, shapes and element types.
pub struct Ddp {
    reducer: Reducer,
    /// The variables, in registration (name) order.
    vars: Vec<(String, Var)>,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp").field("vars", &self.vars.len()).field("reducer", &self.reducer).finish()
    }
}

/// Settings of a [`Ddp`]: the bucket caps and the comm hook of [`nexar::ddp`].
///
/// ```no_run
/// # async fn run(varmap: candle_nn::VarMap, comm: nexar::NexarClient) -> Result<(), nexar_candle::Error> {
/// use nexar::ddp::CommHook;
/// let ddp = nexar_candle::Ddp::builder()
///     .hook(CommHook::Compressed(nexar::Compression::Bf16))
///     .bucket_cap_bytes(25 << 20)
///     .build(&varmap, &comm)
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
    pub fn bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.cap = Some(bytes);
        self
    }

    /// The first bucket's cap in bytes (default 1 MiB).
    pub fn first_bucket_bytes(mut self, bytes: usize) -> Self {
        self.first_cap = Some(bytes);
        self
    }

    /// The comm hook (default plain averaging).
    pub fn hook(mut self, hook: CommHook) -> Self {
        self.hook = hook;
        self
    }

    /// The rank whose initial weights every rank starts from (default 0).
    pub fn root(mut self, root: usize) -> Self {
        self.root = root;
        self
    }

    /// Registers `varmap`'s variables on every rank of `comm` (checking that all ranks have the
    /// same), then broadcasts the root's values of them.
    pub async fn build(self, varmap: &VarMap, comm: &NexarClient) -> Result<Ddp, Error> {
        let vars = sorted_vars(varmap);
        let mut specs = Vec::with_capacity(vars.len());
        for (name, var) in &vars {
            specs.push(ParamSpec::new(name.clone(), var.dims(), grads::nexar_dtype(name, var.dtype())?));
        }
        let mut builder: DdpBuilder = Reducer::builder().params(specs).hook(self.hook);
        if let Some(cap) = self.cap {
            builder = builder.bucket_cap_bytes(cap);
        }
        if let Some(first) = self.first_cap {
            builder = builder.first_bucket_bytes(first);
        }
        let reducer = builder.build(comm).await?;
        // A rank joining a running job agrees with the members' `rebuild` on whose parameters
        // to take (theirs); at the start of a job every rank is at step 0 and takes `root`'s.
        let root = reducer.agreement().source.unwrap_or(self.root);
        let ddp = Ddp { reducer, vars };
        ddp.broadcast_params(root).await?;
        Ok(ddp)
    }
}

/// The variables of `varmap` sorted by name.
fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

impl Ddp {
    /// Settings other than the defaults.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// With the default settings: registers `varmap`'s variables in name order, checks them
    /// against every rank, and gives every rank rank 0's initial values (candle cannot seed its
    /// CPU random generator, so each process draws other initial weights).
    pub async fn new(varmap: &VarMap, comm: &NexarClient) -> Result<Ddp, Error> {
        Builder::default().build(varmap, comm).await
    }

    /// [`new`](Self::new) from a synchronous program, on `runtime`.
    pub fn new_blocking(varmap: &VarMap, comm: &NexarClient, runtime: &tokio::runtime::Handle) -> Result<Ddp, Error> {
        runtime.block_on(Ddp::new(varmap, comm))
    }

    /// The reducer underneath (bucket layout, step counter, broadcasts of any state).
    pub fn reducer(&self) -> &Reducer {
        &self.reducer
    }

    /// The reducer underneath, to change its step counter or call its `no_sync`.
    pub fn reducer_mut(&mut self) -> &mut Reducer {
        &mut self.reducer
    }

    /// The variables, in registration (name) order.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.vars.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// Replaces every variable's gradient in `grads` by its average over the ranks. A variable
    /// that got no gradient takes part with zeros (it gets the others' average); entries of
    /// `grads` that are not variables of the map (inputs, intermediate leaves) are left as they
    /// are.
    pub async fn sync(&mut self, grads: &mut GradStore) -> Result<(), Error> {
        let layout = self.reducer.layout().clone();
        // Bucket by bucket, so each is on the wire while the next is copied in.
        for bucket in &layout.buckets {
            for &i in &bucket.members {
                let (name, var) = &self.vars[i];
                match grads.get(var.as_tensor()) {
                    Some(g) => grads::hand_over(&mut self.reducer, i, name, g)?,
                    None => self.reducer.ready_zeros(i)?,
                }
            }
        }
        let averaged = self.reducer.finish().await?;
        for (i, (name, var)) in self.vars.iter().enumerate() {
            let avg = grads::tensor_of(&averaged, i, name, var)?;
            grads.insert(var.as_tensor(), avg);
        }
        Ok(())
    }

    /// [`sync`](Self::sync) from a synchronous training loop: the runtime the layer was built
    /// on drives the buckets while this thread waits.
    pub fn sync_blocking(&mut self, grads: &mut GradStore) -> Result<(), Error> {
        let runtime = self.runtime_for_blocking()?;
        runtime.block_on(self.sync(grads))
    }

    /// Marks the step in progress as an accumulation step (torch's `no_sync`): its gradients
    /// are summed locally and sent with the next synchronising step's. In such a step
    /// [`sync`](Self::sync) leaves the running sums in the buckets and `grads` as they are.
    pub fn no_sync(&mut self) -> Result<(), Error> {
        Ok(self.reducer.no_sync()?)
    }

    /// Gives every rank `root`'s values of the map's variables (after a rank joined, or to
    /// start from one rank's checkpoint).
    pub async fn broadcast_params(&self, root: usize) -> Result<(), Error> {
        let vars: Vec<Var> = self.vars.iter().map(|(_, v)| v.clone()).collect();
        broadcast_vars(&self.reducer, &vars, root).await
    }

    /// Gives every rank `root`'s values of `vars` (optimizer state kept in variables, such as
    /// momentum buffers). Every rank passes variables of the same shapes and types in the same
    /// order.
    pub async fn broadcast_vars(&self, vars: &[Var], root: usize) -> Result<(), Error> {
        broadcast_vars(&self.reducer, vars, root).await
    }

    /// Continues on `comm` after `recover()` or a grow: checks the registration there, agrees
    /// with the other ranks on the step to go on from ([`nexar::ddp::StepAgreement`]), and gives
    /// every rank the parameters of the agreement's source (rank 0 where every rank was at one
    /// step). A rank that joined builds its `Ddp` on `comm` meanwhile ([`Builder::build`]),
    /// which runs the same collectives and takes the same parameters. The step in progress is
    /// to be redone; optimizer state is the caller's to send from `source`
    /// ([`broadcast_vars`](Self::broadcast_vars)).
    pub async fn rebuild(&mut self, comm: &NexarClient) -> Result<nexar::ddp::StepAgreement, Error> {
        let agreed = self.reducer.rebuild(comm).await?;
        self.broadcast_params(agreed.source.unwrap_or(0)).await?;
        Ok(agreed)
    }

    /// What the ranks agreed on at the last build or rebuild (see [`rebuild`](Self::rebuild)).
    pub fn agreement(&self) -> nexar::ddp::StepAgreement {
        self.reducer.agreement()
    }

    /// Runs `future` on the layer's runtime from synchronous code.
    pub fn block_on<F: std::future::Future>(&self, future: F) -> Result<F::Output, Error> {
        Ok(self.reducer.block_on(future)?)
    }

    fn runtime_for_blocking(&self) -> Result<tokio::runtime::Handle, Error> {
        // `block_on` refuses to run inside an async task; it is cheap on a ready future.
        self.reducer.block_on(std::future::ready(()))?;
        Ok(self.reducer.runtime().clone())
    }
}

/// Broadcasts `vars` from `root`, grouped by element type (one collective per type).
async fn broadcast_vars(reducer: &Reducer, vars: &[Var], root: usize) -> Result<(), Error> {
    grads::broadcast(reducer, vars, root).await
}

/// The tensors of `vars`, for tests and logs: each variable's values flattened to `f64`.
///
/// ```
/// let v = candle_core::Var::new(&[1f32, 2.0], &candle_core::Device::Cpu).unwrap();
/// assert_eq!(nexar_candle::values(&[v]).unwrap(), vec![vec![1.0, 2.0]]);
/// ```
pub fn values(vars: &[Var]) -> Result<Vec<Vec<f64>>, Error> {
    vars.iter().map(|v| Ok(v.as_tensor().flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?)).collect()
}

/// A tensor's values as `f64`, flattened (see [`values`]).
pub fn values_of(t: &Tensor) -> Result<Vec<f64>, Error> {
    Ok(t.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?)
}
