//! NCCL for `Buf<T, Cuda>` collectives within each host (feature `nccl`).
//!
//! A device allreduce, broadcast, reduce, all-gather or reduce-scatter runs on NCCL among the
//! ranks of each host instead of being staged through host memory, when the communicator's
//! ranks share one host, or span several hosts with the same number on each (more than one;
//! `NEXAR_ALLREDUCE_ALGORITHM=hierarchical` takes one too). Across hosts the data goes over
//! nexar's own links, two-level:
//! - allreduce: an NCCL reduce-scatter within the host, an allreduce of this rank's block
//!   among the ranks of the same local index on every host (nexar, through host memory), an
//!   NCCL all-gather within the host; a length that does not split into equal blocks goes
//!   through the local leaders instead (NCCL reduce, nexar allreduce, NCCL broadcast);
//! - broadcast: the root's local index on every host receives it over nexar, then an NCCL
//!   broadcast within each host;
//! - reduce: an NCCL reduce within each host to the rank of the root's local index (into memory
//!   of its own where that rank is not the root), then a nexar reduce among those ranks;
//! - all-gather: this rank's block to the ranks of its local index on every host over nexar,
//!   an NCCL all-gather within the host of the blocks in local-index order, copied into rank
//!   order on the device;
//! - reduce-scatter: the blocks into local-index order on the device, an NCCL reduce-scatter
//!   within the host, a nexar reduce-scatter among the ranks of this local index.
//!
//! This module decides and sets up; the data movement of each two-level collective is in
//! `nccl_two_level.rs`.
//!
//! The steps:
//! - The ranks first agree, with a small allreduce over nexar's own links, that every one of
//!   them can use NCCL for this call and that their element counts and arguments match; any
//!   "no" (no libnccl, `NEXAR_NCCL=off`, an element type or reduction NCCL lacks, a failed
//!   setup) sends every rank down the staged path together, so no rank waits in NCCL for a
//!   rank that is not coming.
//! - The first such call makes the NCCL communicators: each host's first rank makes a unique
//!   id and nexar all-gathers them over its links; each rank joins its host's communicator on
//!   its buffer's device; the ranks agree on the outcome. A failure (two ranks on one GPU,
//!   which NCCL refuses) is logged once and the
//!   communicator's device collectives stay staged.
//! - The operation is polled without blocking the rank's tasks, within `op_timeout`; a
//!   deadline or a dropped future aborts the NCCL communicator and waits for the stream.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nexar_types::{
    DeviceError, Element, NcclComm, NcclId, NcclInFlight, RecvBuf, ReduceOp, SendBuf, nccl_supports, nccl_version,
};

pub use crate::comm::backends::nccl_slot::NcclState;
use crate::comm::backends::nccl_slot::{NcclGroup, Slot};
use crate::comm::client::NexarClient;
use crate::comm::collective::{CollectiveError, Exchange};
use crate::comm::exec::{AGREEMENT, CollCall};
use crate::comm::state::CommState;
use crate::proto::algo::hierarchical::HostLayout;
use crate::proto::algo::{Algorithm, Collective};

/// The agreement vector's words (can use NCCL, then each of the two counts and the arguments'
/// key with its complement): every rank takes the element-wise minimum, so a word and its
/// complement both survive only where every rank sent the same value.
const OK: usize = 0;
const WORDS: usize = 7;

impl NexarClient {
    /// What NCCL does for this communicator's `Buf<T, Cuda>` collectives (feature `nccl`):
    /// not tried yet, ready, or unusable and why (the collectives are then staged through host
    /// memory, as without the feature).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// use nexar::{Buf, Cuda, NcclState, Sum};
    /// let mut grads = Buf::<f32, Cuda>::zeros_on(comm.rank(), 1 << 20)?;
    /// comm.all_reduce(&mut grads, Sum).await?;
    /// if let NcclState::Unusable { reason } = comm.nccl_state() {
    ///     println!("staged through host memory: {reason}");
    /// }
    /// # Ok(()) }
    /// ```
    pub fn nccl_state(&self) -> NcclState {
        match &*self.comm.nccl.state.lock().unwrap_or_else(|e| e.into_inner()) {
            Slot::NotTried => NcclState::NotTried,
            Slot::Ready(g) => NcclState::Ready { ranks: g.local.size(), device: g.local.device() },
            Slot::Unusable(reason) => NcclState::Unusable { reason: reason.clone() },
        }
    }

    /// Runs one-buffer collective `kind` on `buf` through NCCL where every rank can; `None`
    /// sends the call down the staged path (on every rank alike).
    pub(in crate::comm) async fn try_nccl<B: RecvBuf + ?Sized>(
        &self,
        kind: Collective,
        op: Option<ReduceOp>,
        buf: &mut B,
    ) -> Option<Result<(), CollectiveError>> {
        let root = match kind {
            Collective::AllReduce => 0,
            Collective::Broadcast { root } | Collective::Reduce { root } => root,
            _ => return None,
        };
        // Host buffers leave at once.
        let (count, device) = buf.nccl_operand().map(|o| (o.len(), o.device()))?;
        let _turn = self.comm.nccl.turn.lock().await;
        let ask = Ask { kind, op, root, counts: [count, count], device, fits: Ok(()) };
        let (group, layout) = match self.nccl_agree::<B::Elem>(ask).await? {
            Ok(agreed) => agreed,
            Err(e) => return Some(Err(e)),
        };
        let mut operand = buf.nccl_operand()?;
        let outcome = match kind {
            Collective::Broadcast { root } => self.nccl_broadcast(&group, &layout, &mut operand, root).await,
            Collective::Reduce { root } => {
                self.nccl_reduce(&group, &layout, &mut operand, op.unwrap_or(ReduceOp::Sum), root).await
            }
            _ => self.nccl_all_reduce(&group, &mut operand, op.unwrap_or(ReduceOp::Sum)).await,
        };
        Some(self.nccl_outcome(kind, outcome))
    }

    /// Runs all-gather or reduce-scatter `kind` from `send` into `recv` through NCCL where
    /// every rank can; `None` sends the call down the staged path (on every rank alike).
    pub(in crate::comm) async fn try_nccl_exchange<S, R>(
        &self,
        kind: Collective,
        op: Option<ReduceOp>,
        send: &S,
        recv: &mut R,
    ) -> Option<Result<(), CollectiveError>>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        let (sent, device) = send.nccl_source().map(|s| (s.len(), s.device()))?;
        let (received, recv_device) = recv.nccl_operand().map(|o| (o.len(), o.device()))?;
        let world = self.world_size();
        let block = match kind {
            Collective::AllGather => sent,
            _ => received,
        };
        let fits = if recv_device != device {
            Err(format!("send on device {device} and recv on device {recv_device}"))
        } else if block.checked_mul(world) != Some(if kind == Collective::AllGather { received } else { sent }) {
            // The staged path names the mismatch.
            Err("the buffers' lengths do not fit the world size".into())
        } else {
            Ok(())
        };
        let _turn = self.comm.nccl.turn.lock().await;
        let ask = Ask { kind, op, root: 0, counts: [sent, received], device, fits };
        let (group, layout) = match self.nccl_agree::<S::Elem>(ask).await? {
            Ok(agreed) => agreed,
            Err(e) => return Some(Err(e)),
        };
        let source = send.nccl_source()?;
        let mut operand = recv.nccl_operand()?;
        let outcome = match kind {
            Collective::AllGather => self.nccl_all_gather(&group, &layout, &source, &mut operand).await,
            _ => self.nccl_reduce_scatter(&group, &layout, &source, &mut operand, op.unwrap_or(ReduceOp::Sum)).await,
        };
        Some(self.nccl_outcome(kind, outcome))
    }

    /// Agrees with every rank that all of them can run `ask` on NCCL with the same counts and
    /// arguments, and makes the NCCL communicators the first time. `None`: the call is staged
    /// (on every rank alike).
    async fn nccl_agree<T: Element>(
        &self,
        ask: Ask,
    ) -> Option<Result<(std::sync::Arc<NcclGroup>, std::sync::Arc<HostLayout>), CollectiveError>> {
        // What is the same on every rank: the host table, the world and the configuration's pin.
        let layout = self.layout()?;
        if !self.nccl_layout(&layout) {
            return None;
        }
        let dtype = T::DTYPE;
        let local = ask.fits.and_then(|()| self.nccl_local(dtype, ask.op));
        let key = u64::from(dtype.to_wire())
            | (ask.op.map_or(0, |o| o as u64) << 8)
            | ((ask.root as u64) << 16)
            | (u64::from(ask.kind.code()) << 48);
        let [a, b] = ask.counts.map(|c| c as u64);
        let mut words = [u64::from(local.is_ok()), a, !a, b, !b, key, !key];
        debug_assert_eq!(words.len(), WORDS);
        let ask_all = CollCall::whole(Collective::AllReduce, Some(ReduceOp::Min), WORDS as u64, AGREEMENT);
        if let Err(e) = self.collective(ask_all, &mut words[..], &[]).await {
            return Some(Err(e));
        }
        if words[OK] == 0 {
            let reason = local.err().unwrap_or_else(|| "another rank of the communicator cannot use NCCL".into());
            self.nccl_fallback(&reason);
            return None;
        }
        if words[1] != !words[2] || words[3] != !words[4] || words[5] != !words[6] {
            // Counts or arguments differ: the staged path names the mismatch.
            return None;
        }
        if ask.counts == [0, 0] {
            // Nothing to move (and no device memory to allocate for it): staged, on every rank.
            return None;
        }
        let group = match self.comm.nccl.ready() {
            Some(group) => group,
            None => match self.nccl_setup(&layout, ask.device).await {
                Ok(Some(group)) => group,
                Ok(None) => return None,
                Err(e) => return Some(Err(e)),
            },
        };
        Some(Ok((group, layout)))
    }

    /// An NCCL collective's outcome as the caller sees it; a device failure makes the
    /// communicator's later device collectives staged.
    fn nccl_outcome(&self, kind: Collective, outcome: Result<(), Step>) -> Result<(), CollectiveError> {
        outcome.map_err(|failure| {
            let source = match failure {
                Step::Device(source) => source,
                Step::Across(e) => return e,
            };
            self.comm.nccl.set(Slot::Unusable(format!("an NCCL operation failed: {source}")));
            CollectiveError::Device { rank: self.rank(), op: kind.name(), source }
        })
    }

    /// Whether this communicator's hosts take the NCCL path: one host with several ranks, or
    /// several with the same number each (more than one, unless the configuration pins the
    /// two-level allreduce).
    fn nccl_layout(&self, layout: &HostLayout) -> bool {
        let pinned = matches!(self.config().allreduce_algorithm, Some(Algorithm::Hierarchical { .. }));
        match (layout.hosts(), layout.ranks_per_host()) {
            (1, _) => self.world_size() > 1,
            (_, Some(per_host)) => per_host > 1 || pinned,
            _ => false,
        }
    }

    /// Why this rank cannot take part in an NCCL call, if it cannot.
    fn nccl_local(&self, dtype: nexar_types::DType, op: Option<ReduceOp>) -> Result<(), String> {
        if !self.config().nccl {
            return Err("NEXAR_NCCL is off".into());
        }
        if !nccl_supports(dtype, op) {
            return Err(match op {
                Some(op) => format!("NCCL has no {dtype:?} elements or no {op:?} reduction"),
                None => format!("NCCL has no {dtype:?} elements"),
            });
        }
        match &*self.comm.nccl.state.lock().unwrap_or_else(|e| e.into_inner()) {
            Slot::Unusable(reason) => return Err(reason.clone()),
            // A call dropped midway aborted it; the others learn it here and stage with us.
            Slot::Ready(group) if group.local.is_aborted() => {
                return Err("this rank's NCCL communicator was aborted (a device collective was dropped midway)".into());
            }
            _ => {}
        }
        nccl_version().map(|_| ()).map_err(|e| e.to_string())
    }

    /// Makes this rank's NCCL communicator within its host on `device`, and the nexar
    /// communicator across hosts; `Ok(None)` where some rank could not (every rank then stages
    /// this communicator's device collectives).
    async fn nccl_setup(
        &self,
        layout: &HostLayout,
        device: usize,
    ) -> Result<Option<std::sync::Arc<NcclGroup>>, CollectiveError> {
        let me = self.comm.me;
        let host = layout.host_of(me);
        let neighbours = layout.members(host);
        let index = neighbours.iter().position(|r| *r == me).unwrap_or(0);
        // Each host's first rank makes its id; every rank gets every host's.
        let mut mine = [0u8; ID_BYTES];
        if index == 0 {
            match NcclId::new() {
                Ok(made) => {
                    mine[0] = 1;
                    mine[1..].copy_from_slice(made.as_bytes());
                }
                Err(e) => tracing::warn!(rank = self.rank(), error = %e, "could not make an NCCL id"),
            }
        }
        let mut ids = vec![0u8; ID_BYTES * self.world_size()];
        let at = |r: usize| r * ID_BYTES..(r + 1) * ID_BYTES;
        self.exchange_host(Exchange::AllGather, &mine[..], &mut ids[..]).await?;
        let leaders = &ids[at(neighbours[0])];
        let joined = if leaders[0] == 1 {
            let mut bytes = [0u8; 128];
            bytes.copy_from_slice(&leaders[1..]);
            let id = NcclId::from_bytes(bytes);
            let size = neighbours.len();
            let join = tokio::task::spawn_blocking(move || NcclComm::join(device, index, size, &id));
            match tokio::time::timeout(self.config().op_timeout, join).await {
                Ok(Ok(Ok(comm))) => Ok(comm),
                Ok(Ok(Err(e))) => Err(e.to_string()),
                Ok(Err(e)) => Err(format!("joining the NCCL communicator panicked: {e}")),
                Err(_) => Err(format!("joining the NCCL communicator took longer than {:?}", self.config().op_timeout)),
            }
        } else {
            Err(format!("rank {} could not make an NCCL id", self.comm.members[neighbours[0]]))
        };
        let mut all = [u64::from(joined.is_ok())];
        self.staged(Collective::AllReduce, Some(ReduceOp::Min), &mut all[..]).await?;
        match joined {
            Ok(local) if all[0] == 1 => {
                tracing::info!(
                    rank = self.rank(),
                    device,
                    ranks = local.size(),
                    hosts = layout.hosts(),
                    "device collectives run on NCCL within the host"
                );
                let across = (layout.hosts() > 1).then(|| self.across_hosts(layout, index));
                let group = std::sync::Arc::new(NcclGroup { local, across });
                self.comm.nccl.set(Slot::Ready(group.clone()));
                Ok(Some(group))
            }
            joined => {
                let reason = match joined {
                    Ok(local) => {
                        local.abort();
                        "another rank could not join its NCCL communicator".to_string()
                    }
                    Err(reason) => reason,
                };
                self.comm.nccl.set(Slot::Unusable(reason.clone()));
                self.nccl_fallback(&reason);
                Ok(None)
            }
        }
    }

    /// The communicator of the ranks with local index `index` on every host, in host order:
    /// every rank computes the same members from the same table, so no collective is needed.
    fn across_hosts(&self, layout: &HostLayout, index: usize) -> std::sync::Arc<CommState> {
        let ranks: Vec<usize> = (0..layout.hosts()).map(|h| layout.members(h)[index]).collect();
        let me = ranks.iter().position(|r| *r == self.comm.me).unwrap_or(0);
        let members = ranks.iter().map(|r| self.comm.members[*r]).collect();
        let id = nexar_types::stable_id(&["nccl-across", &self.comm.id.to_string(), &index.to_string()]).max(1);
        std::sync::Arc::new(CommState::new(id, members, me))
    }

    /// Logs, once per communicator, that its device collectives are staged, and why.
    fn nccl_fallback(&self, reason: &str) {
        if !self.comm.nccl.logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(rank = self.rank(), reason, "device collectives are staged through host memory, not NCCL");
        }
    }

    /// Polls an NCCL operation to its end, yielding to the rank's other tasks, within
    /// `op_timeout` (then the communicator is aborted).
    pub(in crate::comm) async fn nccl_wait(&self, mut flight: NcclInFlight<'_>) -> Result<(), Step> {
        let start = Instant::now();
        let timeout = self.config().op_timeout;
        while !flight.poll()? {
            let waited = start.elapsed();
            if waited > timeout {
                // Dropping the flight aborts the communicator and waits for the stream.
                return Err(Step::Device(DeviceError::Unavailable {
                    reason: format!("an NCCL operation was not done after {timeout:?}; its communicator was aborted"),
                }));
            }
            // The runtime's timer counts whole milliseconds, so a sleep costs one even for an
            // operation a few microseconds from done (measured: a small two-level
            // reduce-scatter took 1.9 ms with sleeps from 200 µs on); yield through the first
            // milliseconds, as NCCL's own host threads spin.
            if waited < POLL_SPIN {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        Ok(())
    }
}

/// How a step of an NCCL collective failed: on the device (NCCL or a copy), or in the nexar
/// collective across hosts (reported as it is).
pub(in crate::comm) enum Step {
    Device(DeviceError),
    Across(CollectiveError),
}

impl From<DeviceError> for Step {
    fn from(e: DeviceError) -> Self {
        Step::Device(e)
    }
}

/// What a device collective asks of NCCL.
struct Ask {
    kind: Collective,
    op: Option<ReduceOp>,
    root: usize,
    /// The send and receive lengths (the same for a one-buffer collective).
    counts: [usize; 2],
    device: usize,
    /// Whether this rank's own buffers fit the call, and why not.
    fits: Result<(), String>,
}

/// How long [`NexarClient::nccl_wait`] polls an operation by yielding before it sleeps
/// between polls.
const POLL_SPIN: Duration = Duration::from_millis(3);

/// An NCCL id as sent: a byte that says whether its host's first rank could make one, then
/// the id.
const ID_BYTES: usize = 129;
