//! Bringing shared memory up on every direct link between ranks of one host, when the cluster
//! forms, through the negotiation driver (`negotiate.rs`): an offer (host identity, process id,
//! an abstract socket and a token), a connection from the lower world rank of each same-host
//! pair, the two ring segments passed over it, and only a link where both sides mapped both
//! rings moves its collective payloads to shared memory. Anything else leaves the link as it
//! was (the TCP lane is set up after this, for the links that remain).

use std::collections::HashMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::comm::backends::negotiate::{Connecting, LinkSetup, negotiate, setup_tags};
use crate::comm::client::NexarClient;
use crate::transport::shm::mapping::SharedMap;
use crate::transport::shm::ring::segment_len;
use crate::transport::shm::setup::{
    ShmOffer, TOKEN_LEN, check_peer, dial, host_identity, listen, read_hello, recv_ring, send_ring,
};
use crate::transport::shm::{ShmChannel, ShmLimits};

/// Data bytes of the ring each side writes to a peer of its host, by how many such peers it
/// has: 4 MiB for up to sixteen, then less, so that one rank's rings hold at most
/// [`RING_BUDGET`] however many ranks share the host (down to 64 KiB rings at 1,024 peers),
/// and never less than 64 KiB. A ring's pages are taken only as bytes first pass through them
/// (`transport::shm::mapping`), so rings of peers this rank never sends much to cost next to
/// nothing. Payloads of up to a quarter of a ring stay in it until they are copied where they
/// are wanted (`transport::shm::lease`); larger ones stream through it. 8 MiB rings moved 16
/// and 64 MiB allreduces faster still, but made 256 KiB ones twice as slow and 4 and 64 KiB
/// ones 10–30 % slower.
fn ring_bytes(same_host_peers: usize) -> usize {
    const MOST: usize = 4 << 20;
    const LEAST: usize = 64 << 10;
    let share = (RING_BUDGET / same_host_peers.max(1)).clamp(LEAST, MOST);
    // The largest power of two within the share.
    1 << (usize::BITS - 1 - share.leading_zeros())
}
/// The most bytes one rank's rings to the ranks of its host hold together (up to 1,024 such
/// ranks; beyond, each ring keeps its 64 KiB).
const RING_BUDGET: usize = 64 << 20;
/// Room in a received group for the frames around the largest payload.
const GROUP_OVERHEAD: u64 = 64 << 10;
/// How long a side spins on an empty or full ring before it sleeps, at most.
const MAX_SPIN: Duration = Duration::from_micros(50);

/// Connections this rank waits for, by the token it gave their dialler: the peer's world rank
/// and where the checked connection goes.
type Expected = Arc<Mutex<HashMap<[u8; TOKEN_LEN], (u32, oneshot::Sender<UnixStream>)>>>;

/// A link whose rings are swapped: the socket (the peer's death closes it), this side's ring
/// and the peer's.
type Swapped = (UnixStream, SharedMap, SharedMap);

/// Shared memory's part in the negotiation: check the host, connect, swap rings.
struct ShmSetup {
    comm: NexarClient,
    host: String,
    limit: Duration,
    /// The data bytes of each ring this rank writes.
    ring: usize,
    /// The connection each higher-ranked peer is to make to this rank, by peer.
    incoming: Mutex<HashMap<usize, oneshot::Receiver<UnixStream>>>,
    /// Accepts connections while the negotiation runs.
    _accepting: Option<AcceptOnDrop>,
}

impl LinkSetup for ShmSetup {
    type Connected = Swapped;

    fn name(&self) -> &'static str {
        "same-host"
    }

    fn connect(self: Arc<Self>, peer: usize, _ours: Vec<u8>, theirs: Vec<u8>, by: Instant) -> Connecting<Swapped> {
        Box::pin(async move {
            let theirs = ShmOffer::decode(&theirs)?;
            if theirs.host != self.host {
                return Err(format!("rank {peer} is on another host"));
            }
            // The lower world rank dials; both then pass their rings and check the other's.
            let (me, world, limit) = (self.comm.world_rank() as u32, self.comm.comm.members[peer] as u32, self.limit);
            let ring = self.ring;
            let swapped = if me < world {
                tokio::task::spawn_blocking(move || {
                    let sock = dial(&theirs.socket, &theirs.token, me, limit).map_err(|e| format!("dialling: {e}"))?;
                    check_peer(&sock, theirs.pid, peer).map_err(|e| e.to_string())?;
                    swap_rings(sock, peer, ring)
                })
                .await
            } else {
                let waiting = crate::sync::lock(&self.incoming).remove(&peer);
                let late = || format!("rank {peer} did not connect in time");
                let sock = match waiting {
                    Some(rx) => {
                        tokio::time::timeout_at(by.into(), rx).await.map_err(|_| late())?.map_err(|_| late())?
                    }
                    None => return Err("not expecting a connection".into()),
                };
                tokio::task::spawn_blocking(move || {
                    check_peer(&sock, theirs.pid, peer).map_err(|e| e.to_string())?;
                    swap_rings(sock, peer, ring)
                })
                .await
            };
            swapped.unwrap_or_else(|e| Err(e.to_string()))
        })
    }

    fn start(&self, peer: usize, (sock, ours, theirs): Swapped) -> Result<(), String> {
        self.comm.start_shm(peer, sock, ours, theirs)
    }
}

impl NexarClient {
    /// Moves the collective payloads of every direct link to a rank of this host into shared
    /// memory; every rank of the communicator calls it at the same point (like a collective).
    /// Returns the peers whose links moved.
    pub(crate) async fn attach_shared_memory(&self) -> Vec<usize> {
        let tags = setup_tags("same-host", self.comm_id(), 0);
        let limit = self.config().connect_timeout;
        let peers: Vec<usize> = (0..self.world_size())
            .filter(|r| *r != self.rank() && self.bulk_transport(*r).is_some() && self.attached_bulk(*r).is_none())
            .collect();
        let listening = if !self.config().shared_memory {
            Err("NEXAR_SHM=off".to_string())
        } else if self.config().chaos.is_some() {
            // A ring would carry the payloads past the faults, and the application would
            // test nothing.
            Err(crate::transport::chaos::KEEPS_QUIC.to_string())
        } else {
            listen().map_err(|e| format!("cannot listen on an abstract unix socket: {e}"))
        };
        let (host, pid) = (host_identity(self.config().host_id.as_deref()), std::process::id());
        let expected: Expected = Arc::default();
        let mut incoming = HashMap::new();
        let offers = peers
            .into_iter()
            .map(|rank| {
                let offer = listening.as_ref().map_err(Clone::clone).map(|(_, socket)| {
                    let token: [u8; TOKEN_LEN] = rand::random();
                    let (tx, rx) = oneshot::channel();
                    crate::sync::lock(&expected).insert(token, (self.comm.members[rank] as u32, tx));
                    incoming.insert(rank, rx);
                    ShmOffer { host: host.clone(), pid, socket: socket.clone(), token }.encode()
                });
                (rank, offer)
            })
            .collect();
        let accepting = listening.ok().map(|(listener, _)| AcceptOnDrop::start(listener, expected, limit));
        // Peers of this host, from the host table where it was learnt (else every peer may be).
        let same_host = match self.layout_ref() {
            Some(layout) => layout.members(layout.host_of(self.rank())).len() - 1,
            None => self.world_size() - 1,
        };
        let ring = ring_bytes(same_host);
        let setup =
            ShmSetup { comm: self.clone(), host, limit, ring, incoming: Mutex::new(incoming), _accepting: accepting };
        let mut up = Vec::new();
        for (peer, outcome) in negotiate(self, Arc::new(setup), tags, offers, limit).await {
            match outcome {
                Ok(()) => up.push(peer),
                Err(reason) => tracing::debug!(rank = self.rank(), peer, %reason, "no shared memory on this link"),
            }
        }
        up
    }

    fn start_shm(&self, peer: usize, sock: UnixStream, ours: SharedMap, theirs: SharedMap) -> Result<(), String> {
        let inbound = self.bulk_inbound(peer).ok_or_else(|| format!("rank {peer} is not a peer"))?;
        // Checked at setup; a spin that runs out looks whether this peer waits on its core.
        if let Ok(cred) = rustix::net::sockopt::socket_peercred(&sock) {
            self.inner.spin.add_same_host_peer(cred.pid.as_raw_nonzero().get() as u32, true);
        }
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
fn swap_rings(sock: UnixStream, peer: usize, ring: usize) -> Result<(UnixStream, SharedMap, SharedMap), String> {
    let ours = SharedMap::create("nexar-shm", segment_len(ring)).map_err(|e| format!("creating the ring: {e}"))?;
    send_ring(&sock, &ours, ring).map_err(|e| format!("passing the ring: {e}"))?;
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

#[cfg(test)]
mod tests {
    use super::ring_bytes;

    #[test]
    fn rings_shrink_as_a_host_holds_more_ranks_within_64_mib_a_rank() {
        let cases = [(0, 4 << 20), (1, 4 << 20), (7, 4 << 20), (16, 4 << 20), (17, 2 << 20), (32, 2 << 20)];
        let more = [(33, 1 << 20), (63, 1 << 20), (64, 1 << 20), (127, 512 << 10), (1000, 64 << 10), (1024, 64 << 10)];
        for (peers, bytes) in cases.into_iter().chain(more) {
            assert_eq!(ring_bytes(peers), bytes, "{peers} peers");
            assert!(ring_bytes(peers).is_power_of_two());
            assert!(peers * ring_bytes(peers) <= super::RING_BUDGET, "{peers} peers");
        }
        // Past 1,024 peers a ring keeps its least size.
        assert_eq!(ring_bytes(5000), 64 << 10);
    }
}
