//! Runtime configuration: defaults, and overrides from `NEXAR_*` environment variables.
//!
//! Every wait in nexar takes its limit from here; this module is the one place where defaults
//! live.

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use crate::proto::algo::Algorithm;
use crate::proto::topology::Topology;

/// How long a cluster's certificates are valid unless configured
/// ([`NexarConfig::cert_lifetime`]): 30 days.
///
/// ```
/// assert_eq!(nexar::tls::DEFAULT_CERT_LIFETIME.as_secs(), 30 * 24 * 3600);
/// ```
pub const DEFAULT_CERT_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);

mod builder;
mod chaos;
mod env;
mod lane_aes;
mod lane_cipher;
mod lane_congestion;
mod trace_config;

pub use builder::NexarConfigBuilder;
pub use chaos::{NetChaos, Silence};
pub use lane_aes::LaneAes;
pub use lane_cipher::LaneCipher;
pub use lane_congestion::LaneCongestion;
pub use trace_config::TraceConfig;

pub(crate) use env::{invalid, parse};

/// An environment variable held a value nexar cannot use.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The variable is set but its value does not parse or is out of range.
    #[error("invalid value {value:?} for {var}: {reason}")]
    InvalidVar {
        /// The variable's name.
        var: &'static str,
        /// The value found.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// A setting that an operation needs was not given.
    #[error("{what} is not set (set {var} or pass it explicitly)")]
    Missing {
        /// What is missing.
        what: &'static str,
        /// The variable that would provide it.
        var: &'static str,
    },
}

/// Configuration of a seed node or a worker.
///
/// Build it with [`NexarConfig::builder`] (checked when built), read overrides from the
/// environment with [`NexarConfig::from_env`], or start from [`NexarConfig::default`] and
/// assign fields. It is `#[non_exhaustive]`: new settings may come in any release, so code
/// outside nexar cannot write it as a struct literal.
///
/// ```
/// use std::time::Duration;
/// let cfg = nexar::NexarConfig::builder().op_timeout(Duration::from_secs(30)).build().unwrap();
/// assert_eq!(cfg.max_unmatched_messages, 1024);
///
/// let mut cfg = nexar::NexarConfig::default();
/// cfg.op_timeout = Duration::from_secs(30);
/// ```
#[derive(Clone, PartialEq)]
#[non_exhaustive]
pub struct NexarConfig {
    /// Number of workers the seed waits for before it publishes the peer table
    /// (`NEXAR_WORLD_SIZE`). Needed by the seed only.
    pub world_size: Option<usize>,
    /// Address of the seed node (`NEXAR_SEED_ADDR`), used by [`NexarClient::from_env`].
    ///
    /// [`NexarClient::from_env`]: crate::NexarClient::from_env
    pub seed_addr: Option<SocketAddr>,
    /// Join token printed by the seed (`NEXAR_TOKEN`), used by [`NexarClient::from_env`].
    ///
    /// [`NexarClient::from_env`]: crate::NexarClient::from_env
    pub token: Option<String>,
    /// Address a worker listens on for its peers (`NEXAR_LISTEN_ADDR`, default `0.0.0.0:0`: every
    /// interface, a free port; the seed then advertises the address it saw the worker come from).
    pub listen_addr: SocketAddr,
    /// Limit for dialling a peer or the seed, handshake included (`NEXAR_CONNECT_TIMEOUT_MS`).
    pub connect_timeout: Duration,
    /// Limit for a joined worker to wait until every worker has joined
    /// (`NEXAR_JOIN_TIMEOUT_MS`).
    pub join_timeout: Duration,
    /// Limit for the mesh to form once the peer table is known (`NEXAR_MESH_TIMEOUT_MS`).
    pub mesh_timeout: Duration,
    /// Limit the seed gives an unauthenticated connection to present its join request
    /// (`NEXAR_HANDSHAKE_TIMEOUT_MS`).
    pub handshake_timeout: Duration,
    /// Limit for one send or receive (`NEXAR_OP_TIMEOUT_MS`).
    pub op_timeout: Duration,
    /// How long the seed's CA and the certificates it issues stay valid, and so how long its
    /// join token admits workers (`NEXAR_CERT_LIFETIME_HOURS`, default 720: 30 days). Set it
    /// longer than the job runs: links formed after it (an elastic join) fail their handshake.
    pub cert_lifetime: Duration,
    /// A connection with no traffic for this long is closed (`NEXAR_IDLE_TIMEOUT_MS`);
    /// keep-alives are sent at a fifth of it, so idle clusters stay connected.
    pub idle_timeout: Duration,
    /// Largest message payload accepted from a peer, in bytes (`NEXAR_MAX_MESSAGE_BYTES`,
    /// at most 4 GiB, the wire limit).
    pub max_message_bytes: u64,
    /// How many received messages may wait for a matching `recv` (`NEXAR_MAX_UNMATCHED_MESSAGES`).
    pub max_unmatched_messages: usize,
    /// How many bytes those waiting messages may hold (`NEXAR_MAX_UNMATCHED_BYTES`).
    pub max_unmatched_bytes: u64,
    /// Capacity of each receive lane, in messages (`NEXAR_LANE_CAPACITY`).
    pub lane_capacity: usize,
    /// How many RPC requests a rank handles at once (`NEXAR_MAX_RPC_HANDLERS`); further
    /// requests wait on their lane, which holds up their callers.
    pub max_rpc_handlers: usize,
    /// Bytes of RPC requests and answers a rank holds at once, being read, queued or handled
    /// (`NEXAR_MAX_RPC_BYTES`, default 256 MiB); further ones wait unread, and QUIC's flow
    /// control holds their senders. It is also the largest argument list or answer one call
    /// may carry (or `max_message_bytes`, if smaller): a call with larger arguments fails at
    /// once, a larger answer fails the call, and a peer that sends a larger one anyway has
    /// broken the protocol.
    pub max_rpc_bytes: u64,
    /// UDP socket send and receive buffer size in bytes (`NEXAR_SOCKET_BUFFER_BYTES`).
    pub socket_buffer_bytes: usize,
    /// How long a waiting receive or collective step keeps polling before it parks its thread
    /// (`NEXAR_SPIN_US`, microseconds; 0 never spins). `None` (the default) spins up to 1 ms
    /// when this host runs no more ranks than it has cores; where ranks oversubscribe the
    /// cores, up to 10 ms yielding the core between polls ([`spin_yield`](Self::spin_yield)),
    /// or not at all where spins do not yield.
    /// Waking a parked thread costs tens of microseconds, more than a small message takes.
    pub spin: Option<Duration>,
    /// Whether a spinning receive offers its core to other runnable threads between polls
    /// (`NEXAR_SPIN_YIELD`: `on` or `off`), as MPI's `mpi_yield_when_idle` does: the rank it
    /// waits for may be waiting for that very core. `None` (the default) yields where this
    /// host runs more ranks than it has cores, [`shared_memory`](Self::shared_memory) is on,
    /// and the rank runs on a current-thread runtime
    /// (`#[tokio::main(flavor = "current_thread")]`): with runtime threads that must share the
    /// cores too, parking measured faster. `Some(false)` there parks at once unless
    /// [`spin`](Self::spin) says otherwise. A yielding rank keeps yielding while other work (a
    /// niced build, say) shares the cores, which measured faster than parking from 4 to 128
    /// ranks on 2 cores.
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_SPIN_YIELD").then(|| "off".into())).unwrap();
    /// assert_eq!(cfg.spin_yield, Some(false));
    /// assert_eq!(nexar::NexarConfig::default().spin_yield, None);
    /// ```
    pub spin_yield: Option<bool>,
    /// Pins the allreduce algorithm (`NEXAR_ALLREDUCE_ALGORITHM`: `ring`, `pipelined_ring`,
    /// `halving_doubling`, `recursive_doubling`, `hierarchical` — the two-level one, where the
    /// hosts allow it); `None` lets the size table choose.
    pub allreduce_algorithm: Option<Algorithm>,
    /// Pins the broadcast algorithm (`NEXAR_BROADCAST_ALGORITHM`: `binomial_tree`,
    /// `pipelined_chain`, `hierarchical` — through one leader per host, where ranks share hosts).
    pub broadcast_algorithm: Option<Algorithm>,
    /// Pins the barrier algorithm (`NEXAR_BARRIER_ALGORITHM`: `dissemination`, `two_phase`).
    pub barrier_algorithm: Option<Algorithm>,
    /// How often a rank sends a heartbeat on the control lane to the three ranks that watch it
    /// (`NEXAR_HEARTBEAT_INTERVAL_MS`, default 1 s).
    pub heartbeat_interval: Duration,
    /// The longest silence from a watched peer before it is suspected (sooner where its rhythm
    /// says so, never before half of it) and probed; a peer that nobody can reach is declared
    /// dead within it (`NEXAR_HEARTBEAT_TIMEOUT_MS`, default 5 s): its connection is cut, every
    /// pending operation that involves it fails naming it, and
    /// [`failure_watch`](crate::NexarClient::failure_watch) reports it. Must be longer than the
    /// heartbeat interval.
    pub heartbeat_timeout: Duration,
    /// What a rank does when a peer fails (`NEXAR_RECOVERY_POLICY`: `manual`, `automatic`,
    /// `abort`; default `manual`).
    pub recovery_policy: RecoveryPolicy,
    /// Fewest ranks a rebuilt communicator may have (`NEXAR_MIN_WORLD_SIZE`, default 1): a
    /// rebuild that would leave fewer fails instead.
    pub min_world_size: usize,
    /// Most ranks a cluster may hold, counting every rank that ever joined it
    /// (`NEXAR_MAX_WORLD_SIZE`, default 1024): the seed refuses joins beyond it, and each
    /// rank keeps room for that many peers.
    pub max_world_size: usize,
    /// Which ranks connect directly (`NEXAR_TOPOLOGY`: `full_mesh`, the default;
    /// `k_regular:K`; `hypercube`). Messages between ranks without a direct connection are
    /// relayed along shortest paths, around dead ranks. Every rank must use the same.
    pub topology: Topology,
    /// What carries large collective messages between two ranks (`NEXAR_BULK_TRANSPORT`:
    /// `tcp`, the default, or `quic`). With [`BulkTransport::Tcp`] each direct link opens a
    /// TLS 1.3 connection over TCP each way when the cluster forms (same certificates as
    /// QUIC) and sends collective messages of at least [`bulk_min_bytes`](Self::bulk_min_bytes)
    /// there, and typed point-to-point messages of every size (unless the lane has threads of
    /// its own, [`lane_threads`](Self::lane_threads)), encrypted with keys exported from that
    /// session; a link where that fails stays on QUIC. Every rank should use the same (a rank that differs makes its peers wait
    /// [`connect_timeout`](Self::connect_timeout) at start, then those links use QUIC); a
    /// rank with [`chaos`](Self::chaos) faults, or joining a running cluster, keeps QUIC.
    pub bulk_transport: BulkTransport,
    /// Smallest collective message that takes the TCP lane (`NEXAR_BULK_MIN_BYTES`): smaller
    /// ones stay on QUIC. `None` (the default) is every size on a lane whose I/O runs on the
    /// rank's runtime (quicker than QUIC's packet path even for a barrier; the default) and
    /// 256 KiB on one with threads of its own for all of it
    /// (see [`lane_threads`](Self::lane_threads)), where each message costs a thread wake-up.
    /// Shared memory between ranks of one host ([`shared_memory`](Self::shared_memory)) takes
    /// every size.
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_BULK_MIN_BYTES").then(|| "64K".into())).unwrap();
    /// assert_eq!(cfg.bulk_min_bytes, Some(64 << 10));
    /// ```
    pub bulk_min_bytes: Option<usize>,
    /// Whether the TCP lane encrypts collective payloads (`NEXAR_BULK_ENCRYPTION`: `on`, the
    /// default, or `off`). **Off is insecure**: for an isolated, trusted fabric only, where
    /// nexar is compared with MPI, which encrypts nothing. Collective and point-to-point
    /// payloads on the TCP lane then travel as plaintext, readable and alterable by anyone on
    /// the path; the lane's TLS handshake, rank-bound certificates and link tokens, and
    /// everything on QUIC (control, RPC, small collectives), stay authenticated and encrypted. Every rank
    /// of a cluster must use the same: the seed refuses a worker that differs from the first
    /// one to join. Each rank logs a warning when it is off.
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_BULK_ENCRYPTION").then(|| "off".into())).unwrap();
    /// assert!(!cfg.bulk_encryption);
    /// assert!(nexar::NexarConfig::default().bulk_encryption);
    /// ```
    pub bulk_encryption: bool,
    /// Whether each TCP lane has threads of its own for its I/O (`NEXAR_LANE_THREADS`: `on`,
    /// `off`, or unset for `None`, the default). `Some(true)`: a writer thread writes one
    /// buffer while the sender seals the next, and a reader thread reads the peer's groups.
    /// `Some(false)`: the rank's runtime does both: a sender writes its records to the socket
    /// itself while nothing is queued (the writer thread takes only what the socket does not),
    /// and a task reads the groups, so no thread is woken per message and a waiting receive
    /// spins. `None` (the default) picks the runtime for small groups everywhere. Where the
    /// host has more cores than ranks, groups of 512 KiB and more go through threads: the
    /// writer thread writes them and a thread of the lane reads their bytes, on cores the
    /// ranks leave free (on a 16-core host, np 2: barrier 18 → 10–15 µs, 64 KiB allreduce 90 →
    /// 43 µs against `on`, 16 MiB 13 % slower). Where every core runs a rank, a woken thread
    /// would wait for one, so the runtime does all of it.
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_LANE_THREADS").then(|| "off".into())).unwrap();
    /// assert_eq!(cfg.lane_threads, Some(false));
    /// assert_eq!(nexar::NexarConfig::default().lane_threads, None);
    /// ```
    pub lane_threads: Option<bool>,
    /// Which TCP congestion control the TCP lane's connections run (`NEXAR_LANE_CONGESTION`:
    /// a kernel name such as `cubic`, the default, or `system`); see [`LaneCongestion`].
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_LANE_CONGESTION").then(|| "reno".into())).unwrap();
    /// assert_eq!(cfg.lane_congestion.name(), Some("reno"));
    /// ```
    pub lane_congestion: LaneCongestion,
    /// Which cipher seals the TCP lane's records (`NEXAR_LANE_CIPHER`: `aegis-128x2`, the
    /// default, or `aes-128-gcm`); every rank must use the same. See [`LaneCipher`].
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_LANE_CIPHER").then(|| "aes-128-gcm".into())).unwrap();
    /// assert_eq!(cfg.lane_cipher, nexar::LaneCipher::Aes128Gcm);
    /// ```
    pub lane_cipher: LaneCipher,
    /// Which implementation of AES-128-GCM seals the TCP lane's records where
    /// [`lane_cipher`](Self::lane_cipher) is AES-128-GCM (`NEXAR_LANE_AES`:
    /// `auto`, the default, `aws-lc` or `ring`); see [`LaneAes`].
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_LANE_AES").then(|| "aws-lc".into())).unwrap();
    /// assert_eq!(cfg.lane_aes, nexar::LaneAes::AwsLc);
    /// ```
    pub lane_aes: LaneAes,
    /// Whether ranks on the same host carry collective payloads through shared memory
    /// (`NEXAR_SHM`: `on`, the default, or `off`). Two ranks that find they share a host (the
    /// same machine, boot, network namespace and user; `NEXAR_HOST_ID` overrides the host's
    /// identity) map a pair of rings in a memfd segment that only the two processes hold, after
    /// proving the link over QUIC and checking each other's process credentials; their
    /// collective payloads then skip the network stack and encryption (no other user can read
    /// the segment). A link where either rank has it off, or where setting it up fails, uses
    /// the TCP lane or QUIC as before. A rank with [`chaos`](Self::chaos) faults keeps QUIC,
    /// so that the faults reach its payloads.
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_SHM").then(|| "off".into())).unwrap();
    /// assert!(!cfg.shared_memory);
    /// assert!(nexar::NexarConfig::default().shared_memory);
    /// ```
    pub shared_memory: bool,
    /// Whether [`NexarClient::init`](crate::NexarClient::init) binds the thread that calls it
    /// to cores of its own, as `mpirun` binds ranks (`NEXAR_BIND`: `core`, or `none`, the
    /// default; `nexar launch` sets `core` unless told `--bind-to none`): the rank's share of
    /// the CPUs the process may use (CPUs ÷ ranks on the host, a contiguous block chosen by
    /// the rank's local index; one core when there are as many ranks as CPUs, see
    /// [`crate::affinity::cores_for`]). Nothing is bound where the host runs more ranks than the
    /// process has CPUs, or the launcher gives no local rank. On a host busy with other work a
    /// bound rank keeps its latency (the guide's performance chapter, "On a busy machine").
    /// Threads the bound thread starts afterwards inherit its share, as under `mpirun`, so a
    /// framework's pool sized by [`crate::affinity::compute_threads`] uses all of it.
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_BIND").then(|| "core".into())).unwrap();
    /// assert!(cfg.bind_core);
    /// assert!(!nexar::NexarConfig::default().bind_core);
    /// ```
    pub bind_core: bool,
    /// Whether `Buf<T, Cuda>` allreduces and broadcasts among the ranks of one host run on
    /// NCCL (`NEXAR_NCCL`: `on`, the default, or `off`; only builds with the feature `nccl`
    /// have NCCL at all). Where any rank has it off, or cannot load libnccl, or NCCL refuses
    /// the communicator (two ranks on one GPU), every rank stages the call through host
    /// memory instead, logged once; see [`NexarClient::nccl_state`](crate::NexarClient).
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_NCCL").then(|| "off".into())).unwrap();
    /// assert!(!cfg.nccl);
    /// assert!(nexar::NexarConfig::default().nccl);
    /// ```
    pub nccl: bool,
    /// Which host this rank says it is on (`NEXAR_HOST_ID`); `None` (the default) derives it
    /// from the machine id, boot id, network namespace and user. Ranks with different hosts
    /// never share memory, and collectives across several hosts with several ranks each use
    /// the two-level algorithms (see [`NexarClient::host_layout`](crate::NexarClient::host_layout)),
    /// so tests can place ranks of one machine on fake hosts.
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_HOST_ID").then(|| "node-7".into())).unwrap();
    /// assert_eq!(cfg.host_id.as_deref(), Some("node-7"));
    /// ```
    pub host_id: Option<String>,
    /// Largest piece of its buffer an allreduce works on at a time (`NEXAR_SEGMENT_BYTES`,
    /// default 8 MiB; 0 never splits). A larger buffer runs as consecutive segments under
    /// one sequence number, which keeps each segment's working set in cache and lets a device
    /// buffer copy the next and the previous segment while one is on the network. Every rank
    /// must use the same (a rank that differs fails its allreduces with a length mismatch).
    pub segment_bytes: usize,
    /// Faults to inject into this rank's datagrams, for testing how an application copes with
    /// a bad network (`NEXAR_CHAOS_LOSS`, `NEXAR_CHAOS_REORDER`, `NEXAR_CHAOS_DELAY_MS`);
    /// `None` (the default) injects none. Such a rank carries every payload over QUIC (no
    /// shared memory, no TCP lane), so that the faults reach them.
    pub chaos: Option<NetChaos>,
    /// The flight recorder and the stall inspector (`NEXAR_TRACE_ENTRIES`, `NEXAR_TRACE_DIR`,
    /// `NEXAR_STALL_WARN_MS`, `NEXAR_TRACE_SIGNAL`; see [`crate::trace`]).
    pub trace: TraceConfig,
    /// Where this process serves its metrics in Prometheus text format (`NEXAR_METRICS_ADDR`,
    /// for example `0.0.0.0:9400`; default none). Needs the crate feature `prometheus`. Under a
    /// launcher that numbers the ranks of a host, [`NexarClient::init`](crate::NexarClient::init)
    /// adds the local rank to the port, so several ranks on one host do not collide. See
    /// [`crate::telemetry`].
    pub metrics_addr: Option<SocketAddr>,
}

/// Like a derived `Debug`, except that the join token is never shown.
///
/// ```
/// let mut cfg = nexar::NexarConfig::default();
/// cfg.token = Some("nexar1.secret.fingerprint".into());
/// assert!(!format!("{cfg:?}").contains("secret"));
/// ```
impl std::fmt::Debug for NexarConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NexarConfig")
            .field("world_size", &self.world_size)
            .field("seed_addr", &self.seed_addr)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("listen_addr", &self.listen_addr)
            .field("connect_timeout", &self.connect_timeout)
            .field("join_timeout", &self.join_timeout)
            .field("mesh_timeout", &self.mesh_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("op_timeout", &self.op_timeout)
            .field("cert_lifetime", &self.cert_lifetime)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("max_unmatched_messages", &self.max_unmatched_messages)
            .field("max_unmatched_bytes", &self.max_unmatched_bytes)
            .field("lane_capacity", &self.lane_capacity)
            .field("max_rpc_handlers", &self.max_rpc_handlers)
            .field("max_rpc_bytes", &self.max_rpc_bytes)
            .field("socket_buffer_bytes", &self.socket_buffer_bytes)
            .field("spin", &self.spin)
            .field("spin_yield", &self.spin_yield)
            .field("allreduce_algorithm", &self.allreduce_algorithm)
            .field("broadcast_algorithm", &self.broadcast_algorithm)
            .field("barrier_algorithm", &self.barrier_algorithm)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("heartbeat_timeout", &self.heartbeat_timeout)
            .field("recovery_policy", &self.recovery_policy)
            .field("min_world_size", &self.min_world_size)
            .field("max_world_size", &self.max_world_size)
            .field("topology", &self.topology)
            .field("bulk_transport", &self.bulk_transport)
            .field("bulk_min_bytes", &self.bulk_min_bytes)
            .field("bulk_encryption", &self.bulk_encryption)
            .field("lane_threads", &self.lane_threads)
            .field("lane_congestion", &self.lane_congestion)
            .field("lane_cipher", &self.lane_cipher)
            .field("lane_aes", &self.lane_aes)
            .field("shared_memory", &self.shared_memory)
            .field("bind_core", &self.bind_core)
            .field("nccl", &self.nccl)
            .field("host_id", &self.host_id)
            .field("segment_bytes", &self.segment_bytes)
            .field("chaos", &self.chaos)
            .field("trace", &self.trace)
            .field("metrics_addr", &self.metrics_addr)
            .finish()
    }
}

/// What carries collective payloads between ranks; see [`NexarConfig::bulk_transport`].
///
/// ```
/// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_BULK_TRANSPORT").then(|| "quic".into())).unwrap();
/// assert_eq!(cfg.bulk_transport, nexar::BulkTransport::Quic);
/// assert_eq!(nexar::NexarConfig::default().bulk_transport, nexar::BulkTransport::Tcp);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BulkTransport {
    /// Everything over the QUIC connection.
    Quic,
    /// Large collective messages over TLS-keyed records on TCP, one connection each way per
    /// link; everything else over QUIC.
    #[default]
    Tcp,
}

impl FromStr for BulkTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "quic" => Ok(BulkTransport::Quic),
            "tcp" => Ok(BulkTransport::Tcp),
            _ => Err("expected quic or tcp".into()),
        }
    }
}

/// What a rank does when it sees a peer fail.
///
/// In every policy the operations that involve the failed peer return errors naming it, and
/// [`failure_watch`](crate::NexarClient::failure_watch) reports the failure.
///
/// ```
/// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_RECOVERY_POLICY").then(|| "abort".into())).unwrap();
/// assert_eq!(cfg.recovery_policy, nexar::RecoveryPolicy::Abort);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RecoveryPolicy {
    /// The application decides: it calls [`recover`](crate::NexarClient::recover) (or
    /// [`rebuild_excluding`](crate::NexarClient::rebuild_excluding)) on the survivors.
    #[default]
    Manual,
    /// The runtime agrees on the failure set and rebuilds the world communicator by itself;
    /// the application takes the rebuilt communicator from
    /// [`FailureWatch::rebuilt`](crate::FailureWatch::rebuilt).
    Automatic,
    /// Like `MPI_ERRORS_ARE_FATAL`: the first failure aborts this rank too, so every rank
    /// stops promptly.
    Abort,
}

impl FromStr for RecoveryPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "manual" => Ok(RecoveryPolicy::Manual),
            "automatic" | "auto" => Ok(RecoveryPolicy::Automatic),
            "abort" => Ok(RecoveryPolicy::Abort),
            _ => Err("expected manual, automatic or abort".into()),
        }
    }
}

impl Default for NexarConfig {
    fn default() -> Self {
        NexarConfig {
            world_size: None,
            seed_addr: None,
            token: None,
            listen_addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            connect_timeout: Duration::from_secs(10),
            join_timeout: Duration::from_secs(300),
            mesh_timeout: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(120),
            cert_lifetime: DEFAULT_CERT_LIFETIME,
            idle_timeout: Duration::from_secs(30),
            max_message_bytes: crate::proto::frame::MAX_FRAME_LEN,
            max_unmatched_messages: 1024,
            max_unmatched_bytes: 1 << 30,
            lane_capacity: 256,
            max_rpc_handlers: 256,
            max_rpc_bytes: 256 << 20,
            socket_buffer_bytes: 8 << 20,
            spin: None,
            spin_yield: None,
            allreduce_algorithm: None,
            broadcast_algorithm: None,
            barrier_algorithm: None,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            recovery_policy: RecoveryPolicy::Manual,
            min_world_size: 1,
            max_world_size: 1024,
            chaos: None,
            topology: Topology::FullMesh,
            bulk_transport: BulkTransport::Tcp,
            bulk_min_bytes: None,
            bulk_encryption: true,
            lane_threads: None,
            lane_congestion: LaneCongestion::default(),
            lane_cipher: LaneCipher::Aegis128X2,
            lane_aes: LaneAes::Auto,
            shared_memory: true,
            bind_core: false,
            nccl: true,
            host_id: None,
            segment_bytes: 8 << 20,
            trace: TraceConfig::default(),
            metrics_addr: None,
        }
    }
}

#[cfg(test)]
mod reference_tests;
#[cfg(test)]
mod tests;
