//! The reducer: gradients handed over one parameter at a time are copied into their bucket,
//! each complete bucket is sent at once (in bucket order, the same on every rank), and
//! `finish` waits for them and gives the averages back.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use nexar_types::DType;
use tokio::sync::{mpsc, oneshot};

use super::DdpError;
use super::averaged::Averaged;
use super::driver::{Done, Driver, Job};
use super::flat::{Flat, GradElement};
use super::hook::{CommHook, HookState, MatrixPart};
use super::layout::Layout;
use super::params::{ParamSpec, StepAgreement, agree_on_step, check_same_everywhere};
use crate::comm::{CollectiveError, NexarClient};

/// PyTorch DDP's default bucket cap, 25 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;
/// PyTorch DDP's first bucket, 1 MiB: the first gradients ready start communication early.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Parameters and settings of a [`Ddp`], before it is checked against the other ranks.
///
/// ```no_run
/// use nexar::DType;
/// use nexar::ddp::{CommHook, Ddp};
/// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::ddp::DdpError> {
/// let ddp = Ddp::builder()
///     .param("fc1.weight", &[128, 64], DType::F32)
///     .param("fc1.bias", &[128], DType::F32)
///     .bucket_cap_bytes(25 << 20)
///     .hook(CommHook::Plain)
///     .build(&comm)
///     .await?;
/// assert_eq!(ddp.params().len(), 2);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct DdpBuilder {
    params: Vec<ParamSpec>,
    cap: usize,
    first_cap: usize,
    hook: CommHook,
}

impl Default for DdpBuilder {
    fn default() -> Self {
        DdpBuilder {
            params: Vec::new(),
            cap: DEFAULT_BUCKET_BYTES,
            first_cap: DEFAULT_FIRST_BUCKET_BYTES,
            hook: CommHook::Plain,
        }
    }
}

impl DdpBuilder {
    /// Registers a parameter. Registration order is the model's (first layer first): buckets
    /// are filled in reverse.
    pub fn param(mut self, name: impl Into<String>, shape: &[usize], dtype: DType) -> Self {
        self.params.push(ParamSpec::new(name, shape, dtype));
        self
    }

    /// Registers parameters in order.
    pub fn params(mut self, params: impl IntoIterator<Item = ParamSpec>) -> Self {
        self.params.extend(params);
        self
    }

    /// The bucket cap in bytes (torch's `bucket_cap_mb`); default 25 MiB.
    pub fn bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.cap = bytes;
        self
    }

    /// The first bucket's cap in bytes; default 1 MiB.
    pub fn first_bucket_bytes(mut self, bytes: usize) -> Self {
        self.first_cap = bytes;
        self
    }

    /// The comm hook every bucket is reduced with; default [`CommHook::Plain`].
    pub fn hook(mut self, hook: CommHook) -> Self {
        self.hook = hook;
        self
    }

    /// Checks the registration against every rank of `comm` and starts the layer's background
    /// task on the current tokio runtime. Every rank calls it; a rank whose parameters or
    /// settings differ makes it fail on every rank, naming the first difference.
    pub async fn build(self, comm: &NexarClient) -> Result<Ddp, DdpError> {
        let rank = comm.rank();
        let invalid = |reason: String| DdpError::InvalidArgument { rank, reason };
        if self.cap == 0 || self.first_cap == 0 {
            return Err(invalid("the bucket caps must be at least one byte".into()));
        }
        self.hook.validate().map_err(invalid)?;
        let mut by_name = HashMap::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            if p.name().is_empty() {
                return Err(invalid(format!("parameter {i} has an empty name")));
            }
            if !matches!(p.dtype(), DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
                return Err(invalid(format!("{p}: gradients are f32, f64, f16 or bf16")));
            }
            if by_name.insert(p.name().to_string(), i).is_some() {
                return Err(invalid(format!("the name `{}` is registered twice", p.name())));
            }
        }
        let layout = Layout::assign(&self.params, self.cap, self.first_cap);
        let settings_text = self.settings_text();
        let settings = nexar_types::stable_hash(settings_text.as_bytes());
        check_same_everywhere(comm, &self.params, settings, &settings_text).await?;
        // A rank that joins a running job builds its layer while the members rebuild theirs:
        // the same agreement runs on both sides, and gives the newcomer the members' step.
        let agreement = agree_on_step(comm, 0).await?;
        let parts: Arc<[Vec<MatrixPart>]> = layout
            .buckets
            .iter()
            .map(|b| {
                b.members
                    .iter()
                    .map(|&m| {
                        let p = &self.params[m];
                        let rows = p.shape().first().copied().unwrap_or(1);
                        let cols = p.numel().checked_div(rows).unwrap_or(0);
                        MatrixPart { offset: layout.place[m].1, rows, cols }
                    })
                    .collect()
            })
            .collect();
        let slots = layout
            .buckets
            .iter()
            .map(|b| Slot { data: Flat::zeros(b.dtype, b.elems), state: HookState::Empty, pending: b.members.len() })
            .collect();
        let params: Arc<[ParamSpec]> = self.params.into();
        let driver = Driver::start(comm, self.hook, parts.clone());
        let handed = vec![false; params.len()];
        Ok(Ddp {
            comm: comm.clone(),
            params,
            by_name,
            layout,
            parts,
            settings: (settings, settings_text),
            hook: self.hook,
            slots,
            handed,
            next_launch: 0,
            inflight: VecDeque::new(),
            step: agreement.step,
            agreement,
            no_sync: false,
            carry: false,
            driver,
            runtime: tokio::runtime::Handle::current(),
        })
    }

    fn settings_text(&self) -> String {
        format!("bucket cap {} bytes, first bucket {} bytes, hook {}", self.cap, self.first_cap, self.hook.describe())
    }
}

/// One bucket's memory and what its hook keeps. `data` is `None` while the bucket is on the
/// wire (the background task owns it).
#[derive(Debug)]
struct Slot {
    data: Option<Flat>,
    state: HookState,
    /// Members not handed over yet in this step.
    pending: usize,
}

/// Data-parallel gradient synchronisation over named gradients, in the manner of PyTorch's
/// `DistributedDataParallel`, with no ML framework behind it.
///
/// Each step: hand every parameter's gradient over with [`ready`](Self::ready) (any order;
/// in backward order, the last layer first, buckets go out while the rest is computed), then
/// [`finish`](Self::finish) waits for the buckets and gives the averages back. A bucket is
/// sent as soon as all of its gradients are in and every bucket before it has gone, so the
/// collectives start in the same order on every rank.
///
/// Averaging is a sum over the ranks followed by a division by the world size (the hook's;
/// `Plain` in the bucket's own element type). Between steps the buckets keep the averages,
/// which [`Averaged`] lends out without a copy.
///
/// ```no_run
/// use nexar::DType;
/// use nexar::ddp::Ddp;
/// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::ddp::DdpError> {
/// let mut ddp = Ddp::builder().param("w", &[4], DType::F32).param("b", &[1], DType::F32).build(&comm).await?;
/// ddp.ready("b", &[0.5f32])?;
/// ddp.ready("w", &[1.0f32, 2.0, 3.0, 4.0])?;
/// let averaged = ddp.finish().await?;
/// let w: &[f32] = averaged.get("w")?;
/// assert_eq!(w.len(), 4);
/// # Ok(()) }
/// ```
pub struct Ddp {
    comm: NexarClient,
    params: Arc<[ParamSpec]>,
    by_name: HashMap<String, usize>,
    layout: Layout,
    parts: Arc<[Vec<MatrixPart>]>,
    settings: (u64, String),
    hook: CommHook,
    slots: Vec<Slot>,
    /// Which parameters were handed over in this step.
    handed: Vec<bool>,
    next_launch: usize,
    inflight: VecDeque<(usize, oneshot::Receiver<Done>)>,
    step: u64,
    /// What the ranks agreed on at the last build or rebuild.
    agreement: StepAgreement,
    /// This step accumulates (torch's `no_sync`).
    no_sync: bool,
    /// The buckets hold sums of earlier `no_sync` steps, which this step's gradients add to.
    carry: bool,
    driver: mpsc::UnboundedSender<Job>,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp")
            .field("rank", &self.comm.rank())
            .field("params", &self.params.len())
            .field("buckets", &self.layout.buckets.len())
            .field("hook", &self.hook)
            .field("step", &self.step)
            .finish()
    }
}

impl Ddp {
    /// A builder: register parameters, set caps and the hook, then `build`.
    pub fn builder() -> DdpBuilder {
        DdpBuilder::default()
    }

    /// The registered parameters, in registration order.
    pub fn params(&self) -> &[ParamSpec] {
        &self.params
    }

    /// The bucket layout (the same on every rank).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The communicator the buckets travel on.
    pub fn comm(&self) -> &NexarClient {
        &self.comm
    }

    /// Steps finished so far (a `no_sync` step counts).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Sets the step counter, for a rank that joined a running job and was sent the others'
    /// (PowerSGD's `start_step` counts from it).
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// What the ranks agreed on when this layer was last built or rebuilt: the step they went on
    /// from, and whose state, where they had been at different steps.
    pub fn agreement(&self) -> StepAgreement {
        self.agreement
    }

    /// The registration index of `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Hands over the gradient of the parameter named `name`: it is copied into its bucket
    /// (added, after `no_sync` steps), and a bucket whose gradients are all in is sent at once.
    /// A gradient of the wrong length or element type, or one handed over twice in a step, is
    /// an error on this rank before anything is sent.
    pub fn ready<T: GradElement>(&mut self, name: &str, grad: &[T]) -> Result<(), DdpError> {
        let index = self.index_of(name).ok_or_else(|| DdpError::UnknownParameter {
            rank: self.comm.rank(),
            step: self.step,
            name: name.to_string(),
        })?;
        self.ready_index(index, grad)
    }

    /// [`ready`](Self::ready) by registration index.
    pub fn ready_index<T: GradElement>(&mut self, index: usize, grad: &[T]) -> Result<(), DdpError> {
        let (bucket, offset) = self.take_place(index, T::DTYPE, grad.len())?;
        let carry = self.carry;
        if let Some(data) = self.slots[bucket].data.as_mut() {
            data.put(offset, grad, carry);
        }
        self.handed_over(index, bucket);
        Ok(())
    }

    /// Hands over a zero gradient for a parameter that got none in this step (torch's unused
    /// parameter): the others' gradients for it are still averaged over every rank.
    pub fn ready_zeros(&mut self, index: usize) -> Result<(), DdpError> {
        let (dtype, numel) = match self.params.get(index) {
            Some(p) => (p.dtype(), p.numel()),
            None => (DType::F32, 0),
        };
        let (bucket, offset) = self.take_place(index, dtype, numel)?;
        if !self.carry
            && let Some(data) = self.slots[bucket].data.as_mut()
        {
            data.zero(offset, numel);
        }
        self.handed_over(index, bucket);
        Ok(())
    }

    /// Marks the step in progress as an accumulation step (torch's `no_sync`): its gradients
    /// are added into the buckets and nothing is sent; the next synchronising step sends the
    /// sum (so after `k` such steps the average is of `k + 1` steps' sums, as in torch, and a
    /// loss that should be a mean over all of them is divided by `k + 1` by the caller). Call
    /// it before the step's first gradient.
    pub fn no_sync(&mut self) -> Result<(), DdpError> {
        if self.handed.iter().any(|&h| h) {
            return Err(self.usage("no_sync() must come before the step's first gradient"));
        }
        self.no_sync = true;
        Ok(())
    }

    /// Ends the step: waits until every bucket is summed over the ranks and averaged, and
    /// lends the averages out. Every parameter must have been handed over; if one is missing
    /// the step stays open (hand it over and call `finish` again).
    ///
    /// A failed bucket (a dead rank, a rank that never handed its gradient over, a timeout)
    /// is an error naming the bucket, with the collective's report of the rank at fault; the
    /// buckets' memory is kept, and after `recover()` [`rebuild`](Self::rebuild) continues on
    /// the new communicator.
    ///
    /// In a `no_sync` step nothing is sent: the result holds this rank's running sums and
    /// says so ([`Averaged::synced`] is false).
    pub async fn finish(&mut self) -> Result<Averaged<'_>, DdpError> {
        self.check_complete()?;
        if self.no_sync {
            self.end_step(true);
            return Ok(Averaged { ddp: self, synced: false });
        }
        let mut failure = None;
        while let Some((bucket, reply)) = self.inflight.pop_front() {
            match reply.await {
                Ok(done) => {
                    self.slots[bucket].data = Some(done.data);
                    self.slots[bucket].state = done.state;
                    if let Err(source) = done.result
                        && failure.is_none()
                    {
                        failure = Some(self.bucket_error(bucket, source));
                    }
                }
                Err(_) => {
                    // The background task ended (its runtime shut down): the memory is gone.
                    let b = &self.layout.buckets[bucket];
                    self.slots[bucket].data = Flat::zeros(b.dtype, b.elems);
                    failure.get_or_insert_with(|| self.usage("the layer's background task ended (runtime shut down)"));
                }
            }
        }
        match failure {
            Some(e) => {
                // The step is to be redone (after `rebuild`, or by the caller).
                self.reset_step();
                Err(e)
            }
            None => {
                self.end_step(false);
                Ok(Averaged { ddp: self, synced: true })
            }
        }
    }

    /// [`finish`](Self::finish) from a synchronous training loop: the buckets are driven by
    /// the runtime the layer was built on, while this thread waits. Not for use inside an
    /// async task (that is an error, not a deadlock).
    pub fn finish_blocking(&mut self) -> Result<Averaged<'_>, DdpError> {
        let runtime = self.blocking_runtime()?;
        runtime.block_on(self.finish())
    }

    /// Continues on `comm` (a communicator from `recover()`, `rebuild_excluding` or
    /// `rebuild_adding`): checks the registration there, as at construction, and agrees with
    /// the other ranks on the step to go on from ([`StepAgreement`]: after a failure some
    /// survivors may have finished the step others failed; a rank that joins gets the members'
    /// step). The step in progress is dropped (redo it, from the agreed step), gradients
    /// accumulated by `no_sync` steps are dropped, and the hooks' state (top-k and PowerSGD
    /// residuals, PowerSGD's `Q`) starts afresh on every rank, so that a rank that joined has
    /// the same as the survivors. Where the agreement names a `source`, take its parameters and
    /// optimizer state ([`broadcast`](Self::broadcast)); `nexar-candle` does so for the
    /// parameters.
    pub async fn rebuild(&mut self, comm: &NexarClient) -> Result<StepAgreement, DdpError> {
        // The buckets in flight belong to the old communicator: take their memory back.
        while let Some((bucket, reply)) = self.inflight.pop_front() {
            let b = &self.layout.buckets[bucket];
            self.slots[bucket].data = reply.await.map_or_else(|_| Flat::zeros(b.dtype, b.elems), |d| Some(d.data));
        }
        for (slot, b) in self.slots.iter_mut().zip(&self.layout.buckets) {
            if slot.data.is_none() {
                slot.data = Flat::zeros(b.dtype, b.elems);
            }
            slot.state = HookState::Empty;
        }
        check_same_everywhere(comm, &self.params, self.settings.0, &self.settings.1).await?;
        let agreement = agree_on_step(comm, self.step).await?;
        self.driver = Driver::start(comm, self.hook, self.parts.clone());
        self.comm = comm.clone();
        self.runtime = tokio::runtime::Handle::current();
        self.reset_step();
        self.step = agreement.step;
        self.agreement = agreement;
        Ok(agreement)
    }

    /// [`rebuild`](Self::rebuild) from synchronous code.
    pub fn rebuild_blocking(&mut self, comm: &NexarClient) -> Result<StepAgreement, DdpError> {
        let runtime = self.blocking_runtime()?;
        runtime.block_on(self.rebuild(comm))
    }

    /// Broadcasts tensors from `root` (initial parameters, optimizer state): the parts are
    /// flattened into one buffer, sent in one collective, and written back. Every rank passes
    /// parts of the same lengths; a difference is an error on every rank.
    ///
    /// ```no_run
    /// # async fn run(ddp: nexar::ddp::Ddp) -> Result<(), nexar::ddp::DdpError> {
    /// let (mut w, mut b) = (vec![0f32; 256], vec![0f32; 16]);
    /// ddp.broadcast(0, &mut [&mut w[..], &mut b[..]]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn broadcast<T: nexar_types::Element>(
        &self,
        root: usize,
        parts: &mut [&mut [T]],
    ) -> Result<(), DdpError> {
        super::broadcast::broadcast_parts(&self.comm, root, parts).await
    }

    /// [`broadcast`](Self::broadcast) from synchronous code.
    pub fn broadcast_blocking<T: nexar_types::Element>(
        &self,
        root: usize,
        parts: &mut [&mut [T]],
    ) -> Result<(), DdpError> {
        self.blocking_runtime()?.block_on(self.broadcast(root, parts))
    }

    /// Broadcasts bytes of any length from `root` (a serialised optimizer state, a step
    /// counter): the length goes first, so the other ranks pass anything (their bytes are
    /// replaced). The length is checked against `max_message_bytes` before anything is
    /// allocated.
    pub async fn broadcast_bytes(&self, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, DdpError> {
        super::broadcast::broadcast_bytes(&self.comm, root, bytes).await
    }

    /// [`broadcast_bytes`](Self::broadcast_bytes) from synchronous code.
    pub fn broadcast_bytes_blocking(&self, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, DdpError> {
        self.blocking_runtime()?.block_on(self.broadcast_bytes(root, bytes))
    }

    /// Runs `future` on the layer's runtime from synchronous code (for the communicator's own
    /// calls, such as `recover()`, in a blocking training loop).
    pub fn block_on<F: std::future::Future>(&self, future: F) -> Result<F::Output, DdpError> {
        Ok(self.blocking_runtime()?.block_on(future))
    }

    /// The tokio runtime the layer runs its collectives on (the one it was built or last
    /// rebuilt on).
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// A bucket's memory, where it is not on the wire.
    pub(super) fn bucket_data(&self, bucket: usize) -> Option<&Flat> {
        self.slots.get(bucket).and_then(|s| s.data.as_ref())
    }

    fn blocking_runtime(&self) -> Result<tokio::runtime::Handle, DdpError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(self.usage("a blocking call inside an async task: use the async form (`.await`)"));
        }
        Ok(self.runtime.clone())
    }

    fn usage(&self, what: &str) -> DdpError {
        DdpError::Usage { rank: self.comm.rank(), what: what.to_string() }
    }

    /// Checks a hand-over of `len` elements of `dtype` for parameter `index` and returns its
    /// place.
    fn take_place(&mut self, index: usize, dtype: DType, len: usize) -> Result<(usize, usize), DdpError> {
        let (rank, step) = (self.comm.rank(), self.step);
        let Some(p) = self.params.get(index) else {
            return Err(DdpError::InvalidArgument {
                rank,
                reason: format!("parameter index {index}: only {} are registered", self.params.len()),
            });
        };
        if dtype != p.dtype() || len != p.numel() {
            return Err(DdpError::WrongGradient {
                rank,
                step,
                name: p.name().to_string(),
                expected: format!("{:?} {} ({} elements)", p.shape(), p.dtype(), p.numel()),
                got: format!("{len} {dtype} elements"),
            });
        }
        if self.handed[index] {
            return Err(DdpError::HandedTwice { rank, step, name: p.name().to_string() });
        }
        Ok(self.layout.place[index])
    }

    fn handed_over(&mut self, index: usize, bucket: usize) {
        self.handed[index] = true;
        self.slots[bucket].pending -= 1;
        if !self.no_sync {
            self.launch_ready();
        }
    }

    /// Sends every complete bucket whose predecessors have gone.
    fn launch_ready(&mut self) {
        while self.next_launch < self.slots.len() && self.slots[self.next_launch].pending == 0 {
            let bucket = self.next_launch;
            self.next_launch += 1;
            let slot = &mut self.slots[bucket];
            if self.layout.buckets[bucket].elems == 0 {
                continue; // Nothing to send, on every rank alike.
            }
            let Some(data) = slot.data.take() else { continue };
            let (reply, done) = oneshot::channel();
            let job = Job { step: self.step, bucket, data, state: std::mem::take(&mut slot.state), reply };
            if let Err(mpsc::error::SendError(job)) = self.driver.send(job) {
                // The background task is gone: keep the memory; `finish` reports it.
                slot.data = Some(job.data);
                slot.state = job.state;
                let (_, closed) = oneshot::channel();
                self.inflight.push_back((bucket, closed));
                continue;
            }
            self.inflight.push_back((bucket, done));
        }
    }

    fn check_complete(&self) -> Result<(), DdpError> {
        let missing: Vec<String> = self
            .handed
            .iter()
            .enumerate()
            .filter(|(_, h)| !**h)
            .map(|(i, _)| format!("`{}` (bucket {})", self.params[i].name(), self.layout.place[i].0))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let mut names = missing.iter().take(8).cloned().collect::<Vec<_>>().join(", ");
        if missing.len() > 8 {
            names.push_str(&format!(" and {} more", missing.len() - 8));
        }
        Err(DdpError::Missing { rank: self.comm.rank(), step: self.step, names })
    }

    fn bucket_error(&self, bucket: usize, source: CollectiveError) -> DdpError {
        let members = &self.layout.buckets[bucket].members;
        let name = |i: usize| self.params[members[i]].name();
        let params = match members.len() {
            1 => format!("`{}`", name(0)),
            n => format!("{n} parameters from `{}` to `{}`", name(0), name(n - 1)),
        };
        DdpError::Bucket { rank: self.comm.rank(), step: self.step, bucket, params, source: Box::new(source) }
    }

    /// A step ended well: the next one starts from empty buckets (or adds to them, after
    /// `no_sync`).
    fn end_step(&mut self, accumulated: bool) {
        self.reset_step();
        self.carry = accumulated;
        self.step += 1;
    }

    fn reset_step(&mut self) {
        self.handed.iter_mut().for_each(|h| *h = false);
        for (slot, b) in self.slots.iter_mut().zip(&self.layout.buckets) {
            slot.pending = b.members.len();
        }
        self.next_launch = 0;
        self.no_sync = false;
        self.carry = false;
    }
}
