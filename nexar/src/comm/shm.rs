//! Bringing shared memory up on every direct link between ranks of one host, when the cluster
//! forms: an offer over QUIC (host identity, process id, an abstract socket and a token), a
//! connection from the lower world rank of each same-host pair, the two ring segments passed
//! over it, then both sides say whether theirs came up, and only a link where both did moves
//! its collective payloads to shared memory. Anything else leaves the link as it was (the TCP
//! lane is set up after this, for the links that remain).

use std::collections::HashMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::client::NexarClient;
use crate::transport::shm::mapping::SharedMap;
use crate::transport::shm::ring::segment_len;
use crate::transport::shm::setup::{
    ShmMsg, TOKEN_LEN, check_peer, dial, host_identity, listen, read_hello, recv_ring, send_ring, shm_tag,
};
use crate::transport::shm::{ShmChannel, ShmLimits};

/// Data bytes of the ring each side writes, per link.
const RING_BYTES: usize = 4 << 20;
/// Room in a received group for the frames around the largest payload.
const GROUP_OVERHEAD: u64 = 64 << 10;
/// How long a side spins on an empty or full ring before it sleeps, at most.
const MAX_SPIN: Duration = Duration::from_micros(50);

/// Connections this rank waits for, by the token it gave their dialler: the peer's world rank
/// and where the checked connection goes.
type Expected = Arc<Mutex<HashMap<[u8; TOKEN_LEN], (u32, oneshot::Sender<UnixStream>)>>>;

/// This side of one link's exchange.
struct Peer {
    rank: usize,
    world: u32,
    incoming: Option<oneshot::Receiver<UnixStream>>,
}

impl NexarClient {
    /// Moves the collective payloads of every direct link to a rank of this host into shared
    /// memory; every rank of the communicator calls it at the same point (like a collective).
    /// Returns the peers whose links moved.
    pub(crate) async fn attach_shared_memory(&self) -> Vec<usize> {
        let offer_tag = shm_tag(0);
        let limit = self.config().connect_timeout;
        let peers: Vec<usize> = (0..self.world_size())
            .filter(|r| *r != self.rank() && self.bulk_transport(*r).is_some() && self.attached_bulk(*r).is_none())
            .collect();
        let listening = if self.config().shared_memory {
            listen().map_err(|e| format!("cannot listen on an abstract unix socket: {e}"))
        } else {
            Err("NEXAR_SHM=off".to_string())
        };
        let (listener, socket) = match listening {
            Ok((listener, socket)) => (listener, socket),
            Err(reason) => {
                for peer in peers {
                    let _ = self.send_setup(peer, offer_tag, ShmMsg::Decline { reason: reason.clone() }.encode()).await;
                }
                return Vec::new();
            }
        };
        let (host, pid) = (host_identity(self.config().host_id.as_deref()), std::process::id());
        let expected: Expected = Arc::default();
        let mut mine = Vec::new();
        for rank in peers {
            let token: [u8; TOKEN_LEN] = rand::random();
            let world = self.comm.members[rank] as u32;
            let (tx, rx) = oneshot::channel();
            crate::sync::lock(&expected).insert(token, (world, tx));
            let offer = ShmMsg::Offer { host: host.clone(), pid, socket: socket.clone(), token };
            if self.send_setup(rank, offer_tag, offer.encode()).await.is_ok() {
                mine.push(Peer { rank, world, incoming: Some(rx) });
            }
        }
        let accepting = AcceptOnDrop::start(listener, expected.clone(), limit);
        let start = Instant::now();
        let mut exchanges = tokio::task::JoinSet::new();
        for p in mine {
            let (me, host) = (self.clone(), host.clone());
            exchanges.spawn(async move { me.shm_exchange(p, &host, start, limit).await });
        }
        let mut up = Vec::new();
        while let Some(done) = exchanges.join_next().await {
            match done {
                Ok((rank, Ok(()))) => up.push(rank),
                Ok((rank, Err(reason))) => {
                    tracing::debug!(rank = self.rank(), peer = rank, %reason, "no shared memory on this link")
                }
                Err(e) => tracing::warn!(rank = self.rank(), error = %e, "a shared-memory exchange failed"),
            }
        }
        drop(accepting);
        up.sort_unstable();
        up
    }

    /// One peer's side of the exchange after this rank's offer.
    async fn shm_exchange(
        &self,
        mut p: Peer,
        host: &str,
        start: Instant,
        limit: Duration,
    ) -> (usize, Result<(), String>) {
        let outcome_tag = shm_tag(1);
        let theirs = match self.shm_setup(p.rank, shm_tag(0), start + limit).await {
            Ok(msg) => msg,
            Err(e) => return (p.rank, Err(e)),
        };
        let (their_pid, their_socket, their_token) = match theirs {
            ShmMsg::Offer { host: their_host, .. } if their_host != host => {
                return (p.rank, Err(format!("rank {} is on another host", p.rank)));
            }
            ShmMsg::Offer { pid, socket, token, .. } => (pid, socket, token),
            ShmMsg::Decline { reason } => return (p.rank, Err(format!("rank {} declined: {reason}", p.rank))),
            other => return (p.rank, Err(format!("rank {} answered the offer with {other:?}", p.rank))),
        };
        // The lower world rank dials; both then pass their rings and check the other's.
        let me = self.world_rank() as u32;
        let connected: Result<(UnixStream, SharedMap, SharedMap), String> = if me < p.world {
            let rank = p.rank;
            tokio::task::spawn_blocking(move || {
                let sock = dial(&their_socket, &their_token, me, limit).map_err(|e| format!("dialling: {e}"))?;
                check_peer(&sock, their_pid, rank).map_err(|e| e.to_string())?;
                swap_rings(sock, rank)
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()))
        } else {
            let incoming = p.incoming.take();
            let rank = p.rank;
            match incoming.map(|rx| tokio::time::timeout_at((start + 2 * limit).into(), rx)) {
                Some(wait) => match wait.await {
                    Ok(Ok(sock)) => tokio::task::spawn_blocking(move || {
                        check_peer(&sock, their_pid, rank).map_err(|e| e.to_string())?;
                        swap_rings(sock, rank)
                    })
                    .await
                    .unwrap_or_else(|e| Err(e.to_string())),
                    _ => Err(format!("rank {} did not connect in time", p.rank)),
                },
                None => Err("not expecting a connection".into()),
            }
        };
        let ours = match &connected {
            Ok(_) => ShmMsg::Ready,
            Err(reason) => ShmMsg::Failed { reason: reason.clone() },
        };
        let _ = self.send_setup(p.rank, outcome_tag, ours.encode()).await;
        let (sock, mine, theirs) = match connected {
            Ok(c) => c,
            Err(e) => return (p.rank, Err(e)),
        };
        let outcome = match self.shm_setup(p.rank, outcome_tag, start + 3 * limit).await {
            Ok(ShmMsg::Ready) => self.start_shm(p.rank, sock, mine, theirs),
            Ok(ShmMsg::Failed { reason }) => Err(format!("rank {}: {reason}", p.rank)),
            Ok(other) => Err(format!("rank {} answered round two with {other:?}", p.rank)),
            Err(e) => Err(e),
        };
        (p.rank, outcome)
    }

    /// The peer's next same-host setup message with `tag`, by `deadline`.
    async fn shm_setup(&self, peer: usize, tag: u64, deadline: Instant) -> Result<ShmMsg, String> {
        match tokio::time::timeout_at(deadline.into(), self.recv_setup(peer, tag)).await {
            Ok(Ok(bytes)) => ShmMsg::decode(&bytes).map_err(|e| format!("rank {peer}: {e}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("rank {peer} sent no same-host setup in time")),
        }
    }

    fn start_shm(&self, peer: usize, sock: UnixStream, ours: SharedMap, theirs: SharedMap) -> Result<(), String> {
        let inbound = self.bulk_inbound(peer).ok_or_else(|| format!("rank {peer} is not a peer"))?;
        let cfg = self.config();
        let limits = ShmLimits {
            max_group: cfg.max_message_bytes.saturating_add(GROUP_OVERHEAD),
            group_deadline: cfg.op_timeout,
            spin: self.inner.spin.max().min(MAX_SPIN),
        };
        let channel = ShmChannel::start(peer, sock, ours, theirs, inbound, limits)
            .map_err(|e| format!("cannot start the link's threads: {e}"))?;
        self.attach_bulk(peer, Arc::new(channel)).map_err(|e| e.to_string())
    }
}

/// Creates this side's ring, passes it, and maps the peer's: `(socket, ours, theirs)`.
fn swap_rings(sock: UnixStream, peer: usize) -> Result<(UnixStream, SharedMap, SharedMap), String> {
    let ours =
        SharedMap::create("nexar-shm", segment_len(RING_BYTES)).map_err(|e| format!("creating the ring: {e}"))?;
    send_ring(&sock, &ours, RING_BYTES).map_err(|e| format!("passing the ring: {e}"))?;
    let (theirs, _) = recv_ring(&sock, peer).map_err(|e| format!("receiving the ring: {e}"))?;
    Ok((sock, ours, theirs))
}

/// Accepts same-host connections until dropped: each must present a token this rank gave out
/// (a connection with any other is closed), within `limit`.
struct AcceptOnDrop(tokio::task::JoinHandle<()>);

impl AcceptOnDrop {
    fn start(listener: UnixListener, expected: Expected, limit: Duration) -> AcceptOnDrop {
        let accepting = async move {
            let Ok(listener) =
                listener.set_nonblocking(true).and_then(|()| tokio::net::UnixListener::from_std(listener))
            else {
                return;
            };
            while let Ok((sock, _)) = listener.accept().await {
                let expected = expected.clone();
                tokio::task::spawn_blocking(move || {
                    let Ok(mut sock) = sock.into_std().and_then(|s| s.set_nonblocking(false).map(|()| s)) else {
                        return;
                    };
                    let Ok((token, world)) = read_hello(&mut sock, limit) else { return };
                    let waiting = crate::sync::lock(&expected).remove(&token);
                    match waiting {
                        Some((expected_world, tx)) if expected_world == world => {
                            let _ = tx.send(sock);
                        }
                        Some((expected_world, _)) => {
                            tracing::warn!(
                                world,
                                expected_world,
                                "a same-host connection claimed another rank's token"
                            );
                        }
                        None => tracing::warn!(world, "a same-host connection presented an unknown token"),
                    }
                });
            }
        };
        AcceptOnDrop(tokio::spawn(accepting))
    }
}

impl Drop for AcceptOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
