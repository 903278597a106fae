//! The seed node: authenticates joining workers, signs their certificates, assigns ranks, and
//! publishes the peer table once every worker has joined. It is not on the data path.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use quinn::{Connection, RecvStream, SendStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::secret::{Role, SharedSecret, exported};
use super::{ClusterError, JoinToken};
use crate::config::NexarConfig;
use crate::proto::close::CloseCode;
use crate::proto::frame::MAX_JOIN_FRAME;
use crate::proto::message::{JoinAuth, LaneSealing, PROTOCOL_VERSION, RankClaim, SeedRequest, SeedResponse};
use crate::transport::framed::{read_message, write_message};
use crate::transport::relay_seal::RelayPublicKey;
use crate::transport::tls::{ClusterCa, SEED_SERVER_NAME, key_pin_of_request, seed_server};
use crate::transport::{TransportError, endpoint};

mod member;
mod slots;

use member::serve_member;

use slots::{MemberKeys, Slots, claim_slot, release_slot};

/// The reason a seed gives a worker whose proof of the shared secret is wrong.
pub(crate) const WRONG_SECRET: &str = "the worker's proof of the shared secret is wrong";

/// A running seed node.
///
/// ```no_run
/// # async fn run() -> Result<(), nexar::NexarError> {
/// let mut cfg = nexar::NexarConfig::default();
/// cfg.world_size = Some(4);
/// let seed = nexar::SeedNode::bind("0.0.0.0:7000".parse().unwrap(), cfg).await?;
/// println!("join with: {}", seed.token());
/// seed.wait_formed().await?;
/// # Ok(()) }
/// ```
pub struct SeedNode {
    endpoint: quinn::Endpoint,
    local: SocketAddr,
    token: JoinToken,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

struct Shared {
    ca: ClusterCa,
    token: JoinToken,
    /// The job's shared secret, when the seed was started with one: workers may prove it
    /// instead of presenting the token.
    secret: Option<SharedSecret>,
    cluster_id: u64,
    world: usize,
    /// Where the world size came from, as the seed read it (`NEXAR_WORLD_SIZE=4`), for the
    /// error a worker that read another gets ([`SeedNode::describe_world_size`]).
    world_from: Mutex<Option<String>>,
    cfg: NexarConfig,
    slots: Mutex<Slots>,
    table: watch::Sender<Option<Vec<SocketAddr>>>,
    members: watch::Sender<usize>,
    /// How the first worker that joined seals its lanes: every later one must match.
    lane_sealing: Mutex<Option<LaneSealing>>,
    /// How many workers have joined, and the last refusals, for the workers still waiting.
    progress: watch::Sender<Progress>,
    /// The launcher generation of the first worker that named one: every later one must match.
    generation: Mutex<Option<String>>,
    /// Why the seed is closing, once [`SeedNode::close`] was called: each waiting worker gets a
    /// last progress note and this reason before its connection closes.
    closing: watch::Sender<Option<String>>,
}

/// What waiting workers are told while the cluster forms.
#[derive(Default)]
struct Progress {
    joined: usize,
    /// The last [`MAX_REFUSALS_SHOWN`] refusals: "address: reason".
    refused: Vec<String>,
}

/// How many refusals waiting workers are told of.
const MAX_REFUSALS_SHOWN: usize = 4;

/// The least time between two progress notes to one waiting worker: notes coalesce, so a large
/// cluster forming does not cost each waiting worker one note per join.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// How long [`SeedNode::close`] waits for the workers to have its last words, and then for
/// the connections to close.
const CLOSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

impl SeedNode {
    /// Binds the seed to `addr` and starts accepting workers. `config.world_size` says how many
    /// workers make the cluster.
    ///
    /// A fresh CA and join token are generated; [`token`](Self::token) returns the token to
    /// hand to workers.
    pub async fn bind(addr: SocketAddr, config: NexarConfig) -> Result<SeedNode, ClusterError> {
        Self::start(addr, config, None).await
    }

    /// Like [`bind`](Self::bind), and also admits workers that prove they know the job's shared
    /// secret (what [`NexarClient::init`](crate::NexarClient::init) does under a launcher). The
    /// seed proves it first, on the same TLS session, so a worker never trusts a seed that
    /// does not know the secret.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// use nexar::cluster::SharedSecret;
    /// let mut cfg = nexar::NexarConfig::default();
    /// cfg.world_size = Some(4);
    /// let secret = SharedSecret::new(std::env::var("NEXAR_SECRET").unwrap_or_default())?;
    /// let seed = nexar::SeedNode::bind_with_secret("0.0.0.0:7000".parse().unwrap(), cfg, secret).await?;
    /// seed.wait_formed().await?;
    /// # Ok(()) }
    /// ```
    pub async fn bind_with_secret(
        addr: SocketAddr,
        config: NexarConfig,
        secret: SharedSecret,
    ) -> Result<SeedNode, ClusterError> {
        Self::start(addr, config, Some(secret)).await
    }

    async fn start(
        addr: SocketAddr,
        config: NexarConfig,
        secret: Option<SharedSecret>,
    ) -> Result<SeedNode, ClusterError> {
        config.validate().map_err(|e| ClusterError::Transport(TransportError::Tls(e.to_string())))?;
        let world = config.world_size.ok_or(ClusterError::InvalidWorldSize(0))?;
        if world == 0 {
            return Err(ClusterError::InvalidWorldSize(0));
        }
        let ca = ClusterCa::generate_valid_for(config.cert_lifetime)?;
        let identity = ca.issue(SEED_SERVER_NAME)?;
        let mut server = seed_server(&identity)?;
        server
            .transport_config(endpoint::seed_transport_config(&config))
            .migration(false)
            .incoming_buffer_size(SEED_WINDOW_BYTES)
            .incoming_buffer_size_total(SEED_WINDOW_BYTES * unauthenticated_cap(world) as u64);
        let endpoint = endpoint::bind(addr, &config, Some(server))?;
        let token = JoinToken::generate(ca.fingerprint());
        let shared = Arc::new(Shared {
            ca,
            token: token.clone(),
            secret,
            cluster_id: rand::random(),
            world,
            world_from: Mutex::new(None),
            cfg: config,
            slots: Mutex::new(Slots {
                addrs: vec![None; world],
                claimed_by: vec![None; world],
                keys: vec![None; world],
                formed: false,
            }),
            table: watch::channel(None).0,
            members: watch::channel(0).0,
            lane_sealing: Mutex::new(None),
            generation: Mutex::new(None),
            progress: watch::channel(Progress::default()).0,
            closing: watch::channel(None).0,
        });
        let local = endpoint.local_addr().map_err(|e| TransportError::Bind { addr, reason: e.to_string() })?;
        tracing::info!(%local, world, "seed listening");
        let accept =
            tokio::spawn(accept_loop(endpoint.clone(), shared.clone()).instrument(tracing::info_span!("seed", %local)));
        Ok(SeedNode { endpoint, local, token, shared, accept })
    }

    /// Says where the seed's world size came from (`"NEXAR_WORLD_SIZE=4"`, `"--world-size
    /// 4"`), so that a worker started with another world size is told both sides.
    ///
    /// ```no_run
    /// # async fn run(seed: nexar::SeedNode) {
    /// seed.describe_world_size(format!("NEXAR_WORLD_SIZE={}", seed.world_size()));
    /// # }
    /// ```
    pub fn describe_world_size(&self, source: impl Into<String>) {
        *crate::sync::lock(&self.shared.world_from) = Some(source.into());
    }

    /// The join token workers need.
    pub fn token(&self) -> &JoinToken {
        &self.token
    }

    /// The address the seed listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The number of workers the cluster waits for.
    pub fn world_size(&self) -> usize {
        self.shared.world
    }

    /// How many workers hold a rank while the cluster forms (one that leaves before then frees
    /// its rank): what waiting workers are told. Once the cluster has formed it stays at the
    /// world size.
    ///
    /// ```no_run
    /// # fn run(seed: nexar::SeedNode) {
    /// println!("{} of {} workers have joined", seed.joined(), seed.world_size());
    /// # }
    /// ```
    pub fn joined(&self) -> usize {
        self.shared.progress.borrow().joined
    }

    /// Waits until every worker has joined, then returns the peer table (listening address
    /// per rank). Waits as long as it takes; wrap it in a timeout if needed.
    pub async fn wait_formed(&self) -> Result<Vec<SocketAddr>, ClusterError> {
        let mut rx = self.shared.table.subscribe();
        let table = rx
            .wait_for(|t| t.is_some())
            .await
            .map_err(|_| ClusterError::Mesh { rank: 0, reason: "the seed stopped before the cluster formed".into() })?;
        Ok(table.clone().unwrap_or_default())
    }

    /// Waits until the cluster has formed and every worker has then disconnected from the seed.
    pub async fn wait_done(&self) -> Result<(), ClusterError> {
        self.wait_formed().await?;
        let mut rx = self.shared.members.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
        Ok(())
    }

    /// Closes the seed so that every worker learns why: each waiting worker gets a last note of
    /// who has joined and who was refused, then `reason`, before its connection closes. Waits
    /// at most a few seconds for the workers to have it. Dropping the seed instead closes the
    /// connections at once, and a note still on its way may be lost.
    ///
    /// ```no_run
    /// # async fn run(seed: nexar::SeedNode) {
    /// if tokio::time::timeout(std::time::Duration::from_secs(60), seed.wait_formed()).await.is_err() {
    ///     seed.close("the job gave up after 60 s waiting for its workers").await;
    /// }
    /// # }
    /// ```
    pub async fn close(&self, reason: &str) {
        self.accept.abort();
        tracing::info!(%reason, "the seed is closing");
        self.shared.closing.send_replace(Some(reason.to_string()));
        let mut members = self.shared.members.subscribe();
        let _ = tokio::time::timeout(CLOSE_WITHIN, members.wait_for(|n| *n == 0)).await;
        self.endpoint.close(CloseCode::Shutdown.value().into(), reason.as_bytes());
        let _ = tokio::time::timeout(CLOSE_WITHIN, self.endpoint.wait_idle()).await;
    }

    /// Stops accepting and closes every connection at once; [`close`](Self::close) tells the
    /// waiting workers why first.
    pub fn shutdown(&self) {
        self.accept.abort();
        self.endpoint.close(CloseCode::Shutdown.value().into(), b"seed shutting down");
    }
}

impl Drop for SeedNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A lifetime in the largest whole unit that fits it.
fn humanize(d: std::time::Duration) -> String {
    match d.as_secs() {
        s if s >= 86_400 && s % 86_400 == 0 => format!("{} days", s / 86_400),
        s if s >= 3600 && s % 3600 == 0 => format!("{} hours", s / 3600),
        _ => format!("{d:?}"),
    }
}

/// Early data a connection that has not completed its handshake may buffer at the seed.
const SEED_WINDOW_BYTES: u64 = 16 << 10;

/// Connections the seed serves at once before they have authenticated (the token or the
/// shared secret): enough for every worker of the cluster to join at the same moment, and
/// never so many that strangers can make the seed hold more than a few MiB. A connection over
/// the cap is refused at once; a worker retries.
fn unauthenticated_cap(world: usize) -> usize {
    world.saturating_mul(2).clamp(64, 8192)
}

async fn accept_loop(endpoint: quinn::Endpoint, shared: Arc<Shared>) {
    let unauthenticated = Arc::new(tokio::sync::Semaphore::new(unauthenticated_cap(shared.world)));
    while let Some(incoming) = endpoint.accept().await {
        let remote = incoming.remote_address();
        // A spoofed source address gets one small Retry packet and nothing more: only a peer
        // that receives at its address comes back with the token.
        if !incoming.remote_address_validated() && incoming.may_retry() {
            if let Err(e) = incoming.retry() {
                tracing::debug!(%remote, error = %e, "could not ask a connection to the seed to validate its address");
            }
            continue;
        }
        let Ok(pass) = unauthenticated.clone().try_acquire_owned() else {
            tracing::warn!(%remote, cap = unauthenticated_cap(shared.world), "refused a connection to the seed: too many are joining at once");
            incoming.refuse();
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(
            async move {
                match serve_connection(incoming, &shared, pass).await {
                    Ok(()) => {}
                    // A joiner retrying gives up on a slow handshake; a scanner never completes one.
                    Err(reason) if reason.starts_with("handshake failed") => {
                        tracing::debug!(%remote, %reason, "a connection to the seed did not complete its handshake");
                    }
                    Err(reason) => tracing::warn!(%remote, %reason, "dropped a connection to the seed"),
                }
            }
            .instrument(tracing::info_span!("join", %remote)),
        );
    }
}

/// Everything a connection gets to do before it has proved knowledge of the token: complete
/// the TLS handshake, open one stream, and send one small frame, all within the handshake
/// timeout.
async fn pre_auth(incoming: quinn::Incoming) -> Result<(Connection, SendStream, RecvStream, SeedRequest), String> {
    let conn = incoming.await.map_err(|e| format!("handshake failed: {e}"))?;
    let (send, mut recv) = conn.accept_bi().await.map_err(|e| format!("no join stream: {e}"))?;
    let req = read_message::<SeedRequest>(&mut recv, MAX_JOIN_FRAME)
        .await
        .map_err(|e| {
            conn.close(CloseCode::Rejected.value().into(), b"invalid join request");
            format!("invalid join request: {e}")
        })?
        .ok_or_else(|| "the join stream ended without a request".to_string())?;
    Ok((conn, send, recv, req))
}

/// Serves one connection; `pass` (one of the seed's places for connections that have not
/// authenticated) is given back once it has, or when it ends.
async fn serve_connection(
    incoming: quinn::Incoming,
    shared: &Shared,
    pass: tokio::sync::OwnedSemaphorePermit,
) -> Result<(), String> {
    let remote = incoming.remote_address();
    let limit = shared.cfg.handshake_timeout;
    let (conn, mut send, mut recv, req) = match tokio::time::timeout(limit, pre_auth(incoming)).await {
        Ok(r) => r?,
        Err(_) => return Err(format!("sent no valid join request within {limit:?}")),
    };
    let SeedRequest::Join { protocol, auth, claim, csr_der, listen_addr, lane_sealing, relay_key } = req else {
        return Err(reject(shared, &conn, &mut send, "expected a join request first".into()).await);
    };
    if let Err(reason) = authenticate(shared, &conn, &mut send, &mut recv, auth).await {
        return Err(reject(shared, &conn, &mut send, reason).await);
    }
    drop(pass);
    if std::time::SystemTime::now() >= shared.ca.expires_at() {
        let reason = format!(
            "this seed's certificates expired {} after it started (NEXAR_CERT_LIFETIME_HOURS): it admits nobody \
             more; start a new job",
            humanize(shared.cfg.cert_lifetime)
        );
        return Err(reject(shared, &conn, &mut send, reason).await);
    }
    if protocol != PROTOCOL_VERSION {
        return Err(reject(
            shared,
            &conn,
            &mut send,
            format!("protocol version {protocol} is not supported (seed speaks {PROTOCOL_VERSION})"),
        )
        .await);
    }
    if let Err(reason) = agree_on_sealing(shared, lane_sealing).and_then(|()| agree_on_generation(shared, &claim)) {
        return Err(reject(shared, &conn, &mut send, reason).await);
    }
    let mut listen: SocketAddr = match listen_addr.parse() {
        Ok(a) => a,
        Err(_) => {
            return Err(
                reject(shared, &conn, &mut send, format!("listen address {listen_addr:?} does not parse")).await
            );
        }
    };
    if listen.ip().is_unspecified() {
        listen.set_ip(remote.ip());
    }
    let pin = match key_pin_of_request(&csr_der) {
        Ok(pin) => pin,
        Err(e) => return Err(reject(shared, &conn, &mut send, e.to_string()).await),
    };
    let Ok(relay) = RelayPublicKey::try_from(&relay_key[..]) else {
        let reason = format!("a relay key of {} bytes (an X25519 key has 32)", relay_key.len());
        return Err(reject(shared, &conn, &mut send, reason).await);
    };
    let key = MemberKeys { pin, relay };
    let (rank, world, running) = match claim_slot(shared, listen, key, &claim) {
        Ok(r) => r,
        Err(reason) => return Err(reject(shared, &conn, &mut send, reason).await),
    };
    let cert = match shared.ca.sign_csr(&csr_der, rank as u32) {
        Ok(c) => c,
        Err(e) => {
            release_slot(shared, rank);
            return Err(reject(shared, &conn, &mut send, e.to_string()).await);
        }
    };
    let welcome = SeedResponse::Welcome {
        cluster_id: shared.cluster_id,
        rank: rank as u32,
        world_size: world as u32,
        cert_der: cert.to_vec(),
        ca_der: shared.ca.cert_der().to_vec(),
        running,
    };
    if let Err(e) = write_message(&mut send, &welcome).await {
        release_slot(shared, rank);
        return Err(format!("lost before the welcome: {e}"));
    }
    tracing::info!(rank, %listen, %remote, "worker joined");
    shared.members.send_modify(|n| *n += 1);
    let result = serve_member(shared, &conn, &mut send, rank).await;
    shared.members.send_modify(|n| *n -= 1);
    result
}

/// Checks the worker's proof that it may join: the token's secret, or, on a seed that holds
/// the job's shared secret, the exchange of proofs (the seed's first). Returns the reason to
/// refuse it.
async fn authenticate(
    shared: &Shared,
    conn: &Connection,
    send: &mut SendStream,
    recv: &mut RecvStream,
    auth: JoinAuth,
) -> Result<(), String> {
    let secret = match auth {
        JoinAuth::Token { secret } if shared.token.secret_matches(&secret) => return Ok(()),
        JoinAuth::Token { .. } => return Err("invalid join token".into()),
        JoinAuth::SharedSecret => shared.secret.as_ref().ok_or_else(|| {
            "this seed was started with a join token, not a shared secret: join with the token it printed \
             (NEXAR_SEED_ADDR and NEXAR_TOKEN)"
                .to_string()
        })?,
    };
    let exported = exported(conn)?;
    write_message(send, &SeedResponse::SecretProof { proof: secret.proof(Role::Seed, &exported) })
        .await
        .map_err(|e| format!("lost before the seed's proof: {e}"))?;
    let answer = tokio::time::timeout(shared.cfg.handshake_timeout, read_message::<SeedRequest>(recv, MAX_JOIN_FRAME))
        .await
        .map_err(|_| format!("sent no proof of the secret within {:?}", shared.cfg.handshake_timeout))?;
    match answer {
        Ok(Some(SeedRequest::SecretProof { proof })) if secret.verify(Role::Joiner, &exported, &proof) => Ok(()),
        Ok(Some(SeedRequest::SecretProof { .. })) => Err(WRONG_SECRET.into()),
        Ok(_) => Err("expected the worker's proof of the secret".into()),
        Err(_) => match conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(close))
                if close.error_code == CloseCode::SeedUnproven.value().into() =>
            {
                Err("the worker holds a different secret (NEXAR_SECRET): it refused this seed's proof".into())
            }
            other => Err(format!("the worker left during the secret exchange ({other:?})")),
        },
    }
}

/// A torch elastic restart starts a new generation: a worker left over from an earlier one is
/// refused, naming both.
fn agree_on_generation(shared: &Shared, claim: &RankClaim) -> Result<(), String> {
    let Some(theirs) = &claim.generation else { return Ok(()) };
    let mut agreed = crate::sync::lock(&shared.generation);
    match agreed.as_ref() {
        None => {
            *agreed = Some(theirs.clone());
            Ok(())
        }
        Some(ours) if ours == theirs => Ok(()),
        Some(ours) => Err(format!(
            "this worker belongs to launcher generation {theirs}, the cluster to {ours} \
             (TORCHELASTIC_RUN_ID/TORCHELASTIC_RESTART_COUNT): a worker from another restart of the job"
        )),
    }
}

/// The first worker's lane sealing (`NEXAR_BULK_ENCRYPTION`, `NEXAR_LANE_CIPHER`) becomes the
/// cluster's; a worker that differs is refused, since its lanes could not read its peers'
/// records (nor they its).
fn agree_on_sealing(shared: &Shared, theirs: LaneSealing) -> Result<(), String> {
    let mut agreed = crate::sync::lock(&shared.lane_sealing);
    match *agreed {
        None => {
            *agreed = Some(theirs);
            Ok(())
        }
        Some(cluster) if cluster == theirs => Ok(()),
        Some(cluster) => Err(format!(
            "this worker runs with {}, the cluster's first worker with {}: every rank must use the same",
            theirs.settings(),
            cluster.settings()
        )),
    }
}

/// Tells the worker why it was refused, gives the answer a moment to arrive, and closes.
async fn reject(shared: &Shared, conn: &Connection, send: &mut SendStream, reason: String) -> String {
    let remote = conn.remote_address();
    tracing::info!(%remote, %reason, "refused a worker");
    shared.progress.send_modify(|p| {
        if p.refused.len() == MAX_REFUSALS_SHOWN {
            p.refused.remove(0);
        }
        p.refused.push(format!("{remote}: {reason}"));
    });
    let _ = write_message(send, &SeedResponse::Reject { reason: reason.clone() }).await;
    let _ = send.finish();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), send.stopped()).await;
    conn.close(CloseCode::Rejected.value().into(), reason.as_bytes());
    format!("refused: {reason}")
}
