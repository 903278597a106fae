//! [`NexarClient`]: one rank's handle on the cluster.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use quinn::{Connection, Endpoint};
use rustls::pki_types::CertificateDer;
use std::sync::atomic::AtomicU64;

use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::health::{Health, monitor, recover_automatically};
use super::route::{Route, RouteCache, forward, route_cache};
use super::state::CommState;
use crate::cluster::{self, ClusterError, JoinToken, MeshSetup};
use crate::config::{BulkTransport, ConfigError, NexarConfig, RecoveryPolicy};
use crate::error::NexarError;
use crate::proto::message::PeerMsg;
use crate::rpc::{Registry, serve_requests, serve_responses};
use crate::transport::byte_budget::ByteBudget;
use crate::transport::endpoint;
use crate::transport::framed::Payload;
use crate::transport::link::RELAY_BUDGET_BYTES;
use crate::transport::link::{
    CLOSE_SHUTDOWN, DirectSink, Incoming, Lane, LaneReceivers, LaneSenders, PeerLink, RelayHook, lanes,
};
use crate::transport::links::Links;
use crate::transport::liveness::Liveness;
use crate::transport::mailbox::{Mailbox, coll_entry, p2p_entry};
use crate::transport::pool::BufferPool;
use crate::transport::relay_seal::RelaySeals;
use crate::transport::tls::{Identity, mesh_server, rank_from_cert};

/// Collective messages a rank may hold before it stops reading the raw lane.
const COLL_MAX_HELD: usize = 1 << 16;

/// QUIC close code of `abort`.
const CLOSE_ABORT: u32 = 4;

/// Spin limit when the host has a core per rank.
const DEFAULT_SPIN: Duration = Duration::from_millis(1);

/// How long closing waits for peers to acknowledge what was sent.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// How long dropping a client without `shutdown()` blocks, at most, so that its close reaches
/// the peers before the process exits.
const DROP_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// On that path, how long each of the flush and the bulk goodbyes may take: together well
/// inside [`DROP_CLOSE_WAIT`], so that the connection close (which carries the reason) is sent
/// before the process exits even when the peers are slow to acknowledge (a busy machine).
/// With [`FLUSH_LIMIT`] there, a slow flush outlasted the wait and the peers learnt of the
/// departure only from the idle timeout.
const DROP_FLUSH_LIMIT: Duration = Duration::from_millis(300);

/// On that path, how long the connections' drivers get to send the close frames once queued.
const DROP_SEND_CLOSE: Duration = Duration::from_millis(200);

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
    fn new(inner: &Arc<Inner>) -> Arc<Self> {
        let user = Arc::new(UserHandles { inner: Arc::downgrade(inner) });
        let _ = inner.user.set(Arc::downgrade(&user));
        user
    }
}

impl Drop for UserHandles {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.leave_unannounced();
        }
    }
}

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
    pub spin: super::spin::SpinGovernor,
    pub pings: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    /// Wakes whoever waits for peers' goodbyes.
    goodbyes: Notify,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    seed: Option<Connection>,
    /// The RPC functions linked into this program.
    pub registry: Arc<Registry>,
    /// Calls waiting for their response, by (the world rank called, request id): only the rank
    /// a call went to can answer it.
    pub rpc_pending: Mutex<HashMap<(u32, u64), RpcReply>>,
    /// The next request id.
    pub next_req: AtomicU64,
    /// What each peer said it serves: function id → signature hash.
    pub peer_registries: Mutex<Vec<Option<HashMap<u64, u64>>>>,
    /// Which peers are alive.
    pub health: Health,
    /// What the launcher said of this rank, and the seed it hosts (set by `init`).
    pub launch: std::sync::OnceLock<super::init::Launched>,
    /// Woken whenever a rank that joined later connects.
    pub joined: Notify,
    /// The world size the cluster formed with (the topology is laid over it).
    pub initial_world: usize,
    /// Next hops to ranks without a direct link.
    pub routes: Mutex<RouteCache>,
    /// The keys that seal this rank's relayed messages end to end (none in a cluster started
    /// with `connect_static`).
    pub relay_seals: Option<Arc<RelaySeals>>,
    /// World ranks that joined the running cluster and connected to this rank, in order.
    pub late_joiners: Mutex<Vec<usize>>,
    /// Late joiners that became members of a communicator of this rank.
    pub admitted: Mutex<std::collections::BTreeSet<usize>>,
    /// The communicator this rank was admitted to after joining a running cluster, if any:
    /// `(id, members)`.
    pub admission: tokio::sync::watch::Sender<Option<(u64, Vec<usize>)>>,
    /// Transport back ends' setup messages waiting to be taken.
    pub setup: super::backend::SetupInbox,
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

/// Where a pending RPC call's answer goes: (status, payload).
pub(crate) type RpcReply = oneshot::Sender<(u8, Payload)>;

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

/// A rank's join through a seed: the connection it keeps to the seed, whether the cluster was
/// already running, and the peer table's key pins (each rank admitted only with its own key).
pub(crate) struct SeedSession {
    pub conn: Connection,
    pub running: bool,
    pub pins: Vec<Option<crate::transport::tls::KeyPin>>,
}

/// What a rank proves itself with: its certificate and key, the cluster CA, and the relay keys
/// that seal its relayed messages end to end (none in a cluster started with `connect_static`).
pub(crate) struct RankKeys<'a> {
    pub identity: &'a Identity,
    pub ca: &'a CertificateDer<'static>,
    pub relay: Option<RelaySeals>,
}

impl NexarClient {
    /// Forms an `n`-rank cluster inside this process, connected by real, encrypted QUIC on
    /// 127.0.0.1, and returns one client per rank (index = rank).
    ///
    /// `n == 0` is an error. Must be called inside a tokio runtime.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// let ranks = nexar::NexarClient::bootstrap_local(4).await?;
    /// assert_eq!(ranks.len(), 4);
    /// # Ok(()) }
    /// ```
    pub async fn bootstrap_local(n: usize) -> Result<Vec<NexarClient>, NexarError> {
        Self::bootstrap_local_with(n, NexarConfig::default()).await
    }

    /// [`bootstrap_local`](Self::bootstrap_local) with an explicit configuration.
    pub async fn bootstrap_local_with(n: usize, config: NexarConfig) -> Result<Vec<NexarClient>, NexarError> {
        Ok(cluster::bootstrap_local(vec![config; n]).await?)
    }

    /// Like [`bootstrap_local_with`](Self::bootstrap_local_with), with a configuration per
    /// rank (index = rank): say, one rank on a lossy network for a resilience test.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// use nexar::transport::chaos::NetChaos;
    /// let mut cfgs = vec![nexar::NexarConfig::default(); 3];
    /// cfgs[2].chaos = Some(NetChaos { loss: 0.05, ..Default::default() });
    /// let ranks = nexar::NexarClient::bootstrap_local_each(cfgs).await?;
    /// # Ok(()) }
    /// ```
    pub async fn bootstrap_local_each(configs: Vec<NexarConfig>) -> Result<Vec<NexarClient>, NexarError> {
        Ok(cluster::bootstrap_local(configs).await?)
    }

    /// Joins a cluster through the seed at `seed_addr` with the token the seed printed.
    ///
    /// The worker verifies the seed by the CA fingerprint in the token, generates its own key
    /// (which never leaves this process), receives a certificate bound to its rank, waits for
    /// every worker to join, and connects directly to each of them.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// let token = std::env::var("NEXAR_TOKEN").unwrap();
    /// let client = nexar::NexarClient::connect("10.0.0.1:7000".parse().unwrap(), &token, Default::default()).await?;
    /// println!("I am rank {} of {}", client.rank(), client.world_size());
    /// # Ok(()) }
    /// ```
    pub async fn connect(seed_addr: SocketAddr, token: &str, config: NexarConfig) -> Result<NexarClient, NexarError> {
        config.validate()?;
        let token: JoinToken = token.parse()?;
        let endpoint = endpoint::bind(config.listen_addr, &config, None)?;
        let claim = crate::proto::message::RankClaim::default();
        let joined = cluster::join(&endpoint, seed_addr, &cluster::Credentials::Token(token), &claim, &config).await?;
        Self::from_joined(endpoint, joined, config).await
    }

    /// Joins through a seed started with the job's shared secret
    /// ([`SeedNode::bind_with_secret`](crate::SeedNode::bind_with_secret), or the seed that
    /// [`init`](Self::init)'s rank 0 hosts). The seed proves it knows the secret first, on this
    /// TLS session; only then does this worker prove it, and trust the CA the seed presented.
    /// The seed assigns the rank.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// use nexar::cluster::SharedSecret;
    /// let secret = SharedSecret::new(std::env::var("NEXAR_SECRET").unwrap_or_default())?;
    /// let client = nexar::NexarClient::connect_with_secret("10.0.0.1:7000".parse().unwrap(), &secret, Default::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with_secret(
        seed_addr: SocketAddr,
        secret: &cluster::SharedSecret,
        config: NexarConfig,
    ) -> Result<NexarClient, NexarError> {
        config.validate()?;
        let endpoint = endpoint::bind(config.listen_addr, &config, None)?;
        let claim = crate::proto::message::RankClaim::default();
        let credentials = cluster::Credentials::Secret(secret.clone());
        let joined = cluster::join(&endpoint, seed_addr, &credentials, &claim, &config).await?;
        Self::from_joined(endpoint, joined, config).await
    }

    /// The client of a worker the seed has welcomed: connects it to its peers.
    pub(crate) async fn from_joined(
        endpoint: Endpoint,
        joined: cluster::Joined,
        config: NexarConfig,
    ) -> Result<NexarClient, NexarError> {
        let mut config = config;
        if joined.running {
            // A late joiner connects to every live rank, whatever the topology: the others
            // route to it over that direct link.
            config.topology = crate::proto::topology::Topology::FullMesh;
        }
        let client = Self::from_parts(
            joined.rank,
            endpoint,
            &joined.addrs,
            RankKeys { identity: &joined.identity, ca: &joined.ca, relay: joined.relay },
            config,
            Some(SeedSession { conn: joined.seed, running: joined.running, pins: joined.pins }),
        )
        .await?;
        Ok(client)
    }

    /// Joins using `NEXAR_SEED_ADDR`, `NEXAR_TOKEN` and the other `NEXAR_*` variables.
    pub async fn from_env() -> Result<NexarClient, NexarError> {
        let config = NexarConfig::from_env()?;
        let seed = match config.seed_addr {
            Some(addr) => addr,
            None => {
                // A host name: resolve it.
                let text = std::env::var("NEXAR_SEED_ADDR")
                    .map_err(|_| ConfigError::Missing { what: "the seed address", var: "NEXAR_SEED_ADDR" })?;
                let resolved = tokio::net::lookup_host(&text).await.ok().and_then(|mut a| a.next());
                resolved.ok_or_else(|| ClusterError::SeedUnreachable {
                    seed: text.clone(),
                    source_vars: "NEXAR_SEED_ADDR".into(),
                    after: Duration::ZERO,
                    attempts: 1,
                    last: "the host name does not resolve".into(),
                })?
            }
        };
        let token = config.token.clone().ok_or(ConfigError::Missing { what: "the join token", var: "NEXAR_TOKEN" })?;
        Self::connect(seed, &token, config).await
    }

    /// Joins a cluster with static membership and no seed: every rank knows where every rank
    /// listens (`addrs`, indexed by rank) and holds a certificate from the cluster CA bound to
    /// its own rank (see [`ClusterCa`](crate::transport::tls::ClusterCa)). Listens on
    /// `addrs[rank]`.
    ///
    /// ```no_run
    /// use nexar::transport::tls::{ClusterCa, rank_server_name};
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// let ca = ClusterCa::generate()?;
    /// let addrs = ["127.0.0.1:7101".parse().unwrap(), "127.0.0.1:7102".parse().unwrap()];
    /// let me = ca.issue(&rank_server_name(0))?; // in practice issued once, provisioned per host
    /// let client = nexar::NexarClient::connect_static(0, &addrs, &me, &ca.cert_der(), Default::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_static(
        rank: usize,
        addrs: &[SocketAddr],
        identity: &Identity,
        ca_der: &[u8],
        config: NexarConfig,
    ) -> Result<NexarClient, NexarError> {
        config.validate()?;
        let listen = *addrs.get(rank).ok_or(ClusterError::Mesh {
            rank,
            reason: format!("rank {rank} is outside the {}-rank address list", addrs.len()),
        })?;
        let ca = CertificateDer::from(ca_der.to_vec());
        let server = endpoint::server_with_transport(mesh_server(identity, &ca)?, &config);
        let endpoint = endpoint::bind(listen, &config, Some(server))?;
        let keys = RankKeys { identity, ca: &ca, relay: None };
        Ok(Self::from_parts(rank, endpoint, addrs, keys, config, None).await?)
    }

    pub(crate) async fn from_parts(
        rank: usize,
        endpoint: Endpoint,
        addrs: &[SocketAddr],
        keys: RankKeys<'_>,
        cfg: NexarConfig,
        seed: Option<SeedSession>,
    ) -> Result<NexarClient, ClusterError> {
        let RankKeys { identity, ca, relay } = keys;
        // Before the links exist, so that their counters go to the exporter's recorder.
        if let Some(addr) = cfg.metrics_addr {
            crate::telemetry::start_exporter(addr)?;
        }
        if relay.is_none() && cfg.topology != crate::proto::topology::Topology::FullMesh {
            tracing::warn!(
                rank,
                "this cluster has no relay keys (connect_static): on a sparse topology, messages relayed through \
                 other ranks are protected hop by hop only, so a relaying member could alter them"
            );
        }
        // Joined through a seed (elastic), whether the cluster was already running then, and
        // the keys the seed certified.
        let (seed, running, pins) = match seed {
            Some(SeedSession { conn, running, pins }) => (Some(conn), running, pins),
            None => (None, false, Vec::new()),
        };
        match rank_from_cert(identity.cert()) {
            Ok(bound) if bound as usize == rank => {}
            Ok(bound) => {
                return Err(ClusterError::Mesh {
                    rank,
                    reason: format!("this rank's certificate is bound to rank {bound}, not rank {rank}"),
                });
            }
            Err(e) => return Err(e.into()),
        }
        let registry = Arc::new(Registry::collect().map_err(ClusterError::RpcRegistry)?);
        // The limits are shared fairly among the peers (each has a reserved share).
        let senders = addrs.len().saturating_sub(1).max(1);
        let mailbox = Arc::new(Mailbox::with_senders(cfg.max_unmatched_messages, cfg.max_unmatched_bytes, senders));
        // Collective messages are bounded by the schedules that send them; the limit only
        // stops a runaway peer.
        let coll =
            Arc::new(Mailbox::with_senders(COLL_MAX_HELD, cfg.max_unmatched_bytes.max(cfg.max_message_bytes), senders));
        let (senders, receivers) = lanes(cfg.lane_capacity);
        // Room for ranks that join the running cluster later.
        let capacity = cfg.max_world_size.max(addrs.len());
        let liveness = Arc::new(Liveness::new(capacity));
        let (forward_tx, forward_rx): (Vec<_>, Vec<_>) =
            (0..Lane::COUNT).map(|_| mpsc::channel(cfg.lane_capacity)).unzip();
        let queues = forward_tx.try_into().map_err(|_| ClusterError::Mesh { rank, reason: "lane count".into() })?;
        // Only ranks the topology gives no direct link to this one are ever relayed here (a rank
        // that joins later links to everyone directly).
        let mut relayed_sources = vec![false; capacity];
        if !running {
            let neighbors = cfg.topology.neighbors(rank, addrs.len());
            for (src, relayed) in relayed_sources.iter_mut().enumerate().take(addrs.len()) {
                *relayed = src != rank && neighbors.binary_search(&src).is_err();
            }
        }
        let relay_seals = relay.map(Arc::new);
        let hook = RelayHook {
            local: rank as u32,
            forward: queues,
            max_payload: cfg.max_message_bytes,
            relayed_sources: relayed_sources.into(),
            seals: relay_seals.clone(),
            budget: ByteBudget::new(RELAY_BUDGET_BYTES),
        };
        let senders = senders
            .with_liveness(liveness.clone())
            .with_relay(hook)
            .with_rpc_budget(cfg.max_rpc_bytes.min(cfg.max_message_bytes))
            .with_direct(Lane::Data, DirectSink { mailbox: mailbox.clone(), entry: p2p_entry })
            .with_direct(Lane::Raw, DirectSink { mailbox: coll.clone(), entry: coll_entry });
        let (elastic, topology) = (seed.is_some(), cfg.topology);
        let setup = MeshSetup {
            rank,
            addrs,
            identity,
            ca,
            cfg: &cfg,
            lanes: senders.clone(),
            capacity,
            elastic,
            topology,
            late: running,
            pins: &pins,
        };
        let mesh = cluster::form_mesh(&endpoint, setup).await?;
        let mut late = mesh.late;
        // The data and raw lanes go straight into the mailboxes; their queues stay unused.
        let LaneReceivers { rpc_requests, rpc_responses, control, .. } = receivers;
        let world = addrs.len();
        let spin = super::spin::SpinGovernor::new(cfg.spin.unwrap_or_else(|| default_spin(addrs, rank)));
        if !cfg.bulk_encryption && cfg.bulk_transport == crate::BulkTransport::Tcp {
            tracing::warn!(
                rank,
                "INSECURE: NEXAR_BULK_ENCRYPTION=off: collective payloads on the TCP lanes travel unencrypted and \
                 unauthenticated; use it only on a trusted, isolated fabric"
            );
        }
        let trace_cfg = cfg.trace.clone();
        let inner = Arc::new(Inner {
            rank,
            cfg,
            endpoint,
            links: Links::new(capacity, mesh.links),
            self_lanes: senders,
            mailbox,
            coll,
            pool: Arc::new(BufferPool::default()),
            spin,
            pings: Mutex::new(HashMap::new()),
            goodbyes: Notify::new(),
            tasks: Mutex::new(vec![mesh.acceptor]),
            seed,
            registry: registry.clone(),
            rpc_pending: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(0),
            peer_registries: Mutex::new(vec![None; capacity]),
            health: Health::new(liveness),
            launch: std::sync::OnceLock::new(),
            joined: Notify::new(),
            initial_world: addrs.len(),
            routes: route_cache(),
            relay_seals,
            late_joiners: Mutex::new(Vec::new()),
            admitted: Mutex::new(std::collections::BTreeSet::new()),
            admission: tokio::sync::watch::channel(None).0,
            setup: Default::default(),
            trace: crate::trace::RankTrace::new(&trace_cfg, rank, world, cluster_id(ca)),
            positions: Mutex::new(HashMap::new()),
            user: std::sync::OnceLock::new(),
            left: std::sync::atomic::AtomicBool::new(false),
        });
        let world_comm = Arc::new(CommState::world(rank, world));
        let span = tracing::debug_span!("rank", rank);
        let control = tokio::spawn(serve_control(Arc::downgrade(&inner), control).instrument(span.clone()));
        let max_handlers = inner.cfg.max_rpc_handlers;
        let requests =
            tokio::spawn(serve_requests(Arc::downgrade(&inner), rpc_requests, max_handlers).instrument(span.clone()));
        let responses = tokio::spawn(serve_responses(Arc::downgrade(&inner), rpc_responses).instrument(span.clone()));
        let (interval, timeout) = (inner.cfg.heartbeat_interval, inner.cfg.heartbeat_timeout);
        let health = tokio::spawn(monitor(Arc::downgrade(&inner), interval, timeout).instrument(span.clone()));
        let meter = tokio::spawn(super::meter::sample_periodically(Arc::downgrade(&inner)).instrument(span.clone()));
        crate::sync::lock(&inner.tasks).extend([control, requests, responses, health, meter]);
        for queue in forward_rx {
            let relays = tokio::spawn(forward(Arc::downgrade(&inner), queue).instrument(span.clone()));
            crate::sync::lock(&inner.tasks).push(relays);
        }
        if inner.cfg.recovery_policy == RecoveryPolicy::Automatic {
            let task = tokio::spawn(recover_automatically(Arc::downgrade(&inner), world_comm.clone()));
            crate::sync::lock(&inner.tasks).push(task);
        }
        for link in inner.links.iter() {
            inner.welcome_link(link).await;
        }
        // Workers that join the running cluster later dial in here.
        let weak = Arc::downgrade(&inner);
        let joiners = tokio::spawn(
            async move {
                while let Some((peer, conn)) = late.recv().await {
                    let Some(inner) = weak.upgrade() else { return };
                    let link = PeerLink::spawn(
                        inner.rank as u32,
                        peer,
                        conn,
                        inner.self_lanes.clone(),
                        inner.cfg.max_message_bytes,
                    );
                    match inner.links.install(peer as usize, link) {
                        Ok(link) => {
                            tracing::info!(peer, "a rank that joined the running cluster connected");
                            inner.health.liveness.heard(peer);
                            inner.welcome_link(link).await;
                            crate::sync::lock(&inner.late_joiners).push(peer as usize);
                            inner.joined.notify_waiters();
                        }
                        Err(link) => link.close(CLOSE_SHUTDOWN, "this rank already has a link to that rank"),
                    }
                }
            }
            .instrument(span),
        );
        crate::sync::lock(&inner.tasks).push(joiners);
        let client = NexarClient { user: UserHandles::new(&inner), inner, comm: world_comm };
        // A rank joining the running cluster keeps QUIC: the members are not exchanging now.
        if !running {
            client.bring_up_tcp_lanes(identity, ca).await;
        }
        Ok(client)
    }

    async fn bring_up_tcp_lanes(&self, identity: &Identity, ca: &CertificateDer<'static>) {
        let cfg = self.config();
        let tls = match (cfg.bulk_transport, &cfg.chaos) {
            (BulkTransport::Quic, _) => Err("this rank is set to QUIC (NEXAR_BULK_TRANSPORT=quic)".to_string()),
            // Injected network faults act on QUIC's datagrams.
            (BulkTransport::Tcp, Some(_)) => Err("this rank injects network faults into QUIC".to_string()),
            (BulkTransport::Tcp, None) => {
                crate::transport::tcp_lane::LaneTls::new(identity, ca).map_err(|e| e.to_string())
            }
        };
        let outcomes = self.attach_tcp_lanes(tls.as_ref().map_err(Clone::clone)).await;
        let up = outcomes.iter().filter(|(_, o)| o.is_ok()).count();
        tracing::debug!(rank = self.rank(), up, links = outcomes.len(), "tcp lanes");
    }

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
        NexarClient { user: self.user.clone(), inner: self.inner.clone(), comm: Arc::new(comm) }
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

    /// Leaves the cluster cleanly, like `MPI_Finalize`: flushes everything this rank has sent
    /// (until each peer has acknowledged it), tells every peer goodbye, and keeps serving them
    /// until each has said goodbye too (or its connection is gone, or `op_timeout` passes);
    /// then closes the connections. Every rank calls it before its process exits. Other clones
    /// of this client stop working too.
    pub async fn shutdown(&self) {
        let inner = &self.inner;
        inner.health.begin_shutdown();
        // Goodbyes first, to everyone, so no peer takes the quiet that follows for a failure;
        // then wait (all links at once) until peers have acknowledged everything sent.
        for link in inner.links.iter() {
            if let Err(e) = link.send_queued(&PeerMsg::Goodbye, None).await {
                tracing::debug!(peer = link.peer(), error = %e, "could not say goodbye");
            }
        }
        flush_all(&inner.links, FLUSH_LIMIT).await;
        let all_gone = async {
            loop {
                let notified = inner.goodbyes.notified();
                let waiting = inner
                    .links
                    .iter()
                    .any(|l| !inner.health.has_left(l.peer() as usize) && l.connection().close_reason().is_none());
                if !waiting {
                    return;
                }
                // Re-check now and then: a peer whose connection dies sends no goodbye.
                let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
            }
        };
        // A peer that never calls shutdown() is not waited for longer than it would take to
        // declare it dead.
        let limit = inner.cfg.heartbeat_timeout.min(inner.cfg.op_timeout);
        if tokio::time::timeout(limit, all_gone).await.is_err() {
            let missing: Vec<usize> =
                inner.links.iter().map(|l| l.peer() as usize).filter(|&p| !inner.health.has_left(p)).collect();
            tracing::warn!(
                rank = inner.rank,
                ?missing,
                "shutdown: ranks {missing:?} did not say goodbye within {limit:?} (they never called shutdown()); \
                 closing anyway"
            );
        }
        close_all(&inner.links, inner.seed.as_ref(), &inner.endpoint, "shutdown", FLUSH_LIMIT, false).await;
        inner.mailbox.close();
        inner.coll.close();
        let _ = tokio::time::timeout(Duration::from_secs(1), inner.endpoint.wait_idle()).await;
    }

    /// The route to `peer` (a rank of this communicator).
    pub(crate) fn link(&self, peer: usize) -> Option<Route<'_>> {
        let world = *self.comm.members.get(peer)?;
        self.inner.route(world)
    }
}

/// Spin up to 1 ms while this host runs no more ranks than it has cores; spinning ranks that
/// share cores only steal them from each other.
fn default_spin(addrs: &[SocketAddr], rank: usize) -> Duration {
    let here = addrs[rank].ip();
    let same_host = |a: &SocketAddr| a.ip() == here || (a.ip().is_loopback() && here.is_loopback());
    let local_ranks = addrs.iter().filter(|a| same_host(a)).count();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let spin = if local_ranks <= cores { DEFAULT_SPIN } else { Duration::ZERO };
    tracing::debug!(rank, local_ranks, cores, ?spin, "receive spin");
    spin
}

/// Flushes every link at once, for at most `limit` in all.
async fn flush_all(links: &Links, limit: Duration) {
    let all = async {
        let mut waits = Vec::new();
        for link in links.iter() {
            waits.extend(link.begin_flush().await);
        }
        for wait in waits {
            let _ = wait.await;
        }
    };
    let _ = tokio::time::timeout(limit, all).await;
}

/// Waits for every future, one after the other.
async fn wait_all(all: Vec<crate::transport::bulk::BulkClosed>) {
    for f in all {
        f.await;
    }
}

/// Closes every link with `reason` (each flushed and told goodbye for at most `limit`), then
/// the seed's connection and the endpoint. When `send_close`, waits (briefly) until the
/// connections' drivers have sent the close frames, which `close` only queues.
async fn close_all(
    links: &Links,
    seed: Option<&Connection>,
    endpoint: &Endpoint,
    reason: &str,
    limit: Duration,
    send_close: bool,
) {
    flush_all(links, limit).await;
    let goodbyes: Vec<_> = links.iter().map(|link| link.bulk_slot().goodbye()).collect();
    let _ = tokio::time::timeout(limit, wait_all(goodbyes)).await;
    for link in links.iter() {
        link.close(CLOSE_SHUTDOWN, reason);
    }
    if let Some(seed) = seed {
        seed.close(CLOSE_SHUTDOWN.into(), b"shutdown");
    }
    endpoint.close(CLOSE_SHUTDOWN.into(), reason.as_bytes());
    if send_close {
        let _ = tokio::time::timeout(DROP_SEND_CLOSE, endpoint.wait_idle()).await;
    }
}

/// Runs `close` in the background on the current runtime, or, without one, closes `endpoint`
/// at once. When the rank leaves `unannounced` (the process may be about to exit: `main`
/// returned) on a runtime whose other threads can run the close, waits up to
/// [`DROP_CLOSE_WAIT`] for it to reach the peers.
fn run_close(close: impl Future<Output = ()> + Send + 'static, endpoint: &Endpoint, unannounced: bool) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        endpoint.close(CLOSE_SHUTDOWN.into(), b"shutdown");
        return;
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    handle.spawn(async move {
        close.await;
        let _ = done_tx.send(());
    });
    if unannounced && handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
        let _ = done_rx.recv_timeout(DROP_CLOSE_WAIT);
    }
}

impl Inner {
    /// The program dropped its last handle without `shutdown()` (an error returned with `?`,
    /// a panic): close every link now with the reason, so the peers fail at once naming this
    /// rank, and give the close a moment to leave before the process may exit. Done here and
    /// not only when `Inner` drops, because a task of nexar's may hold `Inner` a little longer,
    /// until the runtime itself is torn down, when nothing can be sent any more.
    fn leave_unannounced(self: Arc<Self>) {
        if self.health.is_shutting_down() || self.left.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let reason = unannounced_reason(self.rank);
        let endpoint = self.endpoint.clone();
        let inner = self;
        let close = async move {
            close_all(&inner.links, inner.seed.as_ref(), &inner.endpoint, &reason, DROP_FLUSH_LIMIT, true).await;
        };
        run_close(close, &endpoint, true);
    }

    /// Starts watching a new link (when its connection ends, receives and collective steps
    /// waiting on that peer fail at once, naming it) and tells the peer which RPC functions
    /// this rank serves, so a call to a missing function fails at once.
    async fn welcome_link(self: &Arc<Self>, link: &PeerLink) {
        let (weak, conn, peer) = (Arc::downgrade(self), link.connection().clone(), link.peer());
        let watcher = tokio::spawn(async move {
            let reason = conn.closed().await;
            if let Some(inner) = weak.upgrade() {
                tracing::debug!(peer, %reason, "peer connection ended");
                inner.connection_ended(peer as usize, &reason);
            }
        });
        crate::sync::lock(&self.tasks).push(watcher);
        let announce = PeerMsg::Registry { entries: self.registry.entries() };
        if let Err(e) = link.send_queued(&announce, None).await {
            tracing::debug!(peer, error = %e, "could not announce the rpc registry");
        }
    }

    /// Closes every connection at once with `reason` (see [`NexarClient::abort`]).
    pub(crate) fn abort_all(&self, reason: &str) {
        self.health.begin_shutdown();
        for link in self.links.iter() {
            link.close(CLOSE_ABORT, reason);
        }
        self.endpoint.close(CLOSE_ABORT.into(), reason.as_bytes());
        self.mailbox.close();
        self.coll.close();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in self.tasks.get_mut().map(std::mem::take).unwrap_or_default() {
            task.abort();
        }
        if *self.left.get_mut() {
            return;
        }
        let links = std::mem::take(&mut self.links);
        let endpoint = self.endpoint.clone();
        let seed = self.seed.take();
        // Without `shutdown()`, peers learn at once that this rank left, and why, rather than
        // from a heartbeat timeout: the way a program that returns an error with `?` ends.
        let clean = self.health.is_shutting_down();
        let reason = if clean { "shutdown".to_string() } else { unannounced_reason(self.rank) };
        let limit = if clean { FLUSH_LIMIT } else { DROP_FLUSH_LIMIT };
        let close = async move { close_all(&links, seed.as_ref(), &endpoint, &reason, limit, !clean).await };
        run_close(close, &self.endpoint, !clean);
    }
}

/// Why a rank that dropped its client without `shutdown()` left, as its peers are told.
fn unannounced_reason(rank: usize) -> String {
    format!("rank {rank} dropped its client without calling shutdown() (its program ended or failed)")
}

/// The cluster's id in flight-recorder dumps: the start of its CA certificate's fingerprint,
/// the same on every rank of one cluster.
fn cluster_id(ca: &CertificateDer<'static>) -> String {
    hex::encode(&crate::transport::tls::fingerprint(ca.as_ref())[..6])
}

/// Answers pings and completes our own.
async fn serve_control(inner: Weak<Inner>, mut control: mpsc::Receiver<Incoming>) {
    while let Some(incoming) = control.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        match incoming.msg {
            PeerMsg::Ping { nonce } => {
                if let Some(link) = inner.route(incoming.from as usize) {
                    let link_msg = PeerMsg::Pong { nonce };
                    if let Err(e) = link.send(&link_msg, None).await {
                        tracing::debug!(peer = incoming.from, error = %e, "could not answer a ping");
                    }
                }
            }
            PeerMsg::Pong { nonce } => {
                if let Some(tx) = crate::sync::lock(&inner.pings).remove(&nonce) {
                    let _ = tx.send(());
                }
            }
            PeerMsg::Goodbye => {
                inner.health.said_goodbye(incoming.from as usize);
                inner.goodbyes.notify_waiters();
            }
            PeerMsg::Abort { comm, seq, reason } => {
                tracing::debug!(from = incoming.from, comm, seq, %reason, "a peer aborted a collective");
                inner.coll.abort(comm, seq, &reason);
            }
            PeerMsg::Registry { entries } => {
                if let Some(slot) = crate::sync::lock(&inner.peer_registries).get_mut(incoming.from as usize) {
                    *slot = Some(entries.into_iter().collect());
                }
            }
            PeerMsg::Admit { comm, members } => {
                let members: Vec<usize> = members.into_iter().map(|m| m as usize).collect();
                if members.len() <= inner.links.capacity() && members.contains(&inner.rank) {
                    tracing::info!(
                        from = incoming.from,
                        comm,
                        world = members.len(),
                        "admitted to a grown communicator"
                    );
                    inner.admission.send_replace(Some((comm, members)));
                } else {
                    tracing::warn!(from = incoming.from, "ignored an admission that does not name this rank");
                }
            }
            PeerMsg::Suspect { rank, reason } => inner.suspected(incoming.from as usize, rank as usize, reason),
            PeerMsg::Setup { tag: crate::transport::bulk::BULK_DOWN_TAG, body } => {
                if let Some(link) = inner.links.get(incoming.from as usize) {
                    // Answered with what this side carried, so both sides fail the same set.
                    link.bulk_slot().fail(crate::transport::bulk::decode_keys(&body));
                }
            }
            PeerMsg::Setup { tag, body } => inner.setup.put(incoming.from, tag, body),
            PeerMsg::WhereAreYou { nonce, comm } => inner.answer_position(incoming.from, nonce, comm).await,
            PeerMsg::Position { nonce, comm: _, active, last_started, last_completed } => {
                let mut positions = crate::sync::lock(&inner.positions);
                // Only the rank asked can answer.
                if positions.get(&nonce).is_some_and(|(asked, _)| *asked == incoming.from)
                    && let Some((_, tx)) = positions.remove(&nonce)
                {
                    let _ = tx.send(crate::trace::Answer::Position { active, last_started, last_completed });
                }
            }
            PeerMsg::P2p { .. }
            | PeerMsg::Coll { .. }
            | PeerMsg::RpcRequest { .. }
            | PeerMsg::RpcResponse { .. }
            | PeerMsg::Heartbeat
            | PeerMsg::Relay { .. } => {}
        }
    }
}
