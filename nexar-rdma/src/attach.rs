//! Bringing RDMA up on every link of a communicator: the two rounds of the queue-pair
//! exchange with each peer, then the engine and nexar's bulk hook for each link that
//! connected.

use std::sync::{Arc, Once};

use nexar::NexarClient;
use tokio::sync::mpsc;

use crate::setup::{Decision, OFFER_TAG as TAG_OFFER, OUTCOME_TAG as TAG_OUTCOME, QpOffer, SetupMsg, decide};
use crate::wire::Wire;
use crate::{Fabric, RdmaConfig, RdmaError, emulated, engine, verbs};

/// Room in a received group for the frames around the largest payload.
const GROUP_OVERHEAD: usize = 256 << 10;

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
            Endpoint::Verbs(e) => Box::new(e.connect(remote)?),
            Endpoint::Emulated(e) => Box::new(e.connect(remote)?),
        })
    }
}

fn open(cfg: &RdmaConfig) -> Result<(Endpoint, QpOffer), RdmaError> {
    match cfg.fabric {
        Fabric::Verbs => verbs::open(cfg.device.as_deref(), cfg.gid_index, cfg.slots, cfg.slot_size)
            .map(|(e, o)| (Endpoint::Verbs(e), o)),
        Fabric::Emulated => {
            let (e, o) = emulated::open(cfg.slots, cfg.slot_size);
            Ok((Endpoint::Emulated(e), o))
        }
    }
}

/// Moves the collective payloads of every link of `comm` that can to RDMA; the others stay
/// on QUIC. Every rank of the communicator calls it (like a collective). Fails only when
/// nexar itself fails (a peer dies, a setup message cannot be sent); everything RDMA-specific
/// ends in [`LinkTransport::Quic`] with the reason.
///
/// ```no_run
/// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar_rdma::RdmaError> {
/// let report = nexar_rdma::attach(&comm, &nexar_rdma::RdmaConfig::from_env()?).await?;
/// tracing::info!(rdma = report.rdma_links(), "links on RDMA");
/// # Ok(()) }
/// ```
pub async fn attach(comm: &NexarClient, cfg: &RdmaConfig) -> Result<AttachReport, RdmaError> {
    cfg.validate()?;
    let me = comm.rank();
    let peers: Vec<usize> = (0..comm.world_size()).filter(|p| *p != me).collect();

    // Round one: an offer (or a refusal) to every peer, then theirs.
    let mut endpoints = Vec::with_capacity(peers.len());
    let mut ours = Vec::with_capacity(peers.len());
    let mut no_device: Option<String> = None;
    for peer in &peers {
        let opened = match (&no_device, comm.bulk_transport(*peer)) {
            (_, None) => Err(format!("no direct link to rank {peer} (sparse topology)")),
            (_, Some(other)) if other != "quic" => Err(format!("the link to rank {peer} already uses {other}")),
            (Some(reason), _) => Err(reason.clone()),
            (None, _) => open(cfg).map_err(|e| {
                if matches!(e, RdmaError::NoDevice { .. }) {
                    no_device = Some(e.to_string());
                }
                e.to_string()
            }),
        };
        match opened {
            Ok((endpoint, offer)) => {
                endpoints.push(Some(endpoint));
                ours.push(SetupMsg::Offer(offer));
            }
            Err(reason) => {
                endpoints.push(None);
                ours.push(SetupMsg::Decline { reason });
            }
        }
    }
    if let Some(reason) = &no_device {
        NO_DEVICE_LOGGED.call_once(|| tracing::info!(rank = me, %reason, "collective payloads stay on QUIC"));
    }
    for (peer, msg) in peers.iter().zip(&ours) {
        comm.send_setup(*peer, TAG_OFFER, msg.encode()).await?;
    }
    let mut decisions = Vec::with_capacity(peers.len());
    for (peer, msg) in peers.iter().zip(&ours) {
        let bytes = comm.recv_setup(*peer, TAG_OFFER).await?;
        decisions.push(match SetupMsg::decode(&bytes) {
            Ok(theirs) => decide(msg, &theirs, *peer),
            Err(what) => Decision::Fallback(RdmaError::Setup { peer: *peer, what }.to_string()),
        });
    }

    // Round two: connect where both offered, tell the peer how it went, hear how it went there.
    let mut wires: Vec<Option<Box<dyn Wire>>> = Vec::with_capacity(peers.len());
    let mut outcomes = Vec::with_capacity(peers.len());
    for ((peer, decision), endpoint) in peers.iter().zip(&decisions).zip(endpoints) {
        let (wire, outcome) = match (decision, endpoint) {
            (Decision::Connect(remote), Some(endpoint)) => match endpoint.connect(remote) {
                Ok(wire) => (Some(wire), SetupMsg::Ready),
                Err(e) => (None, SetupMsg::Failed { reason: e.to_string() }),
            },
            (Decision::Fallback(reason), _) => (None, SetupMsg::Failed { reason: reason.clone() }),
            (Decision::Connect(_), None) => (None, SetupMsg::Failed { reason: "no queue pair here".into() }),
        };
        comm.send_setup(*peer, TAG_OUTCOME, outcome.encode()).await?;
        wires.push(wire);
        outcomes.push(outcome);
    }
    let mut links = Vec::with_capacity(peers.len());
    for ((peer, wire), outcome) in peers.iter().zip(wires).zip(outcomes) {
        let theirs = SetupMsg::decode(&comm.recv_setup(*peer, TAG_OUTCOME).await?);
        let transport = match (outcome, theirs, wire) {
            (SetupMsg::Ready, Ok(SetupMsg::Ready), Some(wire)) => start_link(comm, *peer, wire)?,
            (SetupMsg::Failed { reason }, _, _) => LinkTransport::Quic { reason },
            (_, Ok(SetupMsg::Failed { reason }), _) => LinkTransport::Quic { reason: format!("rank {peer}: {reason}") },
            (_, Ok(other), _) => {
                LinkTransport::Quic { reason: format!("rank {peer} answered round two with {other:?}") }
            }
            (_, Err(what), _) => LinkTransport::Quic { reason: RdmaError::Setup { peer: *peer, what }.to_string() },
        };
        tracing::debug!(rank = me, peer, ?transport, "link transport");
        links.push((*peer, transport));
    }
    Ok(AttachReport { links })
}

/// Starts the engine of a connected link and hands the link's raw lane to it.
fn start_link(comm: &NexarClient, peer: usize, wire: Box<dyn Wire>) -> Result<LinkTransport, RdmaError> {
    let inbound = comm.bulk_inbound(peer).ok_or_else(|| RdmaError::Link { peer, what: "not a peer".into() })?;
    let (delivered, mut groups) = mpsc::unbounded_channel();
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
    comm.attach_bulk(peer, Arc::new(channel))?;
    Ok(LinkTransport::Rdma)
}
