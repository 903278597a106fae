//! Bringing RDMA up on every link of a communicator, through nexar's negotiation driver
//! ([`nexar::backend::negotiate`]): each rank offers a queue pair per link, connects it to the
//! peer's and starts the engine, and the link attaches where both sides did.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Once};
use std::time::Instant;

use nexar::NexarClient;
use nexar::backend::{Connecting, LinkSetup, negotiate, setup_tags};
use tokio::sync::mpsc;

use crate::engine::{self, RdmaChannel};
use crate::setup::{QpOffer, decide};
use crate::wire::Wire;
use crate::{Fabric, RdmaConfig, RdmaError, emulated, verbs};

/// Room in a received group for the frames around the largest payload.
const GROUP_OVERHEAD: usize = 256 << 10;
/// Finished groups an engine may hand over before it stops returning credits.
const DELIVERY_QUEUE: usize = 4;

static NO_DEVICE_LOGGED: Once = Once::new();

/// What carries one link's collective payloads after [`attach`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkTransport {
    /// RDMA writes.
    Rdma,
    /// QUIC, for this reason (no device here or there, the queue pairs did not connect, ...).
    Quic {
        /// Why not RDMA.
        reason: String,
    },
}

/// The outcome of [`attach`] on one rank.
///
/// ```
/// use nexar_rdma::{AttachReport, LinkTransport};
/// let report = AttachReport { links: vec![(1, LinkTransport::Rdma)] };
/// assert_eq!(report.rdma_links(), 1);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachReport {
    /// `(peer rank, transport)` for every other rank of the communicator.
    pub links: Vec<(usize, LinkTransport)>,
}

impl AttachReport {
    /// Links that run over RDMA.
    pub fn rdma_links(&self) -> usize {
        self.links.iter().filter(|(_, t)| *t == LinkTransport::Rdma).count()
    }
}

/// A queue pair made for one peer, before it connects.
enum Endpoint {
    Verbs(verbs::Endpoint),
    Emulated(emulated::Endpoint),
}

impl Endpoint {
    fn connect(self, remote: &QpOffer) -> Result<Box<dyn Wire>, RdmaError> {
        Ok(match self {
            #[cfg(feature = "verbs")]
            Endpoint::Verbs(e) => Box::new(e.connect(remote)?),
            #[cfg(not(feature = "verbs"))]
            Endpoint::Verbs(never) => match never {},
            Endpoint::Emulated(e) => Box::new(e.connect(remote)?),
        })
    }
}

fn open(cfg: &RdmaConfig) -> Result<(Endpoint, QpOffer), RdmaError> {
    Ok(match cfg.fabric {
        Fabric::Verbs => verbs::open(cfg.device.as_deref(), cfg.gid_index, cfg.slots, cfg.slot_size)
            .map(|(e, o)| (Endpoint::Verbs(e), o))?,
        Fabric::Emulated => {
            let (e, o) = emulated::open(cfg.slots, cfg.slot_size);
            (Endpoint::Emulated(e), o)
        }
    })
}

/// RDMA's part in the negotiation: a queue pair per peer, connected to the peer's offer.
struct RdmaSetup {
    comm: NexarClient,
    /// The queue pair made for each peer, and what it offered.
    endpoints: Mutex<HashMap<usize, (Endpoint, QpOffer)>>,
}

impl LinkSetup for RdmaSetup {
    type Connected = RdmaChannel;

    fn name(&self) -> &'static str {
        "rdma"
    }

    fn connect(self: Arc<Self>, peer: usize, _ours: Vec<u8>, theirs: Vec<u8>, _by: Instant) -> Connecting<RdmaChannel> {
        Box::pin(async move {
            let remote = QpOffer::decode(&theirs).map_err(|what| RdmaError::Setup { peer, what }.to_string())?;
            let made = self.endpoints.lock().unwrap_or_else(|p| p.into_inner()).remove(&peer);
            let (endpoint, mine) = made.ok_or("no queue pair here")?;
            let remote = decide(&mine, &remote, peer)?;
            endpoint.connect(&remote).and_then(|wire| start_engine(&self.comm, peer, wire)).map_err(|e| e.to_string())
        })
    }

    fn start(&self, peer: usize, channel: RdmaChannel) -> Result<(), String> {
        // The engine stops with its channel; should the peer have attached, its writes then
        // fail and it falls back too.
        self.comm.attach_bulk(peer, Arc::new(channel)).map_err(|e| e.to_string())
    }
}

/// Moves the collective payloads of every link of `comm` that can to RDMA; the others stay
/// on QUIC. Every rank of the communicator calls it (like a collective). Only an invalid
/// configuration is an error; everything else, a peer that dies or does not answer in time
/// included, ends in [`LinkTransport::Quic`] with the reason for that link.
///
/// ```no_run
/// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar_rdma::RdmaError> {
/// let report = nexar_rdma::attach(&comm, &nexar_rdma::RdmaConfig::from_env()?).await?;
/// tracing::info!(rdma = report.rdma_links(), "links on RDMA");
/// # Ok(()) }
/// ```
pub async fn attach(comm: &NexarClient, cfg: &RdmaConfig) -> Result<AttachReport, RdmaError> {
    let me = comm.rank();
    // Counted before anything can fail, so every rank numbers its calls alike.
    let attempt = comm.next_setup_number();
    cfg.validate()?;
    let tags = setup_tags("rdma", comm.comm_id(), attempt);
    let (offers, endpoints) = open_all(comm, cfg);
    let setup = RdmaSetup { comm: comm.clone(), endpoints: Mutex::new(endpoints) };
    let limit = comm.config().connect_timeout;
    let mut links = Vec::new();
    for (peer, outcome) in negotiate(comm, Arc::new(setup), tags, offers, limit).await {
        let transport = match outcome {
            Ok(()) => LinkTransport::Rdma,
            Err(reason) => LinkTransport::Quic { reason: reason.to_string() },
        };
        tracing::debug!(rank = me, peer, ?transport, "link transport");
        links.push((peer, transport));
    }
    Ok(AttachReport { links })
}

/// The setting that would leave a link's bulk channel free for RDMA, given the channel it
/// already has: shared memory takes a same-host link whatever the bulk transport, so only
/// `NEXAR_SHM=off` frees it; a TCP lane (or any other) goes with `NEXAR_BULK_TRANSPORT=quic`.
fn what_frees_the_link(channel: &str) -> &'static str {
    match channel {
        "shm" => "ranks of one host talk over shared memory: start them with NEXAR_SHM=off to use RDMA between them",
        _ => "start the ranks with NEXAR_BULK_TRANSPORT=quic to use RDMA",
    }
}

/// Per peer, this rank's offer (or why there is none), and the queue pairs behind the offers.
type Opened = (Vec<(usize, Result<Vec<u8>, String>)>, HashMap<usize, (Endpoint, QpOffer)>);

/// A queue pair (or the reason there is none) for every peer.
fn open_all(comm: &NexarClient, cfg: &RdmaConfig) -> Opened {
    let me = comm.rank();
    let mut no_device: Option<String> = None;
    let (mut offers, mut endpoints) = (Vec::new(), HashMap::new());
    for rank in (0..comm.world_size()).filter(|p| *p != me) {
        let opened = match (&no_device, comm.bulk_transport(rank), comm.attached_bulk(rank)) {
            (_, None, _) => Err(format!("no direct link to rank {rank} (sparse topology)")),
            (_, _, Some(other)) => {
                Err(format!("the link to rank {rank} already had a {other} channel ({})", what_frees_the_link(other)))
            }
            (Some(reason), _, _) => Err(reason.clone()),
            (None, _, None) => open(cfg).map_err(|e| {
                if matches!(e, RdmaError::NoDevice { .. }) {
                    no_device = Some(e.to_string());
                }
                e.to_string()
            }),
        };
        offers.push((
            rank,
            opened.map(|(endpoint, offer)| {
                endpoints.insert(rank, (endpoint, offer));
                offer.encode()
            }),
        ));
    }
    if let Some(reason) = &no_device {
        NO_DEVICE_LOGGED.call_once(|| tracing::info!(rank = me, %reason, "collective payloads stay on QUIC"));
    }
    (offers, endpoints)
}

/// Starts the engine of a connected link, delivering what arrives to nexar.
fn start_engine(comm: &NexarClient, peer: usize, wire: Box<dyn Wire>) -> Result<RdmaChannel, RdmaError> {
    let inbound = comm.bulk_inbound(peer).ok_or_else(|| RdmaError::Link { peer, what: "not a peer".into() })?;
    let (delivered, mut groups) = mpsc::channel(DELIVERY_QUEUE);
    let max_group =
        usize::try_from(comm.config().max_message_bytes).unwrap_or(usize::MAX).saturating_add(GROUP_OVERHEAD);
    let channel = engine::start("rdma", peer, wire, max_group, delivered)
        .map_err(|e| RdmaError::Link { peer, what: format!("cannot start its engine thread: {e}") })?;
    tokio::spawn(async move {
        while let Some(group) = groups.recv().await {
            if let Err(e) = inbound.deliver(group).await {
                tracing::error!(peer, error = %e, "rank broke the protocol over RDMA; its RDMA link stops");
                return;
            }
        }
    });
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use super::what_frees_the_link;

    #[test]
    fn the_advice_names_the_setting_that_frees_the_link() {
        assert!(what_frees_the_link("shm").contains("NEXAR_SHM=off"));
        assert!(!what_frees_the_link("shm").contains("NEXAR_BULK_TRANSPORT"));
        assert!(what_frees_the_link("tcp-tls").contains("NEXAR_BULK_TRANSPORT=quic"));
    }
}
