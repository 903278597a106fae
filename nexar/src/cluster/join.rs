//! A worker joining through the seed: verify the seed by the token's CA fingerprint and prove
//! the token's secret (or exchange proofs of the job's shared secret), get a rank and a
//! certificate for a key generated here, then wait for the peer table.

use std::net::SocketAddr;

use quinn::{Connection, Endpoint};
use rustls::pki_types::CertificateDer;

use super::secret::{Role, SharedSecret, exported};
use super::{ClusterError, JoinToken, MismatchSide};
use crate::config::NexarConfig;
use crate::proto::close::CloseCode;
use crate::proto::message::{JoinAuth, PROTOCOL_VERSION, RankClaim, SeedRequest, SeedResponse};
use crate::transport::TransportError;
use crate::transport::endpoint::{server_with_transport, with_transport};
use crate::transport::framed::{read_message, write_message};
use crate::transport::relay_seal::{RelayPublicKey, RelaySeals, RelaySecret};
use crate::transport::tls::{
    Identity, KeyPin, PendingIdentity, SEED_SERVER_NAME, fingerprint, key_pin, mesh_server, rank_from_cert, seed_client,
};

/// Largest seed response a worker reads (the peer table of a large cluster fits).
const MAX_SEED_RESPONSE: u64 = 16 << 20;

/// What a worker knows after joining.
pub(crate) struct Joined {
    pub rank: usize,
    pub addrs: Vec<SocketAddr>,
    /// Each rank's key pin as the seed certified it (`None`: a rank that has left).
    pub pins: Vec<Option<KeyPin>>,
    pub identity: Identity,
    pub ca: CertificateDer<'static>,
    /// This worker's relay key pair with every rank's public relay key from the peer table.
    pub relay: Option<RelaySeals>,
    pub seed: Connection,
    /// The cluster was already running when this worker joined.
    pub running: bool,
}

/// How a worker proves it may join.
#[derive(Clone, Debug)]
pub(crate) enum Credentials {
    /// The token the seed printed: it pins the seed's CA and carries a secret.
    Token(JoinToken),
    /// The job's shared secret: the seed proves it first, then the worker.
    Secret(SharedSecret),
}

/// Joins the cluster through the seed at `seed_addr`. `endpoint` is the worker's own endpoint:
/// once the seed has signed its certificate, the endpoint starts accepting peers.
pub(crate) async fn join(
    endpoint: &Endpoint,
    seed_addr: SocketAddr,
    credentials: &Credentials,
    claim: &RankClaim,
    cfg: &NexarConfig,
) -> Result<Joined, ClusterError> {
    let proto = |reason: String| ClusterError::SeedProtocol { seed: seed_addr, reason };
    let connect_err = |reason: String| {
        ClusterError::Transport(TransportError::Connect { peer: "the seed".into(), addr: seed_addr, reason })
    };
    let pin = match credentials {
        Credentials::Token(token) => Some(token.ca_fingerprint()),
        Credentials::Secret(_) => None,
    };
    let client = with_transport(seed_client(pin)?, cfg);
    let connecting =
        endpoint.connect_with(client, seed_addr, SEED_SERVER_NAME).map_err(|e| connect_err(e.to_string()))?;
    let seed = timed(cfg.connect_timeout, "connecting to the seed", connecting).await?.map_err(|e| {
        // rustls reports our verifier's refusal as "error 40: unexpected error: …": say what
        // it means and what to do instead.
        let text = e.to_string();
        connect_err(if text.contains(crate::transport::tls::FOREIGN_SEED) {
            format!(
                "{}: the token belongs to another seed or an earlier run of this one; use the token this seed printed",
                crate::transport::tls::FOREIGN_SEED
            )
        } else if text.contains("certificate expired") {
            "the seed's certificate has expired (the seed's NEXAR_CERT_LIFETIME_HOURS ran out): it admits nobody \
             more; start a new job, with a longer lifetime if it must run longer"
                .to_string()
        } else {
            text
        })
    })?;
    let (mut send, mut recv) = seed.open_bi().await.map_err(|e| connect_err(e.to_string()))?;

    let (pending, csr_der) = PendingIdentity::generate()?;
    let relay_secret = RelaySecret::generate().map_err(|e| ClusterError::Transport(TransportError::Tls(e)))?;
    let listen = endpoint.local_addr().map_err(|e| connect_err(e.to_string()))?;
    let request = SeedRequest::Join {
        protocol: PROTOCOL_VERSION,
        auth: match credentials {
            Credentials::Token(token) => JoinAuth::Token { secret: token.secret().to_vec() },
            Credentials::Secret(_) => JoinAuth::SharedSecret,
        },
        claim: claim.clone(),
        csr_der,
        listen_addr: listen.to_string(),
        lane_sealing: cfg.lane_sealing(),
        relay_key: relay_secret.public().to_vec(),
    };
    write_message(&mut send, &request).await.map_err(|e| connect_err(e.to_string()))?;
    if let Credentials::Secret(secret) = credentials {
        exchange_proofs(&seed, &mut send, &mut recv, secret, seed_addr, cfg).await?;
    }

    let welcome = timed(
        cfg.connect_timeout,
        "waiting for the seed's answer",
        read_message::<SeedResponse>(&mut recv, MAX_SEED_RESPONSE),
    )
    .await?
    .map_err(|e| proto(e.to_string()))?
    .ok_or_else(|| proto("the seed closed the join stream without an answer".into()))?;
    let (rank, world, cluster_id, cert_der, ca_der, running) = match welcome {
        SeedResponse::Welcome { rank, world_size, cluster_id, cert_der, ca_der, running } => {
            (rank, world_size, cluster_id, cert_der, ca_der, running)
        }
        SeedResponse::Reject { reason } if reason == super::seed::WRONG_SECRET => {
            return Err(ClusterError::SecretMismatch { seed: seed_addr, side: MismatchSide::Worker });
        }
        SeedResponse::Reject { reason } => {
            return Err(ClusterError::JoinRejected { seed: seed_addr, reason });
        }
        other => return Err(proto(format!("expected a welcome, got {other:?}"))),
    };
    let expected_ca = match credentials {
        Credentials::Token(token) => token.ca_fingerprint(),
        Credentials::Secret(_) => presented_ca(&seed).ok_or_else(|| proto("it presented no CA certificate".into()))?,
    };
    if fingerprint(&ca_der) != expected_ca {
        return Err(proto("the CA certificate it sent is not the one its TLS session presented".into()));
    }
    if rank >= world || rank_from_cert(&cert_der)? != rank {
        return Err(proto(format!("the certificate it signed is not bound to rank {rank} of {world}")));
    }
    let identity = pending.complete(cert_der, ca_der.clone());
    let ca = CertificateDer::from(ca_der);
    endpoint.set_server_config(Some(server_with_transport(mesh_server(&identity, &ca)?, cfg)));
    tracing::info!(rank, world, cluster_id, "joined; waiting for the other workers");

    let (addrs, pins, relay_keys) = wait_for_table(&mut recv, cluster_id, world, seed_addr, cfg).await?;
    if addrs.len() != world as usize {
        return Err(proto(format!("the peer table lists {} ranks, the welcome said {world}", addrs.len())));
    }
    let addrs = addrs
        .iter()
        .map(|a| a.parse::<SocketAddr>().map_err(|_| proto(format!("peer address {a:?} does not parse"))))
        .collect::<Result<Vec<_>, _>>()?;
    if pins.get(rank as usize).copied().flatten() != Some(key_pin(identity.cert())?) {
        return Err(proto(format!("the peer table does not pin this worker's own key for rank {rank}")));
    }
    if relay_keys.get(rank as usize).copied().flatten() != Some(relay_secret.public()) {
        return Err(proto(format!("the peer table does not carry this worker's own relay key for rank {rank}")));
    }
    let relay = Some(RelaySeals::new(rank, relay_secret, relay_keys));
    Ok(Joined { rank: rank as usize, addrs, pins, identity, ca, relay, seed, running })
}

/// The peer table: where each rank listens, its key pin and its public relay key.
type PeerTable = (Vec<String>, Vec<Option<KeyPin>>, Vec<Option<RelayPublicKey>>);

/// Parses one key per rank of a peer table of `ranks` ranks: `N` bytes each, or none (empty)
/// for a rank that has left.
fn fixed_keys<const N: usize>(keys: &[Vec<u8>], ranks: usize, what: &str) -> Result<Vec<Option<[u8; N]>>, String> {
    if keys.len() != ranks {
        return Err(format!("a peer table of {ranks} ranks with {} {what}s", keys.len()));
    }
    keys.iter()
        .map(|k| match k.len() {
            0 => Ok(None),
            _ => <[u8; N]>::try_from(&k[..]).map(Some).map_err(|_| format!("a {}-byte {what}", k.len())),
        })
        .collect()
}

/// Reads the seed's progress notes until it publishes the peer table. A worker that gives up
/// says how many ranks had joined and what the seed refused.
async fn wait_for_table(
    recv: &mut quinn::RecvStream,
    cluster_id: u64,
    world: u32,
    seed_addr: SocketAddr,
    cfg: &NexarConfig,
) -> Result<PeerTable, ClusterError> {
    let proto = |reason: String| ClusterError::SeedProtocol { seed: seed_addr, reason };
    let deadline = tokio::time::Instant::now() + cfg.join_timeout;
    let (mut joined, mut refused) = (0u32, Vec::new());
    loop {
        let next = tokio::time::timeout_at(deadline, read_message::<SeedResponse>(recv, MAX_SEED_RESPONSE)).await;
        let Ok(next) = next else {
            return Err(ClusterError::JoinIncomplete {
                seed: seed_addr,
                after: cfg.join_timeout,
                joined,
                world,
                refused,
            });
        };
        let lost = |reason: String| ClusterError::SeedLost {
            seed: seed_addr,
            reason,
            joined,
            world,
            refused: refused.clone(),
        };
        let next = match next {
            Err(crate::transport::framed::ReadFrameError::Closed(reason)) => return Err(lost(reason)),
            other => other.map_err(|e| proto(e.to_string()))?,
        };
        match next {
            Some(SeedResponse::PeerTable { cluster_id: id, addrs, keys, relay_keys }) if id == cluster_id => {
                let pins = fixed_keys(&keys, addrs.len(), "key pin").map_err(proto)?;
                let relay_keys = fixed_keys(&relay_keys, addrs.len(), "relay key").map_err(proto)?;
                return Ok((addrs, pins, relay_keys));
            }
            Some(SeedResponse::Progress { joined: j, refused: r, .. }) => {
                tracing::debug!(joined = j, world, refused = ?r, "waiting for the other workers");
                (joined, refused) = (j, r);
            }
            // A seed that closes says why before it goes (rank 0, which hosts it, gave up).
            Some(SeedResponse::Reject { reason }) => return Err(lost(reason)),
            Some(other) => return Err(proto(format!("expected the peer table, got {other:?}"))),
            None => return Err(lost("it closed the join stream".into())),
        }
    }
}

/// The shared-secret handshake, worker side: check the seed's proof first, and only then send
/// this worker's own. A seed that cannot prove it knows the secret learns nothing from us.
async fn exchange_proofs(
    seed: &Connection,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    secret: &SharedSecret,
    seed_addr: SocketAddr,
    cfg: &NexarConfig,
) -> Result<(), ClusterError> {
    let proto = |reason: String| ClusterError::SeedProtocol { seed: seed_addr, reason };
    let exported = exported(seed).map_err(proto)?;
    let first = timed(
        cfg.connect_timeout,
        "waiting for the seed's proof of the secret",
        read_message::<SeedResponse>(recv, MAX_SEED_RESPONSE),
    )
    .await?
    .map_err(|e| proto(e.to_string()))?
    .ok_or_else(|| proto("the seed closed the join stream without proving the secret".into()))?;
    match first {
        SeedResponse::SecretProof { proof } if secret.verify(Role::Seed, &exported, &proof) => {}
        SeedResponse::SecretProof { .. } => {
            seed.close(CloseCode::SeedUnproven.value().into(), b"the seed does not know this job's secret");
            // Give the endpoint driver a moment to send the close, so that the seed logs why
            // (this rank is about to fail, and its process may exit at once).
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            return Err(ClusterError::SecretMismatch { seed: seed_addr, side: MismatchSide::Seed });
        }
        SeedResponse::Reject { reason } => return Err(ClusterError::JoinRejected { seed: seed_addr, reason }),
        other => return Err(proto(format!("expected the seed's proof of the secret, got {other:?}"))),
    }
    let proof = SeedRequest::SecretProof { proof: secret.proof(Role::Joiner, &exported) };
    write_message(send, &proof).await.map_err(|e| proto(e.to_string()))?;
    Ok(())
}

/// The CA certificate the seed presented in its TLS handshake (the last of its chain).
fn presented_ca(seed: &Connection) -> Option<[u8; 32]> {
    let chain = seed.peer_identity()?.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    chain.last().map(|ca| fingerprint(ca))
}

async fn timed<F: std::future::Future>(
    limit: std::time::Duration,
    what: &str,
    f: F,
) -> Result<F::Output, ClusterError> {
    tokio::time::timeout(limit, f).await.map_err(|_| ClusterError::Timeout { what: what.to_string(), after: limit })
}
