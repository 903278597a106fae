//! NCCL for `Buf<T, Cuda>` collectives within each host (feature `nccl`).
//!
//! A device allreduce or broadcast runs on NCCL among the ranks of each host instead of being
//! staged through host memory, when the communicator's ranks share one host, or span several
//! hosts with the same number on each (more than one; `NEXAR_ALLREDUCE_ALGORITHM=hierarchical`
//! takes one too). Across hosts the data goes over nexar's own links, two-level:
//! - allreduce: an NCCL reduce-scatter within the host, an allreduce of this rank's block
//!   among the ranks of the same local index on every host (nexar, through host memory), an
//!   NCCL all-gather within the host; a length that does not split into equal blocks goes
//!   through the local leaders instead (NCCL reduce, nexar allreduce, NCCL broadcast);
//! - broadcast: the root's local index on every host receives it over nexar, then an NCCL
//!   broadcast within each host.
//!
//! The steps:
//! - The ranks first agree, with a small allreduce over nexar's own links, that every one of
//!   them can use NCCL for this call and that their element counts and arguments match; any
//!   "no" (no libnccl, `NEXAR_NCCL=off`, an element type or reduction NCCL lacks, a failed
//!   setup) sends every rank down the staged path together, so no rank waits in NCCL for a
//!   rank that is not coming.
//! - The first such call makes the NCCL communicators: each host's first rank makes a unique
//!   id and nexar all-gathers them over its links; each rank joins its host's communicator on
//!   its buffer's device; the ranks agree on the outcome. A failure (two ranks on one GPU, which NCCL refuses) is logged once and the
//!   communicator's device collectives stay staged.
//! - The operation is polled without blocking the rank's tasks, within `op_timeout`; a
//!   deadline or a dropped future aborts the NCCL communicator and waits for the stream.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nexar_types::{
    DeviceError, Element, NcclComm, NcclId, NcclInFlight, NcclOperand, RecvBuf, ReduceOp, nccl_supports, nccl_version,
};

use super::client::NexarClient;
use super::collective::CollectiveError;
use super::state::CommState;
use crate::proto::algo::hierarchical::HostLayout;
use crate::proto::algo::{Algorithm, Collective};

/// What NCCL does for a communicator's device buffers (see [`NexarClient::nccl_state`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NcclState {
    /// No device collective has asked for it yet.
    NotTried,
    /// Device allreduces and broadcasts run on NCCL within the host.
    Ready {
        /// Ranks in this host's NCCL communicator.
        ranks: usize,
        /// This rank's device.
        device: usize,
    },
    /// Device collectives are staged through host memory; why, in words.
    Unusable {
        /// Why.
        reason: String,
    },
}

/// A communicator's NCCL member, made by its first device collective.
#[derive(Default)]
pub(crate) struct NcclSlot {
    /// Held for the whole of each NCCL call: this rank issues them one at a time, in call order.
    turn: tokio::sync::Mutex<()>,
    state: Mutex<Slot>,
    logged: AtomicBool,
}

#[derive(Default)]
enum Slot {
    #[default]
    NotTried,
    Ready(std::sync::Arc<NcclGroup>),
    Unusable(String),
}

/// This rank's NCCL communicator within its host, and, where the communicator spans several
/// hosts, the nexar communicator of the ranks with its local index on every host (its state
/// only: a client holds the runtime, which must not be kept alive from a communicator's state).
pub(crate) struct NcclGroup {
    local: NcclComm,
    across: Option<std::sync::Arc<CommState>>,
}

impl std::fmt::Debug for NcclSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclSlot")
    }
}

impl NcclSlot {
    fn set(&self, slot: Slot) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = slot;
    }

    fn ready(&self) -> Option<std::sync::Arc<NcclGroup>> {
        match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            Slot::Ready(comm) => Some(comm.clone()),
            _ => None,
        }
    }
}

/// The agreement vector's words: every rank takes the element-wise minimum, so a word and its
/// complement both survive only where every rank sent the same value.
const OK: usize = 0;
const WORDS: usize = 5;

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

    /// Runs `kind` on `buf` through NCCL where every rank can; `None` sends the call down the
    /// staged path (on every rank alike).
    pub(super) async fn try_nccl<B: RecvBuf + ?Sized>(
        &self,
        kind: Collective,
        op: Option<ReduceOp>,
        buf: &mut B,
    ) -> Option<Result<(), CollectiveError>> {
        let root = match kind {
            Collective::AllReduce => 0,
            Collective::Broadcast { root } => root,
            _ => return None,
        };
        // Host buffers leave at once. Then what is the same on every rank: the host table,
        // the world and the configuration's pin.
        let (count, device) = buf.nccl_operand().map(|o| (o.len(), o.device()))?;
        let layout = self.layout()?;
        if !self.nccl_layout(&layout) {
            return None;
        }
        let _turn = self.comm.nccl.turn.lock().await;
        let dtype = <B::Elem as Element>::DTYPE;
        let local = self.nccl_local(dtype, op);
        let key = u64::from(dtype.to_wire())
            | (op.map_or(0, |o| o as u64) << 8)
            | ((root as u64) << 16)
            | (u64::from(kind.code()) << 48);
        let mut words = [u64::from(local.is_ok()), count as u64, !(count as u64), key, !key];
        debug_assert_eq!(words.len(), WORDS);
        if let Err(e) = self.staged(Collective::AllReduce, Some(ReduceOp::Min), &mut words[..]).await {
            return Some(Err(e));
        }
        if words[OK] == 0 {
            let reason = local.err().unwrap_or_else(|| "another rank of the communicator cannot use NCCL".into());
            self.nccl_fallback(&reason);
            return None;
        }
        if words[1] != !words[2] || words[3] != !words[4] {
            // Counts or arguments differ: the staged path names the mismatch.
            return None;
        }
        let group = match self.comm.nccl.ready() {
            Some(group) => group,
            None => match self.nccl_setup(&layout, device).await {
                Ok(Some(group)) => group,
                Ok(None) => return None,
                Err(e) => return Some(Err(e)),
            },
        };
        let mut operand = buf.nccl_operand()?;
        let outcome = match kind {
            Collective::Broadcast { root } => self.nccl_broadcast(&group, &layout, &mut operand, root).await,
            _ => self.nccl_all_reduce(&group, &mut operand, op.unwrap_or(ReduceOp::Sum)).await,
        };
        Some(outcome.map_err(|failure| {
            let source = match failure {
                Step::Device(source) => source,
                Step::Across(e) => return e,
            };
            self.comm.nccl.set(Slot::Unusable(format!("an NCCL operation failed: {source}")));
            CollectiveError::Device { rank: self.rank(), op: kind.name(), source }
        }))
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

    /// The two-level allreduce: NCCL within the host, nexar across hosts.
    async fn nccl_all_reduce<T: Element>(
        &self,
        group: &NcclGroup,
        buf: &mut NcclOperand<'_, T>,
        op: ReduceOp,
    ) -> Result<(), Step> {
        let local = &group.local;
        let Some(across) = group.across.clone().map(|c| self.with_shared_comm(c)) else {
            return self.nccl_wait(local.all_reduce(buf, op)?).await;
        };
        let (n, per_host) = (buf.len(), local.size());
        if n.is_multiple_of(per_host) {
            let block = n / per_host;
            let mine = local.rank() * block..(local.rank() + 1) * block;
            self.nccl_wait(local.reduce_scatter(buf, op)?).await?;
            let mut host = vec![T::zeroed(); block];
            buf.copy_out(mine.clone(), &mut host)?;
            across.staged(Collective::AllReduce, Some(op), &mut host[..]).await.map_err(Step::Across)?;
            buf.copy_in(mine, &host)?;
            return self.nccl_wait(local.all_gather(buf)?).await;
        }
        // Blocks of unequal length: through each host's leader.
        self.nccl_wait(local.reduce(buf, op, 0)?).await?;
        if local.rank() == 0 {
            let mut host = vec![T::zeroed(); n];
            buf.copy_out(0..n, &mut host)?;
            across.staged(Collective::AllReduce, Some(op), &mut host[..]).await.map_err(Step::Across)?;
            buf.copy_in(0..n, &host)?;
        }
        self.nccl_wait(local.broadcast(buf, 0)?).await
    }

    /// The two-level broadcast: to the root's local index on every host over nexar, then NCCL
    /// within each host.
    async fn nccl_broadcast<T: Element>(
        &self,
        group: &NcclGroup,
        layout: &HostLayout,
        buf: &mut NcclOperand<'_, T>,
        root: usize,
    ) -> Result<(), Step> {
        let local = &group.local;
        let root_host = layout.host_of(root);
        let root_index = layout.members(root_host).iter().position(|r| *r == root).unwrap_or(0);
        if let Some(across) = group.across.clone().map(|c| self.with_shared_comm(c))
            && local.rank() == root_index
        {
            let n = buf.len();
            let mut host = vec![T::zeroed(); n];
            if self.rank() == root {
                buf.copy_out(0..n, &mut host)?;
            }
            across
                .staged(Collective::Broadcast { root: root_host }, None, &mut host[..])
                .await
                .map_err(Step::Across)?;
            if self.rank() != root {
                buf.copy_in(0..n, &host)?;
            }
        }
        self.nccl_wait(local.broadcast(buf, root_index)?).await
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
        self.all_gather(&mine[..], &mut ids[..]).await?;
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
    async fn nccl_wait(&self, mut flight: NcclInFlight<'_>) -> Result<(), Step> {
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
            if waited < Duration::from_micros(200) {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
        }
        Ok(())
    }
}

/// How a step of an NCCL collective failed: on the device (NCCL or a copy), or in the nexar
/// collective across hosts (reported as it is).
enum Step {
    Device(DeviceError),
    Across(CollectiveError),
}

impl From<DeviceError> for Step {
    fn from(e: DeviceError) -> Self {
        Step::Device(e)
    }
}

/// An NCCL id as sent: a byte that says whether its host's first rank could make one, then
/// the id.
const ID_BYTES: usize = 129;
