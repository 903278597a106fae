//! The lanes of a link: the independent receive queues of a rank, and where each lane's
//! messages go (a queue, or straight into a mailbox).

use tokio::sync::mpsc;

use super::byte_budget::ByteBudget;
pub use super::incoming::Incoming;
use super::liveness::Liveness;
use super::relay_hook::RelayHook;
pub use crate::proto::lane::Lane;
use crate::proto::message::PeerMsg;
use crate::transport::inbox::{Admission, Inbox};

/// The sending halves of a rank's lanes, shared by the routers of all its links.
#[derive(Clone)]
pub struct LaneSenders {
    senders: [mpsc::Sender<Incoming>; Lane::COUNT],
    direct: [Option<DirectSink>; Lane::COUNT],
    liveness: Option<std::sync::Arc<Liveness>>,
    relay: Option<RelayHook>,
    /// The bytes of RPC requests and answers the rank holds at once.
    rpc_budget: Option<ByteBudget>,
}

impl std::fmt::Debug for LaneSenders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneSenders").finish_non_exhaustive()
    }
}

/// The store a lane's messages go straight into from the router, without a queue and a task
/// hop in between (the latency path of point-to-point and collectives).
pub(crate) type DirectSink = std::sync::Arc<dyn Inbox>;

/// The receiving halves of a rank's lanes, taken by the layers that consume them.
#[derive(Debug)]
pub struct LaneReceivers {
    /// Incoming RPC requests.
    pub rpc_requests: mpsc::Receiver<Incoming>,
    /// Responses to our RPC calls.
    pub rpc_responses: mpsc::Receiver<Incoming>,
    /// Control traffic.
    pub control: mpsc::Receiver<Incoming>,
}

/// Creates a rank's lanes, each holding up to `capacity` messages. The data and raw lanes
/// have no queue to read: their messages go straight into the matching stores
/// (`LaneSenders::with_direct`), and without one they are refused as on a closed lane.
pub fn lanes(capacity: usize) -> (LaneSenders, LaneReceivers) {
    let (a, ra) = mpsc::channel(capacity);
    let (b, rb) = mpsc::channel(capacity);
    let (c, rc) = mpsc::channel(capacity);
    let (d, _) = mpsc::channel(capacity);
    let (e, _) = mpsc::channel(capacity);
    (
        LaneSenders {
            senders: [a, b, c, d, e],
            direct: Default::default(),
            liveness: None,
            relay: None,
            rpc_budget: None,
        },
        LaneReceivers { rpc_requests: ra, rpc_responses: rb, control: rc },
    )
}

impl LaneSenders {
    /// When the `len`-byte payload of a message announced by `from` may be read, if its lane
    /// delivers straight into a store (point-to-point and collective messages): only once
    /// that store admits it.
    pub(crate) fn admission(&self, msg: &PeerMsg, from: u32, len: u64) -> Option<Admission<'_>> {
        self.direct[Lane::of(msg) as usize].as_ref()?.admit(msg, from, len)
    }

    /// The store collective messages go to, when they bypass the raw lane's queue.
    pub(crate) fn coll_inbox(&self) -> Option<DirectSink> {
        self.direct[Lane::Raw as usize].clone()
    }

    /// The store typed point-to-point messages go to, when they bypass the data lane's queue.
    pub(crate) fn p2p_inbox(&self) -> Option<DirectSink> {
        self.direct[Lane::Data as usize].clone()
    }

    /// Sends `lane`'s messages straight into `sink` instead of its queue.
    pub(crate) fn with_direct(mut self, lane: Lane, sink: DirectSink) -> Self {
        self.direct[lane as usize] = Some(sink);
        self
    }

    /// Records every delivered message in `liveness` as a sign of life from its sender.
    pub(crate) fn with_liveness(mut self, liveness: std::sync::Arc<Liveness>) -> Self {
        self.liveness = Some(liveness);
        self
    }

    /// The byte budget a message holds while this rank keeps it: RPC requests and answers
    /// share one, relay envelopes another.
    pub(super) fn byte_budget(&self, msg: &PeerMsg) -> Option<&ByteBudget> {
        match msg {
            PeerMsg::RpcRequest { .. } | PeerMsg::RpcResponse { .. } => self.rpc_budget.as_ref(),
            PeerMsg::Relay { .. } => self.relay.as_ref().map(|hook| &hook.budget),
            _ => None,
        }
    }

    /// Reads RPC requests and answers only while the rank holds fewer than `limit` bytes of
    /// them, and refuses any single one larger.
    pub(crate) fn with_rpc_budget(mut self, limit: u64) -> Self {
        self.rpc_budget = Some(ByteBudget::new(limit));
        self
    }

    /// Unpacks relayed messages addressed to this rank and forwards the others.
    pub(crate) fn with_relay(mut self, hook: RelayHook) -> Self {
        self.relay = Some(hook);
        self
    }

    /// Delivers a collective or point-to-point message straight into its lane's store if the
    /// store takes it at once ([`Inbox::deliver_now`](super::inbox::Inbox::deliver_now));
    /// otherwise gives it back (`Some`) for [`deliver`](Self::deliver).
    pub(crate) fn deliver_now(&self, incoming: Incoming) -> Option<Incoming> {
        let lane = Lane::of(&incoming.msg);
        let Some(sink) = &self.direct[lane as usize] else { return Some(incoming) };
        if !matches!(incoming.msg, PeerMsg::Coll { .. } | PeerMsg::P2p { .. } | PeerMsg::P2pSegment { .. }) {
            return Some(incoming);
        }
        let from = incoming.from;
        if let Some(back) = sink.deliver_now(incoming) {
            return Some(back);
        }
        self.heard(from);
        None
    }

    /// Whether `msg`'s lane delivers straight into a store (the one its receive takes it
    /// from).
    pub(crate) fn delivers_directly(&self, msg: &PeerMsg) -> bool {
        self.direct[Lane::of(msg) as usize].is_some()
    }

    /// Records a sign of life from `from`, as every delivery does.
    pub(crate) fn heard(&self, from: u32) {
        if let Some(liveness) = &self.liveness {
            liveness.heard(from);
        }
    }

    /// Queues a message on its lane, waiting while the lane is full. Fails only when the
    /// lane's consumer is gone (the rank is shutting down). Heartbeats are consumed here: they
    /// only say the sender is alive. Relay envelopes are opened (when addressed here) or
    /// forwarded.
    pub async fn deliver(&self, incoming: Incoming) -> Result<(), Incoming> {
        self.heard(incoming.from);
        if matches!(incoming.msg, PeerMsg::Heartbeat) {
            return Ok(());
        }
        let incoming = match (&incoming.msg, &self.relay) {
            (PeerMsg::Relay { dst, .. }, Some(hook)) if *dst == hook.local => match hook.open(incoming) {
                // Opened and authenticated: a sign of life from the rank that sent it.
                Some(inner) => {
                    self.heard(inner.from);
                    if matches!(inner.msg, PeerMsg::Heartbeat) {
                        return Ok(());
                    }
                    inner
                }
                None => return Ok(()),
            },
            (PeerMsg::Relay { .. }, Some(hook)) => {
                let lane = Lane::of(&incoming.msg) as usize;
                return hook.forward[lane].send(incoming).await.map_err(|e| e.0);
            }
            (PeerMsg::Relay { .. }, None) => {
                tracing::warn!(from = incoming.from, "dropped a relayed message: this rank does not relay");
                return Ok(());
            }
            _ => incoming,
        };
        let lane = Lane::of(&incoming.msg);
        if let Some(sink) = &self.direct[lane as usize] {
            sink.deliver(incoming).finish().await;
            return Ok(());
        }
        self.senders[lane as usize].send(incoming).await.map_err(|e| e.0)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lanes_come_from_their_wire_codes() {
        use crate::transport::link::Lane;
        assert_eq!(Lane::from_code(2), Some(Lane::Control));
        assert_eq!(Lane::from_code(9), None);
    }
}
