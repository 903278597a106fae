//! NCCL for `Buf<T, Cuda>` collectives among the ranks of one host (feature `nccl`).
//!
//! A device allreduce or broadcast on a communicator whose ranks all share one host runs on
//! an NCCL communicator instead of being staged through host memory:
//! - The ranks first agree, with a small allreduce over nexar's own links, that every one of
//!   them can use NCCL for this call and that their element counts and arguments match; any
//!   "no" (no libnccl, `NEXAR_NCCL=off`, an element type or reduction NCCL lacks, a failed
//!   setup) sends every rank down the staged path together, so no rank waits in NCCL for a
//!   rank that is not coming.
//! - The first such call makes the NCCL communicator: rank 0 makes the unique id and nexar
//!   broadcasts it over its links; each rank joins on its buffer's device; the ranks agree on
//!   the outcome. A failure (two ranks on one GPU, which NCCL refuses) is logged once and the
//!   communicator's device collectives stay staged.
//! - The operation is polled without blocking the rank's tasks, within `op_timeout`; a
//!   deadline or a dropped future aborts the NCCL communicator and waits for the stream.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nexar_types::{DeviceError, Element, NcclComm, NcclId, RecvBuf, ReduceOp, nccl_supports, nccl_version};

use super::client::NexarClient;
use super::collective::CollectiveError;
use crate::proto::algo::Collective;

/// What NCCL does for a communicator's device buffers (see [`NexarClient::nccl_state`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NcclState {
    /// No device collective has asked for it yet.
    NotTried,
    /// Device allreduces and broadcasts run on NCCL.
    Ready {
        /// Ranks in the NCCL communicator.
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
    Ready(std::sync::Arc<NcclComm>),
    Unusable(String),
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

    fn ready(&self) -> Option<std::sync::Arc<NcclComm>> {
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
            Slot::Ready(c) => NcclState::Ready { ranks: c.size(), device: c.device() },
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
        // The same on every rank: the host table and the world.
        if self.world_size() < 2 || self.layout()?.hosts() != 1 {
            return None;
        }
        let (count, device) = buf.nccl_operand().map(|o| (o.len(), o.device()))?;
        let _turn = self.comm.nccl.turn.lock().await;
        let local = self.nccl_local(<B::Elem as Element>::DTYPE, op);
        let key = <B::Elem as Element>::DTYPE.to_wire() as u64
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
        let comm = match self.comm.nccl.ready() {
            Some(comm) => comm,
            None => match self.nccl_setup(device).await {
                Ok(Some(comm)) => comm,
                Ok(None) => return None,
                Err(e) => return Some(Err(e)),
            },
        };
        let operand = buf.nccl_operand()?;
        let started = match kind {
            Collective::Broadcast { root } => comm.broadcast(operand, root),
            _ => comm.all_reduce(operand, op.unwrap_or(ReduceOp::Sum)),
        };
        let outcome = match started {
            Ok(mut flight) => self.nccl_wait(&mut flight, device).await,
            Err(e) => Err(e),
        };
        Some(outcome.map_err(|source| {
            self.comm.nccl.set(Slot::Unusable(format!("an NCCL operation failed: {source}")));
            CollectiveError::Device { rank: self.rank(), op: kind.name(), source }
        }))
    }

    /// Why this rank cannot take part in an NCCL call, if it cannot.
    fn nccl_local(&self, dtype: nexar_types::DType, op: Option<ReduceOp>) -> Result<(), String> {
        if !self.config().nccl {
            return Err("NEXAR_NCCL is off".into());
        }
        if !nccl_supports(dtype, op) {
            return Err(format!("NCCL has no {dtype:?} elements or no {op:?} reduction"));
        }
        if let Slot::Unusable(reason) = &*self.comm.nccl.state.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(reason.clone());
        }
        nccl_version().map(|_| ()).map_err(|e| e.to_string())
    }

    /// Makes this communicator's NCCL member on `device`; `Ok(None)` where some rank could not
    /// (every rank then stages this communicator's device collectives).
    async fn nccl_setup(&self, device: usize) -> Result<Option<std::sync::Arc<NcclComm>>, CollectiveError> {
        let (me, size) = (self.comm.me, self.world_size());
        let mut id = [0u8; 129];
        if me == 0 {
            match NcclId::new() {
                Ok(made) => {
                    id[0] = 1;
                    id[1..].copy_from_slice(made.as_bytes());
                }
                Err(e) => tracing::warn!(rank = self.rank(), error = %e, "could not make an NCCL id"),
            }
        }
        self.staged(Collective::Broadcast { root: 0 }, None, &mut id[..]).await?;
        let joined = if id[0] == 1 {
            let mut bytes = [0u8; 128];
            bytes.copy_from_slice(&id[1..]);
            let nccl_id = NcclId::from_bytes(bytes);
            let join = tokio::task::spawn_blocking(move || NcclComm::join(device, me, size, &nccl_id));
            match tokio::time::timeout(self.config().op_timeout, join).await {
                Ok(Ok(Ok(comm))) => Ok(comm),
                Ok(Ok(Err(e))) => Err(e.to_string()),
                Ok(Err(e)) => Err(format!("joining the NCCL communicator panicked: {e}")),
                Err(_) => Err(format!("joining the NCCL communicator took longer than {:?}", self.config().op_timeout)),
            }
        } else {
            Err("rank 0 could not make an NCCL id".into())
        };
        let mut all = [u64::from(joined.is_ok())];
        self.staged(Collective::AllReduce, Some(ReduceOp::Min), &mut all[..]).await?;
        match joined {
            Ok(comm) if all[0] == 1 => {
                tracing::info!(rank = self.rank(), device, ranks = size, "device collectives run on NCCL");
                let comm = std::sync::Arc::new(comm);
                self.comm.nccl.set(Slot::Ready(comm.clone()));
                Ok(Some(comm))
            }
            joined => {
                let reason = match joined {
                    Ok(comm) => {
                        comm.abort();
                        "another rank could not join the NCCL communicator".to_string()
                    }
                    Err(reason) => reason,
                };
                self.comm.nccl.set(Slot::Unusable(reason.clone()));
                self.nccl_fallback(&reason);
                Ok(None)
            }
        }
    }

    /// Logs, once per communicator, that its device collectives are staged, and why.
    fn nccl_fallback(&self, reason: &str) {
        if !self.comm.nccl.logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(rank = self.rank(), reason, "device collectives are staged through host memory, not NCCL");
        }
    }

    /// Polls an NCCL operation to its end, yielding to the rank's other tasks, within
    /// `op_timeout` (then the communicator is aborted).
    async fn nccl_wait(&self, flight: &mut nexar_types::NcclInFlight<'_>, device: usize) -> Result<(), DeviceError> {
        let start = Instant::now();
        let timeout = self.config().op_timeout;
        while !flight.poll()? {
            let waited = start.elapsed();
            if waited > timeout {
                return Err(DeviceError::Driver {
                    op: "an NCCL operation",
                    device,
                    reason: format!("not done after {timeout:?}; the NCCL communicator was aborted"),
                });
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
