//! Forming the direct peer mesh: every rank dials the ranks below it and accepts the ranks
//! above it, each connection mutually authenticated and bound to the rank it claims.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quinn::{Connection, ConnectionError, Endpoint, TransportErrorCode};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tracing::Instrument;

use super::ClusterError;
use crate::config::NexarConfig;
use crate::proto::close::CloseCode;
use crate::proto::topology::Topology;
use crate::transport::endpoint::{same_host, same_host_transport_config, with_transport};
use crate::transport::link::{LaneSenders, PeerLink};
use crate::transport::tls::{Identity, KeyPin, key_pin, mesh_client, mesh_server, rank_from_cert, rank_server_name};

/// What a rank needs to join the mesh.
pub(crate) struct MeshSetup<'a> {
    pub rank: usize,
    pub addrs: &'a [SocketAddr],
    pub identity: &'a Identity,
    pub ca: &'a CertificateDer<'static>,
    pub cfg: &'a NexarConfig,
    pub lanes: LaneSenders,
    /// World ranks this rank keeps room for (ranks above the initial world may join later).
    pub capacity: usize,
    /// Whether ranks beyond the initial world may dial in later: true for clusters formed by
    /// a seed, whose certificate for a new rank is its admission; false for static and
    /// in-process clusters, whose membership is fixed.
    pub elastic: bool,
    /// Which ranks of the initial world connect directly.
    pub topology: Topology,
    /// Joining a running cluster: a listed rank that does not answer one dial has most likely
    /// died (the seed learns of that only when its own connection to it times out), so it is
    /// left out instead of failing the join.
    pub late: bool,
    /// Each rank's key pin from the seed's peer table (`None`, or no entry: not pinned; a
    /// static or in-process cluster, or a rank that joins later).
    pub pins: &'a [Option<KeyPin>],
}

/// A formed mesh: one link per other rank, the task that keeps accepting (ranks that join
/// later) and refusing strangers, and the connections it accepts from now on.
pub(crate) struct Mesh {
    pub links: Vec<Option<PeerLink>>,
    pub acceptor: JoinHandle<()>,
    pub late: mpsc::Receiver<(u32, Connection)>,
}

/// Whether a peer-table entry stands for a rank that has left (the seed lists no address).
pub(crate) fn is_absent(addr: &SocketAddr) -> bool {
    addr.port() == 0
}

/// The rank an authenticated connection's client certificate is bound to.
fn peer_rank(conn: &Connection) -> Result<u32, String> {
    rank_from_cert(&peer_leaf(conn)?).map_err(|e| e.to_string())
}

/// Whether the connection's peer holds the key the seed certified for `peer`, where the peer
/// table pins one.
fn check_pin(pins: &[Option<KeyPin>], peer: usize, conn: &Connection) -> Result<(), String> {
    let Some(Some(pinned)) = pins.get(peer) else { return Ok(()) };
    let leaf = peer_leaf(conn)?;
    let key = key_pin(&leaf).map_err(|e| e.to_string())?;
    if &key == pinned {
        Ok(())
    } else {
        Err(format!(
            "its certificate for rank {peer} holds another key than the one the seed certified for that rank \
             (an older certificate, from a worker that left before the cluster formed?)"
        ))
    }
}

/// The leaf certificate an authenticated connection's peer presented.
fn peer_leaf(conn: &Connection) -> Result<CertificateDer<'static>, String> {
    let identity = conn.peer_identity().ok_or("no certificate presented")?;
    let certs = identity.downcast::<Vec<CertificateDer<'static>>>().map_err(|_| "unexpected peer identity type")?;
    certs.first().cloned().ok_or_else(|| "empty certificate chain".to_string())
}

/// Connects `setup.rank` to every other rank. Returns once all `world - 1` links are up, or
/// fails naming the ranks that are missing when `cfg.mesh_timeout` runs out.
pub(crate) async fn form_mesh(endpoint: &Endpoint, setup: MeshSetup<'_>) -> Result<Mesh, ClusterError> {
    let MeshSetup { rank, addrs, identity, ca, cfg, lanes, capacity, elastic, topology, late, pins } = setup;
    let pins: Arc<Vec<Option<KeyPin>>> = Arc::new(pins.to_vec());
    let world = addrs.len();
    let deadline = Instant::now() + cfg.mesh_timeout;
    let mesh_err = |reason: String| ClusterError::Mesh { rank, reason };

    // Every higher rank dials us: those of the initial world now, later joiners any time.
    let neighbors = topology.neighbors(rank, world);
    let linked = |r: usize, a: &SocketAddr| neighbors.contains(&r) && !is_absent(a);
    let expect = |r: usize| match addrs.get(r) {
        Some(a) => r > rank && linked(r, a),
        None => elastic,
    };
    let expected: Arc<Mutex<Vec<bool>>> = Arc::new(Mutex::new((0..capacity.max(world)).map(expect).collect()));
    let (accepted_tx, mut accepted_rx) = mpsc::channel::<(u32, Connection)>(world.max(16));
    // Connections between ranks of this host skip path-MTU discovery (see
    // `same_host_transport_config`); the others discover it.
    let here = addrs[rank].ip();
    let mut local_server = mesh_server(identity, ca)?;
    local_server.transport_config(same_host_transport_config(cfg));
    let local_server = Arc::new(local_server);
    let accepting = Accepting { expected: expected.clone(), pins: pins.clone(), here, local_server };
    let acceptor = tokio::spawn(
        accept_peers(endpoint.clone(), accepting, accepted_tx, cfg.connect_timeout)
            .instrument(tracing::debug_span!("acceptor", rank)),
    );

    let remote_client = with_transport(mesh_client(identity, ca)?, cfg);
    let mut local_client = mesh_client(identity, ca)?;
    local_client.transport_config(same_host_transport_config(cfg));
    let mut dials = JoinSet::new();
    for (peer, addr) in addrs.iter().enumerate().take(rank).filter(|(p, a)| linked(*p, a)) {
        let client = if same_host(here, addr.ip()) { local_client.clone() } else { remote_client.clone() };
        let (endpoint, addr) = (endpoint.clone(), *addr);
        let attempt = cfg.connect_timeout;
        let until = if late { deadline.min(Instant::now() + attempt) } else { deadline };
        dials.spawn(async move { (peer, dial(&endpoint, client, rank, peer, addr, until, attempt).await) });
    }

    let mut links: Vec<Option<PeerLink>> = (0..world).map(|_| None).collect();
    let mut early = Vec::new();
    let mut missing = addrs.iter().enumerate().filter(|(p, a)| linked(*p, a)).count();
    let spawn_link = |peer: usize, conn: Connection| {
        PeerLink::spawn(rank as u32, peer as u32, conn, lanes.clone(), cfg.max_message_bytes)
    };
    while missing > 0 {
        tokio::select! {
            Some(done) = dials.join_next(), if !dials.is_empty() => {
                let (peer, result) = done.map_err(|e| mesh_err(format!("a dial task failed: {e}")))?;
                missing -= 1;
                let result = result.and_then(|conn| match check_pin(&pins, peer, &conn) {
                    Ok(()) => Ok(conn),
                    Err(why) => {
                        conn.close(CloseCode::Refused.value().into(), b"not the key the seed certified");
                        Err(format!("rank {rank} dialled rank {peer}: {why}"))
                    }
                });
                match result {
                    Ok(conn) => links[peer] = Some(spawn_link(peer, conn)),
                    Err(reason) if late => tracing::warn!(rank, peer, %reason, "left out a listed rank that did not answer"),
                    Err(reason) => {
                        acceptor.abort();
                        return Err(mesh_err(reason));
                    }
                }
            }
            Some((peer, conn)) = accepted_rx.recv() => {
                if (peer as usize) < world {
                    links[peer as usize] = Some(spawn_link(peer as usize, conn));
                    missing -= 1;
                } else {
                    // A rank that joined after the table was made: it dialled early.
                    early.push((peer, conn));
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                acceptor.abort();
                let absent: Vec<String> = links
                    .iter()
                    .enumerate()
                    .filter(|(p, l)| l.is_none() && linked(*p, &addrs[*p]))
                    .map(|(p, _)| format!("rank {p} at {}", addrs[p]))
                    .collect();
                return Err(mesh_err(format!("no connection within {:?} from {}", cfg.mesh_timeout, absent.join(", "))));
            }
        }
    }
    tracing::info!(rank, world, "mesh formed");
    // Hand connections from late joiners that arrived during formation to the same queue.
    let (late_tx, late) = mpsc::channel(16);
    tokio::spawn(async move {
        for c in early {
            if late_tx.send(c).await.is_err() {
                return;
            }
        }
        while let Some(c) = accepted_rx.recv().await {
            if late_tx.send(c).await.is_err() {
                return;
            }
        }
    });
    Ok(Mesh { links, acceptor, late })
}

/// Dials `peer`, retrying while it is not yet accepting, until `deadline`. A peer that presents
/// a certificate not bound to `peer` (or rejects ours) is a permanent failure.
async fn dial(
    endpoint: &Endpoint,
    client: quinn::ClientConfig,
    rank: usize,
    peer: usize,
    addr: SocketAddr,
    deadline: Instant,
    attempt_limit: Duration,
) -> Result<Connection, String> {
    let name = rank_server_name(peer as u32);
    let mut backoff = Duration::from_millis(20);
    loop {
        let connecting = endpoint
            .connect_with(client.clone(), addr, &name)
            .map_err(|e| format!("cannot dial rank {peer} at {addr}: {e}"))?;
        let until = deadline.min(Instant::now() + attempt_limit);
        let retry_reason = match tokio::time::timeout_at(until, connecting).await {
            Ok(Ok(conn)) => {
                match peer_rank(&conn) {
                    Ok(r) if r as usize == peer => {}
                    Ok(r) => {
                        conn.close(CloseCode::Refused.value().into(), b"certificate names another rank");
                        return Err(format!(
                            "rank {rank} dialled rank {peer} at {addr} but its certificate names rank {r}"
                        ));
                    }
                    Err(e) => return Err(format!("rank {peer} at {addr}: {e}")),
                }
                match accepted_by_peer(&conn, deadline).await {
                    Ok(()) => return Ok(conn),
                    Err(Some(ConnectionError::ApplicationClosed(close)))
                        if close.error_code == CloseCode::Refused.value().into() =>
                    {
                        let why = String::from_utf8_lossy(&close.reason);
                        return Err(format!("rank {peer} at {addr} refused rank {rank}: {why}"));
                    }
                    // Its side gave up on a handshake that took too long: dial again.
                    Err(Some(e)) => format!("closed before it accepted: {e}"),
                    Err(None) => {
                        return Err(format!(
                            "rank {peer} at {addr} did not finish accepting rank {rank} before the mesh deadline \
                             (the handshake completed on the dialling side only)"
                        ));
                    }
                }
            }
            Ok(Err(ConnectionError::ConnectionClosed(close)))
                if close.error_code == TransportErrorCode::CONNECTION_REFUSED =>
            {
                "refused (not accepting yet)".to_string()
            }
            Ok(Err(e @ (ConnectionError::TimedOut | ConnectionError::Reset))) => e.to_string(),
            Ok(Err(e)) => {
                return Err(format!("rank {rank} could not authenticate rank {peer} at {addr}: {e}"));
            }
            Err(_) => "no answer".to_string(),
        };
        if Instant::now() + backoff >= deadline {
            return Err(format!(
                "rank {peer} at {addr} did not accept before the mesh deadline (last attempt: {retry_reason})"
            ));
        }
        tracing::debug!(peer, %addr, reason = %retry_reason, "retrying dial");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Waits until the peer has finished accepting `conn` as well (its `HANDSHAKE_DONE` arrived);
/// fails with the connection's end, or `None` at `deadline`.
///
/// A dialler's handshake completes a round trip before the acceptor's, and on a lossy network
/// the acceptor's last step can take seconds: each lost retransmission doubles the wait. Until
/// then the peer cannot send on the link, so a dialler that counted the link as formed would
/// count the peer's silence against its heartbeat timeout and declare a live rank dead.
async fn accepted_by_peer(conn: &Connection, deadline: Instant) -> Result<(), Option<ConnectionError>> {
    let mut pause = Duration::from_micros(200);
    loop {
        if conn.stats().frame_rx.handshake_done > 0 {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(None);
        }
        tokio::select! {
            why = conn.closed() => return Err(Some(why)),
            _ = tokio::time::sleep(pause.min(left)) => {}
        }
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// What the acceptor lets in, and how.
struct Accepting {
    /// Which world ranks may still dial in.
    expected: Arc<Mutex<Vec<bool>>>,
    /// Each rank's key pin from the seed's peer table.
    pins: Arc<Vec<Option<KeyPin>>>,
    /// This rank's own address: a dialler at it (or on loopback) is on this host.
    here: std::net::IpAddr,
    /// The server configuration for diallers on this host.
    local_server: Arc<quinn::ServerConfig>,
}

/// Accepts connections for the life of the rank. Only a rank above ours that has not connected
/// yet is let in; every other connection (a stranger, a duplicate, a certificate for a rank
/// that should dial elsewhere) is closed and logged.
async fn accept_peers(
    endpoint: Endpoint,
    accepting: Accepting,
    accepted: mpsc::Sender<(u32, Connection)>,
    handshake_limit: Duration,
) {
    let Accepting { expected, pins, here, local_server } = accepting;
    while let Some(incoming) = endpoint.accept().await {
        let remote = incoming.remote_address();
        let (expected, accepted, pins) = (expected.clone(), accepted.clone(), pins.clone());
        let connecting =
            if same_host(here, remote.ip()) { incoming.accept_with(local_server.clone()) } else { incoming.accept() };
        tokio::spawn(
            async move {
                let connecting = match connecting {
                    Ok(connecting) => connecting,
                    Err(e) => {
                        tracing::warn!(%remote, error = %e, "refused a peer connection");
                        return;
                    }
                };
                let conn = match tokio::time::timeout(handshake_limit, connecting).await {
                    Ok(Ok(conn)) => conn,
                    Ok(Err(e)) => {
                        tracing::warn!(%remote, error = %e, "refused a peer connection: authentication failed");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(%remote, "refused a peer connection: handshake timed out");
                        return;
                    }
                };
                let peer = match peer_rank(&conn) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(%remote, error = %e, "refused a peer connection");
                        conn.close(CloseCode::Refused.value().into(), e.as_bytes());
                        return;
                    }
                };
                if let Err(why) = check_pin(&pins, peer as usize, &conn) {
                    tracing::warn!(%remote, peer, %why, "refused a peer connection");
                    conn.close(CloseCode::Refused.value().into(), b"not the key the seed certified");
                    return;
                }
                let admit = {
                    let mut exp = crate::sync::lock(&expected);
                    match exp.get_mut(peer as usize) {
                        Some(slot) if *slot => {
                            *slot = false;
                            true
                        }
                        _ => false,
                    }
                };
                if !admit || accepted.send((peer, conn.clone())).await.is_err() {
                    tracing::warn!(%remote, peer, "refused a peer connection: rank {peer} is not expected to dial here (duplicate or wrong direction)");
                    conn.close(CloseCode::Refused.value().into(), b"unexpected rank");
                }
            }
            .in_current_span(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::endpoint::{bind, server_with_transport, with_transport};
    use crate::transport::tls::{ClusterCa, mesh_server};

    /// A peer presenting a valid certificate for rank 1 is admitted as rank 1 only if the key
    /// in it is the one the peer table pins for rank 1 (or nothing is pinned).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_key_the_seed_certified_passes_for_a_pinned_rank() {
        let cfg = NexarConfig::default();
        let ca = ClusterCa::generate().unwrap();
        let ca_der = ca.certificate();
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (listener, dialler) = (ca.issue(&rank_server_name(0)).unwrap(), ca.issue(&rank_server_name(1)).unwrap());
        // The same rank's certificate with another key: what a worker that left before the
        // cluster formed still holds.
        let stale = ca.issue(&rank_server_name(1)).unwrap();
        let server =
            bind(loopback, &cfg, Some(server_with_transport(mesh_server(&listener, &ca_der).unwrap(), &cfg))).unwrap();
        let at = server.local_addr().unwrap();
        let accepting = tokio::spawn(async move {
            let mut conns = Vec::new();
            for _ in 0..2 {
                conns.push(server.accept().await.unwrap().await.unwrap());
            }
            (server, conns)
        });
        let client = bind(loopback, &cfg, None).unwrap();
        let mut dialled = Vec::new();
        for id in [&dialler, &stale] {
            let config = with_transport(mesh_client(id, &ca_der).unwrap(), &cfg);
            dialled.push(client.connect_with(config, at, &rank_server_name(0)).unwrap().await.unwrap());
        }
        let (_server, accepted) = accepting.await.unwrap();
        let pins = [Some(key_pin(listener.cert()).unwrap()), Some(key_pin(dialler.cert()).unwrap())];
        // The acceptor's view: both present rank 1, only one holds the pinned key.
        let verdicts: Vec<bool> = accepted.iter().map(|c| check_pin(&pins, 1, c).is_ok()).collect();
        assert_eq!(verdicts.iter().filter(|ok| **ok).count(), 1, "{verdicts:?}");
        let refused = accepted.iter().find_map(|c| check_pin(&pins, 1, c).err()).unwrap();
        assert!(refused.contains("another key than the one the seed certified"), "{refused}");
        // Unpinned (static clusters, later joiners): both pass.
        assert!(accepted.iter().all(|c| check_pin(&[None, None], 1, c).is_ok() && check_pin(&[], 1, c).is_ok()));
        // The dialler's view of the listener.
        assert!(check_pin(&pins, 0, &dialled[0]).is_ok());
        assert!(check_pin(&[Some(key_pin(stale.cert()).unwrap())], 0, &dialled[0]).is_err());
    }
}
