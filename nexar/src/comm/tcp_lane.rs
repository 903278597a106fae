//! Bringing the TCP lane up on every direct link of a communicator: offers over QUIC, two TLS
//! connections per link, then both sides say whether theirs came up, and only a link where both
//! did moves its collective payloads to TCP. Anything else leaves that link on QUIC.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::{ServerConnection, StreamOwned};
use tokio::sync::oneshot;

use super::client::NexarClient;
use crate::transport::tcp_lane::{Connected, LaneMsg, LaneTls, ReadLimits, TOKEN_LEN, TcpLane, answer, dial, lane_tag};

/// Room in a received group for the frames around the largest payload.
const GROUP_OVERHEAD: u64 = 256 << 10;

type Incoming = StreamOwned<ServerConnection, TcpStream>;

/// Connections this rank waits for, by the token it gave their dialler.
type Expected = Arc<Mutex<HashMap<[u8; TOKEN_LEN], (u32, oneshot::Sender<Incoming>)>>>;

/// One peer through the exchange.
struct Peer {
    rank: usize,
    world: u32,
    direct: bool,
    /// The peer keeps QUIC by its own choice (not worth a warning here).
    declined: bool,
    /// Why this link stays on QUIC, once something decided so.
    quic: Option<String>,
    incoming: Option<oneshot::Receiver<Incoming>>,
}

impl NexarClient {
    /// Moves the collective payloads of every direct link that can to a TCP lane; every rank of
    /// the communicator calls it at the same point (like a collective). Returns, per peer, the
    /// lane's outcome: `Ok` or why the link stays on QUIC.
    ///
    /// With `tls` an error (this rank keeps QUIC, and why), the rank only tells its peers so,
    /// so that they do not wait for it.
    pub(crate) async fn attach_tcp_lanes(&self, tls: Result<&LaneTls, String>) -> Vec<(usize, Result<(), String>)> {
        // Once per cluster, when it forms: fixed tags, and the communicator's setup numbers
        // stay for the back ends an application attaches later.
        let offer_tag = lane_tag(0, 0);
        let limit = self.config().connect_timeout;
        let tls = match tls {
            Ok(tls) => tls,
            Err(reason) => return self.decline_tcp_lanes(offer_tag, reason).await,
        };
        let (mut listener, port) = match self.lane_listener() {
            Ok((listener, port)) => (Some(listener), Ok(port)),
            Err(reason) => (None, Err(reason)),
        };
        let expected: Expected = Arc::default();
        // Peers without a direct link have none to this rank either: nothing to say to them.
        let mut peers: Vec<Peer> = self.lane_peers().into_iter().filter(|p| p.direct).collect();

        // Round one: an offer (or why not) to every peer.
        for p in &mut peers {
            let ours = match (&port, &p.quic) {
                (Ok(port), None) => {
                    let token: [u8; TOKEN_LEN] = rand::random();
                    let (tx, rx) = oneshot::channel();
                    crate::sync::lock(&expected).insert(token, (p.world, tx));
                    p.incoming = Some(rx);
                    LaneMsg::Offer { port: *port, token }
                }
                (Err(reason), None) => LaneMsg::Decline { reason: reason.clone() },
                (_, Some(reason)) => LaneMsg::Decline { reason: reason.clone() },
            };
            if let Err(e) = self.send_setup(p.rank, offer_tag, ours.encode()).await {
                p.quic.get_or_insert(e.to_string());
            }
            if matches!(ours, LaneMsg::Decline { .. }) {
                p.quic.get_or_insert("declined here".into());
            }
        }
        let accepting =
            listener.take().map(|l| AbortOnDrop(tokio::spawn(accept_lanes(l, tls.clone(), expected.clone(), limit))));

        // Then every peer on its own (one slow peer delays nobody else): its offer, the two
        // connections, both outcomes. Each step has a deadline counted from the same start, so
        // both ends of a link give up at about the same time.
        let start = Instant::now();
        let mut exchanges = tokio::task::JoinSet::new();
        for p in peers {
            let (me, tls) = (self.clone(), tls.clone());
            exchanges.spawn(async move { me.lane_exchange(p, &tls, start, limit).await });
        }
        let mut outcomes = Vec::new();
        while let Some(done) = exchanges.join_next().await {
            match done {
                Ok(outcome) => outcomes.push(outcome),
                Err(e) => tracing::warn!(rank = self.rank(), error = %e, "a tcp lane exchange failed"),
            }
        }
        drop(accepting);
        outcomes.sort_by_key(|(rank, _, _)| *rank);
        outcomes
            .into_iter()
            .map(|(peer, declined, outcome)| {
                match &outcome {
                    Err(reason) if !declined => {
                        tracing::warn!(rank = self.rank(), peer, %reason, "collective payloads to this peer stay on QUIC");
                    }
                    Err(reason) => tracing::debug!(rank = self.rank(), peer, %reason, "no tcp lane"),
                    Ok(()) => {}
                }
                (peer, outcome)
            })
            .collect()
    }

    /// One peer's side of the exchange after this rank's offer: `(peer, whether the peer
    /// declined, outcome)`.
    async fn lane_exchange(
        &self,
        mut p: Peer,
        tls: &LaneTls,
        start: Instant,
        limit: Duration,
    ) -> (usize, bool, Result<(), String>) {
        let (offer_tag, outcome_tag) = (lane_tag(0, 0), lane_tag(0, 1));
        // Their offer, and a dial where they made one.
        let mut outgoing = None;
        let theirs = self.lane_setup(p.rank, offer_tag, start + limit).await;
        match (theirs, self.peer_addr(p.rank)) {
            (Ok(LaneMsg::Offer { port, token }), Some(addr)) if p.quic.is_none() => {
                let mut hello = [0u8; TOKEN_LEN + 4];
                hello[..TOKEN_LEN].copy_from_slice(&token);
                hello[TOKEN_LEN..].copy_from_slice(&(self.world_rank() as u32).to_le_bytes());
                let (tls, world, at) = (tls.clone(), p.world, SocketAddr::new(addr.ip(), port));
                match tokio::task::spawn_blocking(move || dial(&tls, at, world, hello, limit)).await {
                    Ok(Ok(stream)) => outgoing = Some(stream),
                    Ok(Err(e)) => p.quic = Some(format!("cannot dial rank {}'s tcp lane: {e}", p.rank)),
                    Err(e) => p.quic = Some(format!("dialling rank {}: {e}", p.rank)),
                }
            }
            (Ok(LaneMsg::Decline { reason }), _) => {
                p.declined = true;
                p.quic.get_or_insert(format!("rank {} declined: {reason}", p.rank));
            }
            (Ok(other @ (LaneMsg::Ready | LaneMsg::Failed { .. })), _) => {
                p.quic.get_or_insert(format!("rank {} answered round one with {other:?}", p.rank));
            }
            (Err(e), _) => {
                p.quic.get_or_insert(e);
            }
            (Ok(LaneMsg::Offer { .. }), None) => {
                p.quic.get_or_insert("no direct link".into());
            }
            (Ok(LaneMsg::Offer { .. }), Some(_)) => {}
        }
        // Their connection to this rank.
        let incoming = match (p.quic.is_none(), p.incoming.take()) {
            (true, Some(rx)) => match tokio::time::timeout_at((start + 2 * limit).into(), rx).await {
                Ok(Ok(stream)) => Some(stream),
                _ => {
                    p.quic = Some(format!("rank {} did not connect to this rank's tcp lane", p.rank));
                    None
                }
            },
            _ => None,
        };
        let (ours, conns) = match (&p.quic, outgoing, incoming) {
            (None, Some(outgoing), Some(incoming)) => (LaneMsg::Ready, Some(Connected { outgoing, incoming })),
            (reason, ..) => {
                (LaneMsg::Failed { reason: reason.clone().unwrap_or_else(|| "not connected".into()) }, None)
            }
        };
        // A peer that declined expects no outcome, but an extra message is harmless.
        let _ = self.send_setup(p.rank, outcome_tag, ours.encode()).await;
        let Some(conns) = conns else {
            return (p.rank, p.declined, Err(p.quic.unwrap_or_else(|| "not connected".into())));
        };
        let outcome = match self.lane_setup(p.rank, outcome_tag, start + 3 * limit).await {
            Ok(LaneMsg::Ready) => self.start_tcp_lane(p.rank, conns),
            Ok(LaneMsg::Failed { reason }) => Err(format!("rank {}: {reason}", p.rank)),
            Ok(other) => Err(format!("rank {} answered round two with {other:?}", p.rank)),
            Err(e) => Err(e),
        };
        (p.rank, false, outcome)
    }

    /// Tells every direct peer that this rank keeps QUIC.
    async fn decline_tcp_lanes(&self, offer_tag: u64, reason: String) -> Vec<(usize, Result<(), String>)> {
        let mut outcomes = Vec::new();
        for p in self.lane_peers().into_iter().filter(|p| p.direct) {
            let _ = self.send_setup(p.rank, offer_tag, LaneMsg::Decline { reason: reason.clone() }.encode()).await;
            outcomes.push((p.rank, Err(reason.clone())));
        }
        outcomes
    }

    /// The lane's listener on the address of this rank's QUIC endpoint, and its port.
    fn lane_listener(&self) -> Result<(std::net::TcpListener, u16), String> {
        let ip = self.inner.endpoint.local_addr().map(|a| a.ip()).unwrap_or(IpAddr::from([0, 0, 0, 0]));
        let listener =
            std::net::TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| format!("cannot listen on {ip}: {e}"))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        Ok((listener, port))
    }

    /// Every other rank; those with a channel already are marked QUIC.
    fn lane_peers(&self) -> Vec<Peer> {
        (0..self.world_size())
            .filter(|r| *r != self.rank())
            .map(|rank| {
                let direct = self.bulk_transport(rank).is_some();
                let quic = self
                    .attached_bulk(rank)
                    .map(|other| format!("the link to rank {rank} already has a {other} channel"));
                Peer { rank, world: self.comm.members[rank] as u32, direct, declined: false, quic, incoming: None }
            })
            .collect()
    }

    /// The peer's next lane setup message with `tag`, by `deadline`.
    async fn lane_setup(&self, peer: usize, tag: u64, deadline: Instant) -> Result<LaneMsg, String> {
        match tokio::time::timeout_at(deadline.into(), self.recv_setup(peer, tag)).await {
            Ok(Ok(bytes)) => LaneMsg::decode(&bytes).map_err(|e| format!("rank {peer}: {e}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("rank {peer} sent no tcp lane setup in time")),
        }
    }

    /// The address this rank's QUIC link to `peer` reaches it at.
    fn peer_addr(&self, peer: usize) -> Option<SocketAddr> {
        let world = *self.comm.members.get(peer)?;
        Some(self.inner.links.get(world)?.remote_addr())
    }

    fn start_tcp_lane(&self, peer: usize, conns: Connected) -> Result<(), String> {
        let inbound = self.bulk_inbound(peer).ok_or_else(|| format!("rank {peer} is not a peer"))?;
        let cfg = self.config();
        let limits = ReadLimits {
            max_group: cfg.max_message_bytes.saturating_add(GROUP_OVERHEAD),
            // An operation waiting for the group fails at its own timeout anyway.
            group_deadline: cfg.op_timeout,
        };
        let lane = TcpLane::start(peer, conns, inbound, limits, cfg.bulk_min_bytes, cfg.bulk_encryption)
            .map_err(|e| format!("cannot start the lane's threads: {e}"))?;
        self.attach_bulk(peer, Arc::new(lane)).map_err(|e| e.to_string())
    }
}

/// Aborts a task when dropped (the lane listener, should the exchange be abandoned).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Accepts lane connections until aborted, answering each on a blocking thread; a connection
/// that brings a token this rank gave out, from the rank it gave it to, goes to its waiter.
async fn accept_lanes(listener: std::net::TcpListener, tls: LaneTls, expected: Expected, limit: Duration) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
    // Handshakes answered at once: strays cannot take every blocking thread, and the
    // listener closes when the exchange ends, so they cannot outlast it either.
    let answering = Arc::new(tokio::sync::Semaphore::new(crate::sync::lock(&expected).len() + 8));
    loop {
        let (sock, from) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::debug!(error = %e, "tcp lane listener: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = answering.clone().try_acquire_owned() else { continue };
        let Ok(sock) = sock.into_std().and_then(|s| s.set_nonblocking(false).map(|()| s)) else { continue };
        let (tls, expected) = (tls.clone(), expected.clone());
        tokio::task::spawn_blocking(move || {
            let _answering = permit;
            match answer(&tls, sock, limit) {
                Ok((hello, cert_rank, stream)) => {
                    let (token, claimed) = hello.split_at(TOKEN_LEN);
                    let claimed = u32::from_le_bytes(claimed.try_into().unwrap_or([0xff; 4]));
                    let mut expected = crate::sync::lock(&expected);
                    match expected.get(token) {
                        Some((world, _)) if *world == claimed && *world == cert_rank => {
                            if let Some((_, waiter)) = expected.remove(token) {
                                let _ = waiter.send(stream);
                            }
                        }
                        _ => {
                            tracing::warn!(%from, claimed, cert_rank, "refused a tcp lane connection with an unknown token")
                        }
                    }
                }
                Err(e) => tracing::debug!(%from, error = %e, "a tcp lane connection failed its handshake"),
            }
        });
    }
}
