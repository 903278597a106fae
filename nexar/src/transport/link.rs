//! One authenticated connection to one peer: a writer task per lane that owns that lane's
//! outgoing stream, and a router that reads the peer's streams and hands each message to its
//! lane.
//!
//! Every lane has its own QUIC stream in each direction and its own bounded queue, so a full
//! lane (a receiver that is not keeping up) stalls only that stream; barriers, heartbeats and
//! RPCs on the other lanes keep flowing.

use std::sync::Arc;

use bytes::Bytes;
use quinn::{Connection, RecvStream};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use super::TransportError;
use super::bulk::{BulkChannel, BulkSlot};
use super::byte_budget::ByteBudget;
use super::framed::{Payload, ReadFrameError, read_body, read_header};
use super::liveness::Liveness;
use super::mailbox::{Held, Key, Mailbox};
pub(crate) use super::relay_hook::{RELAY_BUDGET_BYTES, RelayHook};
use crate::proto::frame::{FrameError, FrameKind, MAX_CONTROL_FRAME, message_frame, raw_header};
use crate::proto::message::{self, PeerMsg};
use crate::telemetry::SentBytes;

/// QUIC application error code for a peer that broke the wire protocol.
pub const CLOSE_PROTOCOL_VIOLATION: u32 = 2;
/// QUIC application error code for an orderly shutdown.
pub const CLOSE_SHUTDOWN: u32 = 0;

/// The independent receive queues of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Incoming RPC requests.
    RpcRequests = 0,
    /// Responses to our RPC calls.
    RpcResponses = 1,
    /// Control traffic: liveness, membership, collective agreement.
    Control = 2,
    /// Typed point-to-point messages.
    Data = 3,
    /// Bulk payloads of collectives.
    Raw = 4,
}

impl Lane {
    /// How many lanes there are.
    pub const COUNT: usize = 5;

    /// The lane a message travels on.
    pub fn of(msg: &PeerMsg) -> Lane {
        match msg {
            PeerMsg::P2p { .. } => Lane::Data,
            PeerMsg::Coll { .. } => Lane::Raw,
            PeerMsg::RpcRequest { .. } => Lane::RpcRequests,
            PeerMsg::RpcResponse { .. } => Lane::RpcResponses,
            PeerMsg::Ping { .. }
            | PeerMsg::Pong { .. }
            | PeerMsg::Goodbye
            | PeerMsg::Abort { .. }
            | PeerMsg::Registry { .. }
            | PeerMsg::Heartbeat
            | PeerMsg::Admit { .. }
            | PeerMsg::Suspect { .. }
            | PeerMsg::Setup { .. }
            | PeerMsg::WhereAreYou { .. }
            | PeerMsg::Position { .. } => Lane::Control,
            PeerMsg::Relay { lane, .. } => Lane::from_code(*lane).unwrap_or(Lane::Control),
        }
    }

    /// The lane with wire code `code`.
    ///
    /// ```
    /// use nexar::transport::link::Lane;
    /// assert_eq!(Lane::from_code(2), Some(Lane::Control));
    /// assert_eq!(Lane::from_code(9), None);
    /// ```
    pub fn from_code(code: u8) -> Option<Lane> {
        [Lane::RpcRequests, Lane::RpcResponses, Lane::Control, Lane::Data, Lane::Raw].get(usize::from(code)).copied()
    }
}

/// A message received from a peer, with its payload.
#[derive(Debug)]
pub struct Incoming {
    /// The sender's rank.
    pub from: u32,
    /// The message.
    pub msg: PeerMsg,
    /// Raw bytes that followed it (empty for messages without payload).
    pub payload: Payload,
    /// The share of the rank's RPC byte budget this message holds until it is dropped (RPC
    /// requests and answers read off a link).
    pub(crate) budget: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Incoming {
    /// A message from `from`, holding no budget.
    pub fn new(from: u32, msg: PeerMsg, payload: Payload) -> Incoming {
        Incoming { from, msg, payload, budget: None }
    }
}

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

/// A lane whose messages go straight from the router into a matching store, without a queue
/// and a task hop in between (the latency path of point-to-point and collectives).
#[derive(Clone)]
pub(crate) struct DirectSink {
    pub mailbox: std::sync::Arc<Mailbox>,
    pub entry: fn(Incoming) -> Option<(Key, Held)>,
}

/// The receiving halves of a rank's lanes, taken by the layers that consume them.
#[derive(Debug)]
pub struct LaneReceivers {
    /// Incoming RPC requests.
    pub rpc_requests: mpsc::Receiver<Incoming>,
    /// Responses to our RPC calls.
    pub rpc_responses: mpsc::Receiver<Incoming>,
    /// Control traffic.
    pub control: mpsc::Receiver<Incoming>,
    /// Point-to-point messages.
    pub data: mpsc::Receiver<Incoming>,
    /// Collective payloads.
    pub raw: mpsc::Receiver<Incoming>,
}

/// Creates a rank's lanes, each holding up to `capacity` messages.
pub fn lanes(capacity: usize) -> (LaneSenders, LaneReceivers) {
    let (a, ra) = mpsc::channel(capacity);
    let (b, rb) = mpsc::channel(capacity);
    let (c, rc) = mpsc::channel(capacity);
    let (d, rd) = mpsc::channel(capacity);
    let (e, re) = mpsc::channel(capacity);
    (
        LaneSenders {
            senders: [a, b, c, d, e],
            direct: Default::default(),
            liveness: None,
            relay: None,
            rpc_budget: None,
        },
        LaneReceivers { rpc_requests: ra, rpc_responses: rb, control: rc, data: rd, raw: re },
    )
}

impl LaneSenders {
    /// The store a message announced by `from` goes to, and its key there, when its lane
    /// delivers straight into one (point-to-point and collective messages): its payload is
    /// read only once that store admits it.
    pub(crate) fn admission(&self, msg: &PeerMsg, from: u32) -> Option<(&Mailbox, Key)> {
        let sink = self.direct[Lane::of(msg) as usize].as_ref()?;
        Some((&sink.mailbox, super::mailbox::key_of(msg, from)?))
    }

    /// The store collective messages go to, when they bypass the raw lane's queue.
    pub(crate) fn coll_mailbox(&self) -> Option<std::sync::Arc<Mailbox>> {
        self.direct[Lane::Raw as usize].as_ref().map(|sink| sink.mailbox.clone())
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
    fn byte_budget(&self, msg: &PeerMsg) -> Option<&ByteBudget> {
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

    /// Queues a message on its lane, waiting while the lane is full. Fails only when the
    /// lane's consumer is gone (the rank is shutting down). Heartbeats are consumed here: they
    /// only say the sender is alive. Relay envelopes are opened (when addressed here) or
    /// forwarded.
    pub async fn deliver(&self, incoming: Incoming) -> Result<(), Incoming> {
        if let Some(liveness) = &self.liveness {
            liveness.heard(incoming.from);
        }
        if matches!(incoming.msg, PeerMsg::Heartbeat) {
            return Ok(());
        }
        let incoming = match (&incoming.msg, &self.relay) {
            (PeerMsg::Relay { dst, .. }, Some(hook)) if *dst == hook.local => match hook.open(incoming) {
                Some(inner) => inner,
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
            if let Some((key, held)) = (sink.entry)(incoming) {
                sink.mailbox.deliver(key, held).await;
            }
            return Ok(());
        }
        self.senders[lane as usize].send(incoming).await.map_err(|e| e.0)
    }
}

enum Outgoing {
    /// Frames to write, in order, as one unit; `coll` names the collective `(comm, seq)` of a
    /// collective message.
    Frames { chunks: Vec<Bytes>, done: oneshot::Sender<Result<(), TransportError>>, coll: Option<(u64, u64)> },
    /// Finish the lane's stream and report once the peer has acknowledged all of it. A later
    /// message opens a new stream.
    Flush { done: oneshot::Sender<()> },
}

/// An established, authenticated connection to one peer.
#[derive(Debug)]
pub struct PeerLink {
    peer: u32,
    conn: Connection,
    writers: [mpsc::Sender<Outgoing>; Lane::COUNT],
    /// Another transport that carries collective payloads once attached (see [`BulkChannel`]).
    bulk: Arc<BulkSlot>,
    /// `nexar_sent_bytes_total` of this rank.
    sent: Arc<SentBytes>,
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outgoing::Frames { chunks, .. } => f.debug_struct("Frames").field("chunks", &chunks.len()).finish(),
            Outgoing::Flush { .. } => f.write_str("Flush"),
        }
    }
}

fn peer_name(rank: u32) -> String {
    format!("rank {rank}")
}

impl PeerLink {
    /// Starts the writers and the router of a connection to `peer` (already authenticated as
    /// that rank). Received messages go to `lanes`; payloads longer than `max_payload` are a
    /// protocol violation.
    pub fn spawn(local: u32, peer: u32, conn: Connection, lanes: LaneSenders, max_payload: u64) -> PeerLink {
        let bulk = Arc::new(BulkSlot::new(peer, &lanes));
        let sent = Arc::new(SentBytes::new(local));
        let writers = std::array::from_fn(|lane| {
            let (tx, rx) = mpsc::channel::<Outgoing>(64);
            let span = tracing::debug_span!("writer", rank = local, peer);
            // Control traffic (heartbeats, aborts, failure reports) goes out ahead of bulk data.
            let priority = if lane == Lane::Control as usize { 1 } else { 0 };
            let bulk = (lane == Lane::Raw as usize).then(|| bulk.clone());
            let sent = sent.clone();
            tokio::spawn(write_lane(conn.clone(), peer, priority, bulk, sent, rx).instrument(span));
            tx
        });
        let control: mpsc::Sender<Outgoing> = writers[Lane::Control as usize].clone();
        bulk.on_failure_tell_peer(Box::new(move |keys| {
            let down = PeerMsg::Setup { tag: super::bulk::BULK_DOWN_TAG, body: keys };
            let Ok(body) = message::encode(&down) else { return };
            let (done, _) = oneshot::channel();
            let frames = Outgoing::Frames { chunks: vec![message_frame(&body)], done, coll: None };
            // Waits for room on the control lane when it can; a full lane must not lose it.
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let control = control.clone();
                    runtime.spawn(async move {
                        let _ = control.send(frames).await;
                    });
                }
                Err(_) => {
                    let _ = control.try_send(frames);
                }
            }
        }));
        let span = tracing::debug_span!("router", rank = local, peer);
        tokio::spawn(route(conn.clone(), peer, lanes, max_payload).instrument(span));
        PeerLink { peer, conn, writers, bulk, sent }
    }

    /// Hands collective payloads to `channel` from now on, for collectives that have sent
    /// nothing over QUIC on this link (a collective never spans both). Gives the channel back
    /// when one is attached already or there is no Tokio runtime to watch it.
    /// `settle` runs when the channel stops, before the collectives it carried fail.
    pub fn attach_bulk(
        &self,
        channel: Arc<dyn BulkChannel>,
        settle: Option<super::bulk::Settle>,
    ) -> Result<(), Arc<dyn BulkChannel>> {
        self.bulk.attach(channel, settle)
    }

    /// The name of the transport that carries collective payloads: `"quic"` or the attached
    /// channel's (while it works).
    pub fn bulk_transport(&self) -> &'static str {
        match self.bulk.attached() {
            Some(name) if self.bulk.working() => name,
            _ => "quic",
        }
    }

    /// The bulk channel attached to this link (tests that send through it as a peer would).
    #[cfg(feature = "hostile-member")]
    pub(crate) fn bulk_channel(&self) -> Option<std::sync::Arc<dyn BulkChannel>> {
        self.bulk.channel()
    }

    /// The name of the channel attached to this link, if any, working or not.
    pub fn attached_bulk(&self) -> Option<&'static str> {
        self.bulk.attached()
    }

    /// Whether a collective message of `len` bytes from this peer comes over its bulk channel
    /// (the channel is working and takes messages that large on either side).
    pub(crate) fn bulk_takes(&self, len: usize) -> bool {
        self.bulk.takes(len)
    }

    /// Where the peer's QUIC endpoint is, as this link reaches it.
    pub(crate) fn remote_addr(&self) -> std::net::SocketAddr {
        self.conn.remote_address()
    }

    pub(crate) fn bulk_slot(&self) -> Arc<BulkSlot> {
        self.bulk.clone()
    }

    /// The peer's rank.
    pub fn peer(&self) -> u32 {
        self.peer
    }

    /// The underlying connection.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Sends `msg` (and `payload`, for messages that carry one) on the message's lane.
    ///
    /// Returns once the bytes are handed to QUIC. The bytes are owned by the writer task, so
    /// dropping this future never leaves a half-written frame.
    pub async fn send(&self, msg: &PeerMsg, payload: Option<Bytes>) -> Result<(), TransportError> {
        let wait = self.send_queued(msg, payload).await?;
        wait.await.map_err(|_| self.writer_gone())?
    }

    fn writer_gone(&self) -> TransportError {
        TransportError::ConnectionLost { peer: peer_name(self.peer), reason: "its writer has stopped".into() }
    }

    /// Queues `msg` (and its payload) on its lane and returns as soon as it is queued, with a
    /// receiver that reports when the bytes are handed to QUIC. Messages queued one after
    /// another on a lane are sent in that order.
    pub async fn send_queued(
        &self,
        msg: &PeerMsg,
        payload: Option<Bytes>,
    ) -> Result<oneshot::Receiver<Result<(), TransportError>>, TransportError> {
        self.send_queued_parts(msg, payload.into_iter().collect()).await
    }

    /// Like [`send_queued`](Self::send_queued), with a payload given as parts sent one after
    /// the other (their total length is the payload's).
    pub async fn send_queued_parts(
        &self,
        msg: &PeerMsg,
        parts: Vec<Bytes>,
    ) -> Result<oneshot::Receiver<Result<(), TransportError>>, TransportError> {
        let body =
            message::encode(msg).map_err(|error| TransportError::Protocol { peer: peer_name(self.peer), error })?;
        let mut chunks = vec![message_frame(&body)];
        if msg.payload_elements().is_some() {
            chunks.push(raw_header(parts.iter().map(|p| p.len() as u64).sum()));
            chunks.extend(parts);
        }
        let (done, wait) = oneshot::channel();
        let coll = match *msg {
            PeerMsg::Coll { comm, seq, .. } => Some((comm, seq)),
            _ => None,
        };
        self.writers[Lane::of(msg) as usize]
            .send(Outgoing::Frames { chunks, done, coll })
            .await
            .map_err(|_| self.writer_gone())?;
        Ok(wait)
    }

    /// Sends collective message `msg` with its payload lent for this call over the bulk
    /// channel, when the collective takes the channel and the channel can read a lent payload
    /// at once ([`BulkChannel::send_borrowed`]); `None` otherwise, for the caller to copy the
    /// payload and queue it (which then takes the same transport). The payload is the
    /// concatenation of `payload`'s parts.
    pub async fn send_borrowed(
        &self,
        msg: &PeerMsg,
        payload: &[&[u8]],
    ) -> Option<Result<oneshot::Receiver<Result<(), TransportError>>, TransportError>> {
        let PeerMsg::Coll { comm, seq, .. } = *msg else { return None };
        let len: usize = payload.iter().map(|p| p.len()).sum();
        let channel = self.bulk.route((comm, seq), len).ok()?;
        // Dropped while waiting, nothing was read from `payload`.
        channel.room().await;
        let body = match message::encode(msg) {
            Ok(body) => body,
            Err(error) => return Some(Err(TransportError::Protocol { peer: peer_name(self.peer), error })),
        };
        let frames = [message_frame(&body), raw_header(len as u64)];
        let sent = channel.send_borrowed(&frames, payload)?;
        self.sent.bulk(channel.name(), frames.iter().map(Bytes::len).sum::<usize>() + len);
        let (done, wait) = oneshot::channel();
        let slot = Arc::downgrade(&self.bulk);
        tokio::spawn(async move {
            let result = sent.await;
            if result.is_err()
                && let Some(slot) = slot.upgrade()
            {
                slot.channel_stopped();
            }
            let _ = done.send(result);
        });
        Some(Ok(wait))
    }

    /// Queues `msg` on its lane only if there is room right now; never waits. For messages
    /// that are worthless when late, such as heartbeats. Returns whether it was queued.
    pub fn try_send(&self, msg: &PeerMsg) -> bool {
        let Ok(body) = message::encode(msg) else { return false };
        let (done, _) = oneshot::channel();
        let chunks = vec![message_frame(&body)];
        self.writers[Lane::of(msg) as usize].try_send(Outgoing::Frames { chunks, done, coll: None }).is_ok()
    }

    /// Finishes every lane's stream and waits until the peer has acknowledged all data sent
    /// so far (at most `limit`).
    pub async fn flush(&self, limit: std::time::Duration) {
        let all = async {
            for wait in self.begin_flush().await {
                let _ = wait.await;
            }
        };
        let _ = tokio::time::timeout(limit, all).await;
    }

    /// Asks every lane's writer to finish its stream; each receiver reports when the peer has
    /// acknowledged that lane. Lets a caller flush many links at once.
    pub async fn begin_flush(&self) -> Vec<oneshot::Receiver<()>> {
        let mut waits = Vec::with_capacity(self.writers.len());
        for w in &self.writers {
            let (done, wait) = oneshot::channel();
            if w.send(Outgoing::Flush { done }).await.is_ok() {
                waits.push(wait);
            }
        }
        waits
    }

    /// Closes the connection with `code`.
    pub fn close(&self, code: u32, reason: &str) {
        let stats = self.conn.stats();
        tracing::debug!(
            peer = self.peer,
            rtt = ?self.conn.rtt(),
            cwnd = stats.path.cwnd,
            mtu = stats.path.current_mtu,
            lost_packets = stats.path.lost_packets,
            congestion_events = stats.path.congestion_events,
            sent_packets = stats.path.sent_packets,
            "closing connection"
        );
        self.conn.close(code.into(), reason.as_bytes());
    }
}

/// Groups a link may have on its bulk channel at once before its writer waits for the oldest.
const BULK_IN_FLIGHT: usize = 16;

async fn write_lane(
    conn: Connection,
    peer: u32,
    priority: i32,
    bulk: Option<Arc<BulkSlot>>,
    sent_bytes: Arc<SentBytes>,
    mut rx: mpsc::Receiver<Outgoing>,
) {
    let mut stream: Option<quinn::SendStream> = None;
    let mut broken: Option<TransportError> = None;
    // Groups handed to the bulk channel and not yet done, oldest first.
    let mut on_bulk: std::collections::VecDeque<tokio::task::JoinHandle<()>> = Default::default();
    while let Some(out) = rx.recv().await {
        let (mut chunks, done, coll) = match out {
            Outgoing::Frames { chunks, done, coll } => (chunks, done, coll),
            Outgoing::Flush { done } => {
                for sent in on_bulk.drain(..) {
                    let _ = sent.await;
                }
                if let Some(mut s) = stream.take() {
                    let _ = s.finish();
                    let _ = s.stopped().await;
                }
                let _ = done.send(());
                continue;
            }
        };
        if let Some(e) = &broken {
            let _ = done.send(Err(e.clone()));
            continue;
        }
        if let (Some(slot), Some(coll)) = (&bulk, coll) {
            let len = chunks.iter().map(Bytes::len).sum();
            match slot.route(coll, len) {
                Ok(channel) => {
                    while on_bulk.len() >= BULK_IN_FLIGHT {
                        if let Some(oldest) = on_bulk.pop_front() {
                            let _ = oldest.await;
                        }
                    }
                    sent_bytes.bulk(channel.name(), len);
                    let sent = channel.send(chunks);
                    let slot = Arc::downgrade(slot);
                    on_bulk.push_back(tokio::spawn(async move {
                        let result = sent.await;
                        if result.is_err()
                            && let Some(slot) = slot.upgrade()
                        {
                            slot.channel_stopped();
                        }
                        let _ = done.send(result);
                    }));
                    continue;
                }
                // The channel failed and may have lost earlier messages of this collective: a
                // later one over QUIC could be taken for them, so it is not sent.
                Err(true) => {
                    let _ = done.send(Err(slot.lost()));
                    continue;
                }
                Err(false) => {}
            }
        }
        let s = match &mut stream {
            Some(s) => s,
            None => match conn.open_uni().await {
                Ok(s) => {
                    let _ = s.set_priority(priority);
                    stream.insert(s)
                }
                Err(e) => {
                    let err = TransportError::ConnectionLost { peer: peer_name(peer), reason: e.to_string() };
                    broken = Some(err.clone());
                    let _ = done.send(Err(err));
                    continue;
                }
            },
        };
        let len = chunks.iter().map(Bytes::len).sum();
        let result = s
            .write_all_chunks(&mut chunks)
            .await
            .map_err(|e| TransportError::ConnectionLost { peer: peer_name(peer), reason: e.to_string() });
        match &result {
            Ok(()) => sent_bytes.quic(len),
            Err(e) => broken = Some(e.clone()),
        }
        let _ = done.send(result);
    }
    if let Some(mut s) = stream {
        let _ = s.finish();
    }
}

/// Payload bytes a peer may have on their way into this rank at once on one lane, over all
/// its streams: read but not yet handed to a mailbox or a collective. A message larger than
/// this still goes through, alone, so no size the message limit allows waits for ever. Each
/// lane has its own budget, so a lane that waits for its mailbox (unmatched messages) never
/// holds up another lane's messages, as before.
pub const INFLIGHT_BYTES_PER_LANE: u64 = 64 << 20;

async fn route(conn: Connection, peer: u32, lanes: LaneSenders, max_payload: u64) {
    let budget: Arc<[ByteBudget; Lane::COUNT]> =
        Arc::new(std::array::from_fn(|_| ByteBudget::new(INFLIGHT_BYTES_PER_LANE)));
    loop {
        match conn.accept_uni().await {
            Ok(recv) => {
                let conn = conn.clone();
                let (lanes, budget) = (lanes.clone(), budget.clone());
                tokio::spawn(
                    async move {
                        if let Err(error) = read_stream(recv, &conn, peer, &lanes, max_payload, &budget).await {
                            tracing::error!(peer, %error, "closing the connection: the peer broke the wire protocol");
                            conn.close(CLOSE_PROTOCOL_VIOLATION.into(), error.to_string().as_bytes());
                        }
                    }
                    .in_current_span(),
                );
            }
            Err(e) => {
                tracing::debug!(peer, reason = %e, "connection closed");
                return;
            }
        }
    }
}

/// Reads frames from one stream until it ends. Only protocol violations are errors; a stream
/// that closes mid-frame because the connection went away ends quietly.
async fn read_stream(
    mut recv: RecvStream,
    conn: &Connection,
    peer: u32,
    lanes: &LaneSenders,
    max_payload: u64,
    budget: &[ByteBudget; Lane::COUNT],
) -> Result<(), FrameError> {
    loop {
        let msg: PeerMsg = match next_message(&mut recv).await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()),
            Err(ReadFrameError::Closed(_)) => return Ok(()),
            Err(ReadFrameError::Frame(e)) => return Err(e),
        };
        let (mut held, mut admitted, mut budget_held) = (None, None, None);
        let payload = match announced_payload(&msg, max_payload)? {
            None => Payload::default(),
            Some((expected, limit)) => match read_header(&mut recv, limit).await {
                Ok(Some(h)) => {
                    h.expect(FrameKind::Raw)?;
                    if h.len != expected {
                        return Err(raw_length_disagrees(expected, h.len));
                    }
                    // Until the budget has room, this stream is not read, and QUIC's flow
                    // control holds the peer.
                    match budget[Lane::of(&msg) as usize].take(h.len).await {
                        Some(permit) => held = Some(permit),
                        None => return Ok(()),
                    }
                    // RPC requests and answers, and relay envelopes, are read only once the
                    // rank's budget for them has room.
                    if let Some(budget) = lanes.byte_budget(&msg) {
                        if matches!(msg, PeerMsg::RpcRequest { .. } | PeerMsg::RpcResponse { .. })
                            && h.len > budget.limit()
                        {
                            return Err(FrameError::TooLong { len: h.len, limit: budget.limit() });
                        }
                        tokio::select! {
                            permit = budget.take(h.len) => match permit {
                                Some(p) => budget_held = Some(p),
                                None => return Ok(()),
                            },
                            _ = conn.closed() => return Ok(()),
                        }
                    }
                    // A message for a mailbox is read only once the mailbox can take it.
                    if let Some((mailbox, key)) = lanes.admission(&msg, peer) {
                        tokio::select! {
                            a = mailbox.admit(key, h.len) => admitted = Some(a),
                            _ = conn.closed() => return Ok(()),
                        }
                    }
                    match Payload::read(&mut recv, h.len).await {
                        Ok(p) => p,
                        Err(ReadFrameError::Frame(e)) => return Err(e),
                        Err(ReadFrameError::Closed(_)) => return Ok(()),
                    }
                }
                Ok(None) | Err(ReadFrameError::Closed(_)) => return Ok(()),
                Err(ReadFrameError::Frame(e)) => return Err(e),
            },
        };
        // The reservation ends as the message is counted as held.
        drop(admitted);
        let delivered = lanes.deliver(Incoming { from: peer, msg, payload, budget: budget_held }).await;
        drop(held);
        if delivered.is_err() {
            return Ok(());
        }
    }
}

/// The error for a raw frame whose length is not the one its message announced.
pub(crate) fn raw_length_disagrees(announced: u64, found: u64) -> FrameError {
    FrameError::InvalidMessage(format!("message announces {announced} payload bytes but its raw frame has {found}"))
}

/// Checks what a message announces before anything else is read: relay envelopes name a real
/// lane and a bounded hop count, and a payload has a known dtype and fits the limit. Returns
/// `(payload bytes, limit)` for messages followed by a raw frame.
pub(crate) fn announced_payload(msg: &PeerMsg, max_payload: u64) -> Result<Option<(u64, u64)>, FrameError> {
    if let PeerMsg::Relay { lane, hops, .. } = *msg
        && (Lane::from_code(lane).is_none() || hops > crate::proto::relay::MAX_HOPS)
    {
        return Err(FrameError::InvalidMessage(format!("relay envelope with lane {lane} after {hops} hops")));
    }
    let Some((dtype, _)) = msg.payload_elements() else { return Ok(None) };
    nexar_types::DType::from_wire(dtype).map_err(|e| FrameError::InvalidMessage(e.to_string()))?;
    let expected =
        msg.payload_len().ok_or_else(|| FrameError::InvalidMessage("payload length overflows 64 bits".into()))?;
    // A relay envelope carries a whole message: its payload plus the carried frames.
    let limit = match msg {
        PeerMsg::Relay { .. } => max_payload.saturating_add(crate::proto::relay::ENVELOPE_OVERHEAD),
        _ => max_payload,
    };
    if expected > limit {
        return Err(FrameError::TooLong { len: expected, limit });
    }
    Ok(Some((expected, limit)))
}

async fn next_message(recv: &mut RecvStream) -> Result<Option<PeerMsg>, ReadFrameError> {
    let Some(header) = read_header(recv, MAX_CONTROL_FRAME).await? else {
        return Ok(None);
    };
    header.expect(FrameKind::Message)?;
    let body = read_body(recv, header.len).await?;
    Ok(Some(message::decode(&body)?))
}
