//! Bringing the TCP lane up on every direct link of a communicator, through the negotiation
//! driver (`negotiate.rs`): each rank offers a listener port and a token per link, and whether
//! it wants one connection for both ways (its lane I/O runs on its runtime). Where both do, the
//! rank with the lower world rank dials the other's listener; otherwise both dial, one
//! connection per direction. Only a link whose connections came up on both sides moves its
//! collective payloads to TCP. Anything else leaves that link on QUIC.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::{ServerConnection, StreamOwned};
use tokio::sync::oneshot;

use crate::comm::backends::negotiate::{Connecting, LinkSetup, NotAttached, negotiate, setup_tags};
use crate::comm::client::NexarClient;
use crate::transport::tcp_lane::{
    Connected, LaneAead, LaneIo, LaneOffer, LaneTls, Pair, ReadLimits, TOKEN_LEN, TcpLane, answer, dial,
};

/// Room in a received group for the frames around the largest payload.
const GROUP_OVERHEAD: u64 = 256 << 10;
/// Smallest collective message a lane with threads of its own takes by default: below it a
/// thread wake-up per message costs more than QUIC's spinning path.
const MIN_BYTES_THREADS: usize = 256 << 10;
/// The same for a lane whose I/O runs on the rank's runtime: every size, since no thread
/// stands between the socket and the receive and a group costs fewer steps than QUIC's packet
/// path (np 2 on loopback: barrier 13.5 against 16 µs, 4 KiB allreduce 16.6 against 20.9,
/// 64 KiB 26 against 44; np 4 on two cores: barrier 85 against 153).
const MIN_BYTES_ON_RUNTIME: usize = 0;

type Incoming = StreamOwned<ServerConnection, TcpStream>;

/// Connections this rank waits for, by the token it gave their dialler.
type Expected = Arc<Mutex<HashMap<[u8; TOKEN_LEN], (u32, oneshot::Sender<Incoming>)>>>;

/// The TCP lane's part in the negotiation: dial the peer's listener, wait for its connection,
/// or both.
struct LaneSetup {
    comm: NexarClient,
    /// The lane's TLS, and the listener's task (accepting while the negotiation runs); none
    /// where this rank offers no lane (it only tells its peers why).
    tls: Option<(LaneTls, AbortOnDrop)>,
    limit: Duration,
    /// The connection each peer is to make to this rank (if it dials), by peer.
    incoming: Mutex<HashMap<usize, oneshot::Receiver<Incoming>>>,
}

impl LinkSetup for LaneSetup {
    type Connected = Connected;

    fn name(&self) -> &'static str {
        "tcp lane"
    }

    fn connect(self: Arc<Self>, peer: usize, ours: Vec<u8>, theirs: Vec<u8>, by: Instant) -> Connecting<Connected> {
        Box::pin(async move {
            let tls = self.tls.as_ref().map(|(tls, _)| tls.clone()).ok_or("this rank offers no tcp lane")?;
            let offer = LaneOffer::decode(&theirs)?;
            let own = LaneOffer::decode(&ours)?;
            if own.sealing != offer.sealing {
                return Err(format!(
                    "rank {peer} runs its tcp lane with {}, this rank with {}: every rank must use the same",
                    offer.sealing.settings(),
                    own.sealing.settings()
                ));
            }
            let one_connection = own.one_connection && offer.one_connection;
            let world = self.comm.comm.members[peer] as u32;
            let dialling = !one_connection || dials(self.comm.world_rank(), world as usize);
            let outgoing = if dialling {
                let addr = self.comm.peer_addr(peer).ok_or("no direct link")?;
                let mut hello = [0u8; TOKEN_LEN + 4];
                hello[..TOKEN_LEN].copy_from_slice(&offer.token);
                hello[TOKEN_LEN..].copy_from_slice(&(self.comm.world_rank() as u32).to_le_bytes());
                let (at, limit) = (SocketAddr::new(addr.ip(), offer.port), self.limit);
                match tokio::task::spawn_blocking(move || dial(&tls, at, world, hello, limit)).await {
                    Ok(Ok(stream)) => Some(stream),
                    Ok(Err(e)) => return Err(format!("cannot dial rank {peer}'s tcp lane: {e}")),
                    Err(e) => return Err(format!("dialling rank {peer}: {e}")),
                }
            } else {
                None
            };
            let incoming = if one_connection && dialling {
                None
            } else {
                let waiting = crate::sync::lock(&self.incoming).remove(&peer);
                let not_connected = || format!("rank {peer} did not connect to this rank's tcp lane");
                let incoming = match waiting {
                    Some(rx) => tokio::time::timeout_at(by.into(), rx).await.map_err(|_| not_connected())?,
                    None => return Err(not_connected()),
                };
                Some(incoming.map_err(|_| not_connected())?)
            };
            match (outgoing, incoming) {
                (Some(outgoing), Some(incoming)) => Ok(Connected::Pair(Box::new(Pair { outgoing, incoming }))),
                (Some(dialled), None) => Ok(Connected::Dialled(dialled)),
                (None, Some(answered)) => Ok(Connected::Answered(answered)),
                (None, None) => Err(format!("no tcp lane connection to rank {peer}")),
            }
        })
    }

    fn start(&self, peer: usize, conns: Connected) -> Result<(), String> {
        self.comm.start_tcp_lane(peer, conns)
    }
}

impl NexarClient {
    /// Moves the collective payloads of every direct link that can to a TCP lane; every rank of
    /// the communicator calls it at the same point (like a collective). Returns, per direct
    /// peer, the lane's outcome: `Ok` or why the link stays on QUIC.
    ///
    /// With `tls` an error (this rank keeps QUIC, and why), the rank only tells its peers so,
    /// so that they do not wait for it.
    pub(crate) async fn attach_tcp_lanes(
        &self,
        tls: Result<&LaneTls, String>,
    ) -> Vec<(usize, Result<(), NotAttached>)> {
        // Once per cluster, when it forms: attempt 0, and the communicator's setup numbers
        // stay for the back ends an application attaches later.
        let tags = setup_tags("tcp lane", self.comm_id(), 0);
        let limit = self.config().connect_timeout;
        let listening = tls.and_then(|tls| self.lane_listener().map(|(l, port)| (tls.clone(), l, port)));
        let expected: Expected = Arc::default();
        let one_connection = self.lane_mode() == LaneMode::Runtime;
        let sealing = self.config().lane_sealing();
        let mut incoming = HashMap::new();
        // Peers without a direct link have none to this rank either: nothing to say to them.
        let peers = (0..self.world_size()).filter(|r| *r != self.rank() && self.bulk_transport(*r).is_some());
        let offers: Vec<(usize, Result<Vec<u8>, String>)> = peers
            .map(|rank| {
                let offer = match (&listening, self.attached_bulk(rank)) {
                    (_, Some(other)) => Err(format!("the link to rank {rank} already has a {other} channel")),
                    (Err(reason), None) => Err(reason.clone()),
                    (Ok((_, _, port)), None) => {
                        let token: [u8; TOKEN_LEN] = rand::random();
                        let (tx, rx) = oneshot::channel();
                        crate::sync::lock(&expected).insert(token, (self.comm.members[rank] as u32, tx));
                        incoming.insert(rank, rx);
                        Ok(LaneOffer { port: *port, token, one_connection, sealing }.encode())
                    }
                };
                (rank, offer)
            })
            .collect();
        let tls = listening.ok().map(|(tls, listener, _)| {
            let accepting = AbortOnDrop(tokio::spawn(accept_lanes(listener, tls.clone(), expected, limit)));
            (tls, accepting)
        });
        let setup = LaneSetup { comm: self.clone(), tls, limit, incoming: Mutex::new(incoming) };
        let outcomes = negotiate(self, Arc::new(setup), tags, offers, limit).await;
        for (peer, outcome) in &outcomes {
            match outcome {
                Err(reason @ NotAttached::Failed(_)) => {
                    tracing::warn!(rank = self.rank(), peer, %reason, "collective payloads to this peer stay on QUIC");
                }
                Err(reason) => tracing::debug!(rank = self.rank(), peer, %reason, "no tcp lane"),
                Ok(()) => {}
            }
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

    /// The address this rank's QUIC link to `peer` reaches it at.
    fn peer_addr(&self, peer: usize) -> Option<SocketAddr> {
        let world = *self.comm.members.get(peer)?;
        Some(self.inner.links.get(world)?.remote_addr())
    }

    /// Who does this rank's lane I/O. Where every core of the host runs a rank, threads of the
    /// lane's own would wait for a core a rank spins on, so the rank's runtime does it. With
    /// cores to spare the runtime still does for small groups (a thread woken per message
    /// costs them more than it saves), and threads take the large ones.
    fn lane_mode(&self) -> LaneMode {
        let ranks_here = self.layout().map_or(1, |l| l.members(l.host_of(self.rank())).len());
        match self.config().lane_threads {
            Some(true) => LaneMode::Threads,
            Some(false) => LaneMode::Runtime,
            None if crate::affinity::helper_cpus() > ranks_here => LaneMode::RuntimeLargeOnThread,
            None => LaneMode::Runtime,
        }
    }

    fn start_tcp_lane(&self, peer: usize, conns: Connected) -> Result<(), String> {
        let inbound = self.bulk_inbound(peer).ok_or_else(|| format!("rank {peer} is not a peer"))?;
        let cfg = self.config();
        let limits = ReadLimits {
            max_group: cfg.max_message_bytes.saturating_add(GROUP_OVERHEAD),
            // An operation waiting for the group fails at its own timeout anyway.
            group_deadline: cfg.op_timeout,
        };
        let mode = self.lane_mode();
        let threads = mode == LaneMode::Threads;
        let min_bytes = cfg.bulk_min_bytes.unwrap_or(if threads { MIN_BYTES_THREADS } else { MIN_BYTES_ON_RUNTIME });
        let congestion = conns.set_congestion(&cfg.lane_congestion);
        tracing::debug!(rank = self.rank(), peer, ?mode, min_bytes, congestion, "tcp lane");
        let io = LaneIo {
            encrypt: cfg.bulk_encryption.then(|| LaneAead::new(cfg.lane_cipher, cfg.lane_aes)),
            on_runtime: !threads,
            large_on_threads: mode == LaneMode::RuntimeLargeOnThread,
        };
        let lane = TcpLane::start(peer, conns, inbound, limits, min_bytes, io)
            .map_err(|e| format!("cannot start the lane's threads: {e}"))?;
        self.attach_bulk(peer, Arc::new(lane)).map_err(|e| e.to_string())
    }
}

/// Who does a rank's lane I/O ([`NexarConfig::lane_threads`](crate::NexarConfig::lane_threads)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LaneMode {
    /// Threads of the lane's own read and write; small messages stay on QUIC.
    Threads,
    /// The rank's runtime reads, and writes while nothing is queued (a writer thread takes
    /// what the socket does not). The only mode whose links have one connection.
    Runtime,
    /// As [`LaneMode::Runtime`] for small groups; large ones go through threads (the writer
    /// thread writes them, a thread of the lane reads them: `transport/tcp_lane/large_reads.rs`).
    /// One connection per direction: on a 16-core host, np 2, a 16 MiB allreduce ran at
    /// 2.8 GB/s so, 2.1 on one connection for both ways.
    RuntimeLargeOnThread,
}

/// Whether the rank of world rank `me` dials its link to `peer` where the link has one
/// connection (the other answers): the lower world rank.
fn dials(me: usize, peer: usize) -> bool {
    me < peer
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
