//! Building a client: an in-process cluster (`bootstrap_local*`), a join through a seed
//! (`connect*`, and `from_env` under a launcher), or a static address list
//! (`connect_static`). Every way ends in `from_parts`, which starts the rank's tasks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quinn::{Connection, Endpoint};
use rustls::pki_types::CertificateDer;
use tokio::sync::{Notify, mpsc};
use tracing::Instrument;

use crate::cluster::{self, ClusterError, JoinToken, LocalMesh, LocalRank, MeshSetup};
use crate::comm::client::control::serve_control;
use crate::comm::client::{Inner, NexarClient, UserHandles};
use crate::comm::exec::spin::YIELDING_SPIN;
use crate::comm::matcher::Mailbox;
use crate::comm::membership::health::{Health, recover_automatically};
use crate::comm::membership::monitor::monitor;
use crate::comm::membership::route::forward;
use crate::comm::state::CommState;
use crate::config::{BulkTransport, ConfigError, NexarConfig, RecoveryPolicy};
use crate::error::NexarError;
use crate::proto::close::CloseCode;
use crate::rpc::{Registry, serve_requests, serve_responses};
use crate::transport::byte_budget::ByteBudget;
use crate::transport::endpoint;
use crate::transport::link::RELAY_BUDGET_BYTES;
use crate::transport::link::{Lane, LaneReceivers, PeerLink, RelayHook, lanes};
use crate::transport::links::Links;
use crate::transport::liveness::Liveness;
use crate::transport::pool::BufferPool;
use crate::transport::relay_seal::RelaySeals;
use crate::transport::tls::{Identity, mesh_server, rank_from_cert};

/// Collective messages a rank may hold before it stops reading the raw lane.
const COLL_MAX_HELD: usize = 1 << 16;

/// Spin limit when the host has a core per rank.
const DEFAULT_SPIN: Duration = Duration::from_millis(1);

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
        Self::bootstrap_local_each(vec![config; n]).await
    }

    /// Like [`bootstrap_local_with`](Self::bootstrap_local_with), with a configuration per
    /// rank (index = rank): say, one rank on a lossy network for a resilience test.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// use nexar::NetChaos;
    /// let mut cfgs = vec![nexar::NexarConfig::default(); 3];
    /// cfgs[2].chaos = Some(NetChaos { loss: 0.05, ..Default::default() });
    /// let ranks = nexar::NexarClient::bootstrap_local_each(cfgs).await?;
    /// # Ok(()) }
    /// ```
    pub async fn bootstrap_local_each(configs: Vec<NexarConfig>) -> Result<Vec<NexarClient>, NexarError> {
        let LocalMesh { ranks, addrs, ca } = cluster::local_mesh(&configs)?;
        let n = ranks.len();
        let mut tasks = tokio::task::JoinSet::new();
        for (rank, (LocalRank { endpoint, identity, relay }, cfg)) in ranks.into_iter().zip(configs).enumerate() {
            let (addrs, ca) = (addrs.clone(), ca.clone());
            tasks.spawn(async move {
                let keys = RankKeys { identity: &identity, ca: &ca, relay: Some(relay) };
                NexarClient::from_parts(rank, endpoint, &addrs, keys, cfg, None).await.map(|c| (rank, c))
            });
        }
        let mut clients: Vec<Option<NexarClient>> = (0..n).map(|_| None).collect();
        while let Some(done) = tasks.join_next().await {
            let (rank, client) =
                done.map_err(|e| ClusterError::Mesh { rank: 0, reason: format!("a rank's task failed: {e}") })??;
            clients[rank] = Some(client);
        }
        Ok(clients.into_iter().flatten().collect())
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
        let token: JoinToken = token.parse().map_err(ClusterError::from)?;
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
    /// its own rank (see [`ClusterCa`](crate::tls::ClusterCa)). Listens on
    /// `addrs[rank]`.
    ///
    /// ```no_run
    /// use nexar::tls::{ClusterCa, rank_server_name};
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
        let coll = Arc::new(Mailbox::for_collectives(
            COLL_MAX_HELD,
            cfg.max_unmatched_bytes.max(cfg.max_message_bytes),
            senders,
        ));
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
            .with_direct(Lane::Data, mailbox.clone())
            .with_direct(Lane::Raw, coll.clone());
        // A late joiner connects to every live rank, whatever the topology: the others route
        // to it over that direct link. Its configuration keeps the cluster's topology, which
        // says how the others watch it (`comm/membership/monitor.rs`).
        let topology = if running { crate::proto::topology::Topology::FullMesh } else { cfg.topology };
        let elastic = seed.is_some();
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
        let LaneReceivers { rpc_requests, rpc_responses, control } = receivers;
        let world = addrs.len();
        let spin = spin_governor(&cfg, addrs, rank);
        if !cfg.bulk_encryption && cfg.bulk_transport == BulkTransport::Tcp {
            tracing::warn!(
                rank,
                "INSECURE: NEXAR_BULK_ENCRYPTION=off: collective payloads on the TCP lanes travel unencrypted and \
                 unauthenticated; use it only on a trusted, isolated fabric"
            );
        }
        let trace_cfg = cfg.trace.clone();
        let routes = cluster::Routes::new(rank, addrs.len(), capacity, cfg.topology);
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
            probes: Mutex::new(HashMap::new()),
            probing: Default::default(),
            refuted_at: Default::default(),
            liveness_sent: Default::default(),
            goodbyes: Notify::new(),
            tasks: Mutex::new(vec![mesh.acceptor]),
            seed,
            rpc: crate::rpc::RpcService::new(registry.clone(), capacity),
            health: Health::new(liveness),
            rebuilt: tokio::sync::watch::channel((0, None)).0,
            launch: std::sync::OnceLock::new(),
            initial_world: addrs.len(),
            host_keys: std::sync::OnceLock::new(),
            host_pids: std::sync::OnceLock::new(),
            routes,
            relay_seals,
            growth: Default::default(),
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
        let requests = tokio::spawn(
            serve_requests(Arc::downgrade(&inner), world_comm.clone(), rpc_requests, max_handlers)
                .instrument(span.clone()),
        );
        let responses = tokio::spawn(serve_responses(Arc::downgrade(&inner), rpc_responses).instrument(span.clone()));
        let (interval, timeout) = (inner.cfg.heartbeat_interval, inner.cfg.heartbeat_timeout);
        let health = tokio::spawn(monitor(Arc::downgrade(&inner), interval, timeout).instrument(span.clone()));
        let meter = tokio::spawn(
            crate::comm::diagnostics::meter::sample_periodically(Arc::downgrade(&inner)).instrument(span.clone()),
        );
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
                            inner.growth.connected(peer as usize);
                        }
                        Err(link) => link.close(CloseCode::Shutdown, "this rank already has a link to that rank"),
                    }
                }
            }
            .instrument(span),
        );
        crate::sync::lock(&inner.tasks).push(joiners);
        let client = NexarClient { user: UserHandles::new(&inner), inner, comm: world_comm };
        // A rank joining the running cluster keeps QUIC: the members are not exchanging now.
        if !running {
            // The host table first: it sizes the shared-memory rings.
            client.learn_hosts().await;
            let shm = client.attach_shared_memory().await;
            tracing::debug!(rank = client.rank(), peers = ?shm, "shared-memory links");
            client.bring_up_tcp_lanes(identity, ca).await;
        }
        Ok(client)
    }

    async fn bring_up_tcp_lanes(&self, identity: &Identity, ca: &CertificateDer<'static>) {
        let cfg = self.config();
        let tls = match (cfg.bulk_transport, &cfg.chaos) {
            (BulkTransport::Quic, _) => Err("this rank is set to QUIC (NEXAR_BULK_TRANSPORT=quic)".to_string()),
            // Injected network faults act on QUIC's datagrams.
            (BulkTransport::Tcp, Some(_)) => Err(crate::transport::chaos::KEEPS_QUIC.to_string()),
            (BulkTransport::Tcp, None) => {
                crate::transport::tcp_lane::LaneTls::new(identity, ca).map_err(|e| e.to_string())
            }
        };
        let outcomes = self.attach_tcp_lanes(tls.as_ref().map_err(Clone::clone)).await;
        let up = outcomes.iter().filter(|(_, o)| o.is_ok()).count();
        tracing::debug!(rank = self.rank(), up, links = outcomes.len(), "tcp lanes");
    }
}

/// The receive spin: up to 1 ms while this host runs no more ranks than it has cores. Where
/// ranks share cores a spin that held its core would steal it from the rank it waits for, so
/// there a spin yields the core between polls, for up to [`YIELDING_SPIN`], where
/// [`spins_yield`] says it pays; elsewhere every wait parks at once. The configuration
/// overrides either.
fn spin_governor(cfg: &NexarConfig, addrs: &[SocketAddr], rank: usize) -> crate::comm::exec::spin::SpinGovernor {
    let here = addrs[rank].ip();
    let local_ranks = addrs.iter().filter(|a| crate::transport::endpoint::same_host(here, a.ip())).count();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let shares_cores = local_ranks > cores;
    let one_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
    let yields =
        cfg.spin_yield.unwrap_or(shares_cores && cfg.shared_memory && spins_yield(local_ranks, cores, one_thread));
    let window = cfg.spin.unwrap_or(match (yields, shares_cores) {
        (true, _) => YIELDING_SPIN,
        (false, true) => Duration::ZERO,
        (false, false) => DEFAULT_SPIN,
    });
    tracing::debug!(rank, local_ranks, cores, one_thread, ?window, yields, "receive spin");
    crate::comm::exec::spin::SpinGovernor::new(window, yields)
}

/// Whether receives on a host of `local_ranks` ranks (talking through shared memory) and
/// `cores` cores, more ranks than cores, should yield their core between polls rather than
/// park: only on a runtime of one thread (`one_thread`), at any number of ranks a core.
/// Measured on 2 cores with `bench/scale.py`'s program (4 KiB allreduce p50, yielding against
/// parking; 2026-12-02):
/// - a current-thread runtime: 42 against 140 µs at 4 ranks, 207 / 450 µs at 8, 0.6 / 1.5 ms
///   at 16, 1.7 / 3.2 ms at 32, 5.2–5.6 / 9.0–11.6 ms at 64 and 21 / 29 ms at 128 (once a
///   yield no longer gave way to parking after a long turn away, which at many ranks a core
///   is every turn: [`YIELDING_SPIN`](crate::comm::exec::spin::YIELDING_SPIN));
/// - a multi-threaded runtime (`#[tokio::main]`): 639 against 260 µs at 4 ranks, 38 / 19 ms at
///   64, and a formation that took 1–2 s instead of 0.06 at 4: the yielding thread holds its
///   core while the runtime's other threads, which drive the links, wait for one.
fn spins_yield(local_ranks: usize, cores: usize, one_thread: bool) -> bool {
    one_thread && local_ranks > cores
}

/// The cluster's id in flight-recorder dumps: the start of its CA certificate's fingerprint,
/// the same on every rank of one cluster.
fn cluster_id(ca: &CertificateDer<'static>) -> String {
    hex::encode(&crate::transport::tls::fingerprint(ca.as_ref())[..6])
}

#[cfg(test)]
mod tests {
    use super::spins_yield;

    #[test]
    fn spins_yield_only_on_one_runtime_thread_where_ranks_outnumber_cores() {
        assert!(spins_yield(4, 2, true));
        assert!(spins_yield(17, 2, true));
        assert!(spins_yield(1024, 2, true));
        assert!(!spins_yield(2, 2, true));
        assert!(!spins_yield(64, 2, false));
        assert!(spins_yield(8, 0, true));
    }
}
