//! Bringing RDMA up on every link of a communicator: the two rounds of the queue-pair
//! exchange with each peer, then the engine and nexar's bulk hook for each link that
//! connected.

use std::sync::{Arc, Once};

use nexar::NexarClient;
use tokio::sync::mpsc;

use crate::engine::{self, RdmaChannel};
use crate::setup::{Decision, QpOffer, SetupMsg, both_ready, decide, offer_tag, outcome_tag};
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
    let (endpoint, mut offer) = match cfg.fabric {
        Fabric::Verbs => verbs::open(cfg.device.as_deref(), cfg.gid_index, cfg.slots, cfg.slot_size)
            .map(|(e, o)| (Endpoint::Verbs(e), o))?,
        Fabric::Emulated => {
            let (e, o) = emulated::open(cfg.slots, cfg.slot_size);
            (Endpoint::Emulated(e), o)
        }
    };
    offer.nonce = rand::random();
    Ok((endpoint, offer))
}

/// One peer's state through the exchange.
struct Peer {
    rank: usize,
    ours: SetupMsg,
    endpoint: Option<Endpoint>,
    /// Set once something decided this link stays on QUIC.
    quic: Option<String>,
    decision: Option<Decision>,
    channel: Option<RdmaChannel>,
    outcome: Option<SetupMsg>,
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
    let (offer_tag, outcome_tag) = (offer_tag(comm.comm_id(), attempt), outcome_tag(comm.comm_id(), attempt));
    let mut peers = open_all(comm, cfg);

    // Round one: an offer (or a refusal) to every peer, then theirs.
    for p in &mut peers {
        if let Err(e) = comm.send_setup(p.rank, offer_tag, p.ours.encode()).await {
            p.quic = Some(e.to_string());
        }
    }
    for p in peers.iter_mut().filter(|p| p.quic.is_none()) {
        p.decision = Some(match comm.recv_setup(p.rank, offer_tag).await {
            Ok(bytes) => match SetupMsg::decode(&bytes) {
                Ok(theirs) => decide(&p.ours, &theirs, p.rank),
                Err(what) => Decision::Fallback(RdmaError::Setup { peer: p.rank, what }.to_string()),
            },
            Err(e) => Decision::Fallback(e.to_string()),
        });
    }

    // Round two: connect and start the engine where both offered, say how it went.
    for p in peers.iter_mut().filter(|p| p.quic.is_none()) {
        let outcome = match (p.decision.take(), p.endpoint.take(), &p.ours) {
            (Some(Decision::Connect(remote)), Some(endpoint), SetupMsg::Offer(mine)) => {
                match endpoint.connect(&remote).and_then(|wire| start_engine(comm, p.rank, wire)) {
                    Ok(channel) => {
                        p.channel = Some(channel);
                        SetupMsg::Ready { mine: mine.nonce, seen: remote.nonce }
                    }
                    Err(e) => SetupMsg::Failed { reason: e.to_string() },
                }
            }
            (Some(Decision::Fallback(reason)), _, _) => SetupMsg::Failed { reason },
            _ => SetupMsg::Failed { reason: "no queue pair here".into() },
        };
        if let Err(e) = comm.send_setup(p.rank, outcome_tag, outcome.encode()).await {
            p.quic = Some(e.to_string());
        }
        p.outcome = Some(outcome);
    }
    let mut links = Vec::with_capacity(peers.len());
    for mut p in peers {
        let transport = match (p.quic.take(), p.outcome.take()) {
            (Some(reason), _) | (None, Some(SetupMsg::Failed { reason })) => LinkTransport::Quic { reason },
            (None, Some(ours)) => finish(comm, &mut p, &ours, outcome_tag).await,
            (None, None) => LinkTransport::Quic { reason: "no outcome".into() },
        };
        tracing::debug!(rank = me, peer = p.rank, ?transport, "link transport");
        links.push((p.rank, transport));
    }
    Ok(AttachReport { links })
}

/// A queue pair (or the reason there is none) for every peer.
fn open_all(comm: &NexarClient, cfg: &RdmaConfig) -> Vec<Peer> {
    let me = comm.rank();
    let mut no_device: Option<String> = None;
    let mut peers = Vec::new();
    for rank in (0..comm.world_size()).filter(|p| *p != me) {
        let opened = match (&no_device, comm.bulk_transport(rank), comm.attached_bulk(rank)) {
            (_, None, _) => Err(format!("no direct link to rank {rank} (sparse topology)")),
            (_, _, Some(other)) => Err(format!(
                "the link to rank {rank} already had a {other} channel (start the ranks with NEXAR_BULK_TRANSPORT=quic to use RDMA)"
            )),
            (Some(reason), _, _) => Err(reason.clone()),
            (None, _, None) => open(cfg).map_err(|e| {
                if matches!(e, RdmaError::NoDevice { .. }) {
                    no_device = Some(e.to_string());
                }
                e.to_string()
            }),
        };
        let (endpoint, ours) = match opened {
            Ok((endpoint, offer)) => (Some(endpoint), SetupMsg::Offer(offer)),
            Err(reason) => (None, SetupMsg::Decline { reason }),
        };
        peers.push(Peer { rank, ours, endpoint, quic: None, decision: None, channel: None, outcome: None });
    }
    if let Some(reason) = &no_device {
        NO_DEVICE_LOGGED.call_once(|| tracing::info!(rank = me, %reason, "collective payloads stay on QUIC"));
    }
    peers
}

/// Hears the peer's outcome and attaches when both sides are ready for each other.
async fn finish(comm: &NexarClient, p: &mut Peer, ours: &SetupMsg, outcome_tag: u64) -> LinkTransport {
    let peer = p.rank;
    let theirs = match comm.recv_setup(peer, outcome_tag).await {
        Ok(bytes) => SetupMsg::decode(&bytes),
        // The engine stops with its channel; should the peer have attached, its writes then
        // fail and it falls back too.
        Err(e) => return LinkTransport::Quic { reason: e.to_string() },
    };
    match theirs {
        Ok(theirs) if both_ready(ours, &theirs) => {
            let Some(channel) = p.channel.take() else {
                return LinkTransport::Quic { reason: "no engine here".into() };
            };
            match comm.attach_bulk(peer, Arc::new(channel)) {
                Ok(()) => LinkTransport::Rdma,
                Err(e) => LinkTransport::Quic { reason: e.to_string() },
            }
        }
        Ok(SetupMsg::Failed { reason }) => LinkTransport::Quic { reason: format!("rank {peer}: {reason}") },
        Ok(other) => LinkTransport::Quic { reason: format!("rank {peer} answered round two with {other:?}") },
        Err(what) => LinkTransport::Quic { reason: RdmaError::Setup { peer, what }.to_string() },
    }
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
