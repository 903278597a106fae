//! [`NexarClient`]: one rank's handle on the cluster, and the rank's shared state (`Inner`).
//! Building a client is in `build`, leaving in `leave`, the control lane in `control`.

pub(in crate::comm) mod build;
pub(in crate::comm) mod control;
pub(in crate::comm) mod init;
pub(in crate::comm) mod leave;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use quinn::{Connection, Endpoint};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

use crate::cluster::health::Health;
use crate::comm::matcher::Mailbox;
use crate::comm::membership::recovery_error::RecoveryError;
use crate::comm::state::CommState;
use crate::config::NexarConfig;
use crate::transport::link::LaneSenders;
use crate::transport::links::Links;
use crate::transport::pool::BufferPool;
use crate::transport::relay_seal::RelaySeals;
use crate::transport::route::Route;

/// One rank's handle on a nexar cluster: its rank, the world size, and every operation.
///
/// Cheap to clone; all clones share the rank's connections. Operations may run concurrently
/// from several tasks.
///
/// ```no_run
/// use nexar::prelude::*;
/// # async fn run() -> Result<(), NexarError> {
/// let ranks = NexarClient::bootstrap_local(2).await?;
/// assert_eq!(ranks[1].rank(), 1);
/// assert_eq!(ranks[1].world_size(), 2);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct NexarClient {
    /// Shared by the program's handles, not by nexar's own tasks: when the last handle goes,
    /// this rank tells its peers at once, even while a task of its own still holds `inner`.
    /// Declared first, so it is dropped while `inner` is still held.
    pub(crate) user: Arc<UserHandles>,
    pub(crate) inner: Arc<Inner>,
    /// The communicator this handle speaks for: the world, or a group made by `split`.
    pub(crate) comm: Arc<CommState>,
}

/// The program's hold on a rank (see [`NexarClient::user`]).
pub(crate) struct UserHandles {
    inner: Weak<Inner>,
}

impl UserHandles {
    /// The token of a new client on `inner`; `inner` keeps a weak reference to it, for the
    /// handles nexar makes itself (a rebuilt communicator).
    pub(super) fn new(inner: &Arc<Inner>) -> Arc<Self> {
        let user = Arc::new(UserHandles { inner: Arc::downgrade(inner) });
        let _ = inner.user.set(Arc::downgrade(&user));
        user
    }
}

impl NexarClient {
    /// A handle for a task of nexar's own that may outlive the program's handles (a
    /// confirmation round): it does not keep this rank from leaving when the last of them goes.
    pub(crate) fn for_own_task(&self) -> NexarClient {
        let detached = Arc::new(UserHandles { inner: Weak::new() });
        NexarClient { user: detached, inner: self.inner.clone(), comm: self.comm.clone() }
    }
}

impl Drop for UserHandles {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.leave_unannounced();
        }
    }
}

/// How many automatic rebuilds have finished, and the latest one's outcome.
pub(crate) type Rebuilds = (u64, Option<Result<Arc<CommState>, RecoveryError>>);

pub(crate) struct Inner {
    pub rank: usize,
    pub cfg: NexarConfig,
    pub endpoint: Endpoint,
    pub links: Links,
    pub self_lanes: LaneSenders,
    /// Point-to-point messages waiting for their `recv`.
    pub mailbox: Arc<Mailbox>,
    /// Collective messages waiting for their step, keyed by (communicator, source, sequence).
    pub coll: Arc<Mailbox>,
    /// Reused send and scratch buffers.
    pub pool: Arc<BufferPool>,
    /// How long receives poll before parking (see `NexarConfig::spin`), adapted to whether
    /// spinning pays.
    pub spin: crate::comm::exec::spin::SpinGovernor,
    pub pings: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    /// Indirect probes this rank asked for: nonce → (the rank asked, where its answer goes).
    pub probes:
        Mutex<HashMap<u64, (u32, tokio::sync::mpsc::UnboundedSender<crate::comm::membership::probe::ProbeAnswer>)>>,
    /// Indirect probes this rank is running for others (bounded: see `probe::MAX_PROBING`).
    pub probing: std::sync::atomic::AtomicUsize,
    /// When this rank last refuted a suspicion (the liveness clock, ms; 0: never).
    pub refuted_at: std::sync::atomic::AtomicU64,
    /// Liveness messages this rank has sent (see `NexarClient::liveness_sent`).
    pub liveness_sent: std::sync::atomic::AtomicU64,
    /// Wakes whoever waits for peers' goodbyes.
    pub goodbyes: Notify,
    pub tasks: Mutex<Vec<JoinHandle<()>>>,
    pub seed: Option<Connection>,
    /// The RPC service: functions served, handler state, peers' registries, pending calls.
    pub rpc: crate::rpc::RpcService,
    /// Which peers are alive.
    pub health: Health,
    /// Automatic rebuilds finished, and the latest one's outcome (for `FailureWatch::rebuilt`).
    pub rebuilt: tokio::sync::watch::Sender<Rebuilds>,
    /// What the launcher said of this rank, and the seed it hosts (set by `init`).
    pub launch: std::sync::OnceLock<crate::cluster::launcher::Launched>,
    /// The world size the cluster formed with (the topology is laid over it).
    pub initial_world: usize,
    /// A key of the host of each rank of the world the cluster formed with, equal for ranks
    /// of one host (see `comm::hosts`); unset when they were not learnt.
    pub host_keys: std::sync::OnceLock<Vec<u64>>,
    /// Each world rank's process id where it runs on this rank's kernel (this process's own
    /// for its in-process ranks; 0 elsewhere), learnt with the host keys.
    pub host_pids: std::sync::OnceLock<Vec<u32>>,
    /// Next hops to ranks without a direct link.
    pub routes: crate::cluster::Routes,
    /// The keys that seal this rank's relayed messages end to end (none in a cluster started
    /// with `connect_static`).
    pub relay_seals: Option<Arc<RelaySeals>>,
    /// Ranks that joined the running cluster, and this rank's own admission.
    pub growth: crate::cluster::Growth,
    /// Transport back ends' setup messages waiting to be taken.
    pub setup: crate::comm::backends::setup_inbox::SetupInbox,
    /// The flight recorder (see [`crate::trace`]).
    pub trace: Arc<crate::trace::RankTrace>,
    /// The program's handles ([`UserHandles`]), while it holds any.
    pub user: std::sync::OnceLock<Weak<UserHandles>>,
    /// The links were closed because the program dropped its last handle without
    /// `shutdown()`; dropping `Inner` then has nothing more to tell the peers.
    pub left: std::sync::atomic::AtomicBool,
    /// The stall inspector's questions waiting for their answer, by nonce: the rank asked, and
    /// where its answer goes.
    pub positions: Mutex<HashMap<u64, (u32, oneshot::Sender<crate::trace::Answer>)>>,
}

/// Counters of one peer link, from [`NexarClient::link_stats`].
///
/// ```no_run
/// # fn run(comm: nexar::NexarClient) {
/// let lossy = (0..comm.world_size()).filter_map(|p| comm.link_stats(p)).any(|s| s.lost_packets > 0);
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkStats {
    /// Smoothed round-trip time.
    pub rtt: Duration,
    /// Datagrams sent on the path.
    pub sent_packets: u64,
    /// Datagrams QUIC judged lost (and sent again).
    pub lost_packets: u64,
    /// Current congestion window in bytes.
    pub congestion_window: u64,
}

impl std::fmt::Debug for NexarClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NexarClient")
            .field("rank", &self.comm.me)
            .field("world_size", &self.comm.members.len())
            .field("comm", &self.comm.id)
            .finish_non_exhaustive()
    }
}

impl NexarClient {
    /// The communicator's id: the same on every member, different for every communicator
    /// (`split`, rebuilds) of the cluster.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let half = comm.split(Some(comm.rank() as u32 % 2), 0).await?.expect("every rank has a color");
    /// assert_ne!(half.comm_id(), comm.comm_id());
    /// # Ok(()) }
    /// ```
    pub fn comm_id(&self) -> u64 {
        self.comm.id
    }

    /// This rank in its communicator, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.comm.me
    }

    /// The number of ranks in this communicator (the whole cluster unless this handle came
    /// from [`split`](Self::split)).
    pub fn world_size(&self) -> usize {
        self.comm.members.len()
    }

    /// This rank's number in the whole cluster.
    pub fn world_rank(&self) -> usize {
        self.inner.rank
    }

    /// Leaves the cluster at once, like `MPI_Abort`: closes every connection with `reason`
    /// without flushing or waiting for anyone. Peers' pending receives and collectives that
    /// involve this rank fail promptly with an error naming it and quoting `reason`. Use it when
    /// this rank cannot go on; [`shutdown`](Self::shutdown) is the orderly way out.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// comm.abort("out of memory while loading shard 7");
    /// # }
    /// ```
    pub fn abort(&self, reason: &str) {
        self.inner.abort_all(reason);
    }

    /// A private communicator with the same members for one run of a collective plan that
    /// took sequence number `seq` here: its traffic cannot mix with anything else.
    pub(crate) fn plan_view(&self, seq: u64) -> NexarClient {
        let id = nexar_types::stable_id(&["plan", &self.comm.id.to_string(), &seq.to_string()]).max(1);
        self.with_comm(CommState::new(id, self.comm.members.clone(), self.comm.me))
    }

    /// A handle on the same rank for another communicator.
    pub(crate) fn with_comm(&self, comm: CommState) -> NexarClient {
        self.with_shared_comm(Arc::new(comm))
    }

    /// This rank's client on a communicator state that is kept elsewhere (its sequence numbers
    /// go on from where they were).
    pub(crate) fn with_shared_comm(&self, comm: Arc<CommState>) -> NexarClient {
        NexarClient { user: self.user.clone(), inner: self.inner.clone(), comm }
    }

    /// Counters of the QUIC path to rank `peer` of this communicator (`None` for this rank
    /// itself or a rank outside it): round-trip time, datagrams sent and lost, congestion
    /// window. Useful to tell a slow network from a slow peer.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// if let Some(s) = comm.link_stats(1) {
    ///     println!("rtt {:?}, {} of {} datagrams lost", s.rtt, s.lost_packets, s.sent_packets);
    /// }
    /// # }
    /// ```
    pub fn link_stats(&self, peer: usize) -> Option<LinkStats> {
        let route = self.link(peer)?;
        let conn = route.first_hop().connection();
        let path = conn.stats().path;
        Some(LinkStats {
            rtt: conn.rtt(),
            sent_packets: path.sent_packets,
            lost_packets: path.lost_packets,
            congestion_window: path.cwnd,
        })
    }

    /// Liveness messages this rank has sent since it started: heartbeats (to the ranks that
    /// watch it: three, whatever the size of the cluster), pings and probes of suspects, answers
    /// to others' probes, refutations. QUIC's own keep-alives are not counted.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// let before = comm.liveness_sent();
    /// std::thread::sleep(std::time::Duration::from_secs(10));
    /// println!("{:.1} liveness messages per second", (comm.liveness_sent() - before) as f64 / 10.0);
    /// # }
    /// ```
    pub fn liveness_sent(&self) -> u64 {
        self.inner.liveness_sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The world ranks this rank holds a direct connection to (all others on a full mesh;
    /// its neighbours on a sparse [`Topology`](crate::Topology)).
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// println!("rank {} talks directly to {:?}", comm.world_rank(), comm.connected_peers());
    /// # }
    /// ```
    pub fn connected_peers(&self) -> Vec<usize> {
        self.inner.links.iter().map(|l| l.peer() as usize).collect()
    }

    /// The configuration this rank runs with.
    pub fn config(&self) -> &NexarConfig {
        &self.inner.cfg
    }

    /// The address this rank listens on for its peers.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.endpoint.local_addr().ok()
    }

    /// The route to `peer` (a rank of this communicator).
    pub(crate) fn link(&self, peer: usize) -> Option<Route<'_>> {
        let world = *self.comm.members.get(peer)?;
        self.inner.route(world)
    }
}
