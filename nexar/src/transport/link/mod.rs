//! One authenticated connection to one peer: a writer task per lane that owns that lane's
//! outgoing stream, and a router that reads the peer's streams and hands each message to its
//! lane.
//!
//! Every lane has its own QUIC stream in each direction and its own bounded queue, so a full
//! lane (a receiver that is not keeping up) stalls only that stream; barriers, heartbeats and
//! RPCs on the other lanes keep flowing.
//!
//! `lanes` holds the lanes and where their messages go, `writer` a lane's writer task,
//! `reader` the router that reads the peer's streams.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use quinn::Connection;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use super::TransportError;
use super::bulk::{BulkChannel, BulkSlot, Sent};
pub(crate) use super::relay_hook::{RELAY_BUDGET_BYTES, RelayHook};
use crate::proto::close::CloseCode;
use crate::proto::frame::{message_frame, message_head, raw_head, raw_header};
use crate::proto::message::{self, PeerMsg};
use crate::telemetry::SentBytes;

mod reader;
mod writer;

use reader::route;
use writer::write_lane;

pub use super::lanes::{Incoming, Lane, LaneReceivers, LaneSenders, lanes};

/// Bytes a message group holds besides its payload, at most: the message frame (a
/// point-to-point or collective message encodes in well under this) and the raw frame's header.
const GROUP_FRAMES: usize = 256;
/// How long a lent payload waits for room in a channel that would otherwise copy it and queue
/// the copy behind what it holds (a same-host ring that the peer has not read yet), letting
/// the task's other futures run meanwhile (often the receive of the peer's message, which the
/// peer's own send waits on). About the time a rank takes to copy a 1 MiB segment out. Without
/// it, a 64 MiB broadcast's root ran ahead of its ring and copied most segments into fresh
/// memory first, at 2.6–4 GB/s instead of 7–10 (a 2 ms wait measured no better than this).
const ROOM_WAIT: Duration = Duration::from_micros(300);
/// The shortest payload that waits for room: a shorter copy costs less, in cache, than the
/// check (which takes the channel's lock once more).
const ROOM_WAIT_MIN: usize = 64 << 10;

/// How a collective message handed to [`PeerLink::send_borrowed`] finishes.
#[derive(Debug)]
pub enum SendDone {
    /// Sent, or failed, within the call.
    Now(Result<(), TransportError>),
    /// Queued: the receiver is told once it is sent.
    Later(oneshot::Receiver<Result<(), TransportError>>),
}

/// Calls `f` with `head` followed by `tail`, gathered on the stack when there are few.
fn with_parts<'a, R>(head: &[&'a [u8]; 3], tail: &[&'a [u8]], f: impl FnOnce(&[&'a [u8]]) -> R) -> R {
    const ON_STACK: usize = 8;
    if tail.len() <= ON_STACK - head.len() {
        let mut parts: [&[u8]; ON_STACK] = [&[]; ON_STACK];
        parts[..head.len()].copy_from_slice(head);
        parts[head.len()..head.len() + tail.len()].copy_from_slice(tail);
        f(&parts[..head.len() + tail.len()])
    } else {
        f(&head.iter().chain(tail).copied().collect::<Vec<_>>())
    }
}

pub(super) enum Outgoing {
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
    /// Why this rank closed the connection, when the peer broke the wire protocol (the length
    /// and the limit): the local end of a closed connection reports only that it was closed
    /// here, and the failure this rank reports (and tells the others) names the violation.
    violation: Arc<std::sync::OnceLock<String>>,
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outgoing::Frames { chunks, .. } => f.debug_struct("Frames").field("chunks", &chunks.len()).finish(),
            Outgoing::Flush { .. } => f.write_str("Flush"),
        }
    }
}

pub(super) fn peer_name(rank: u32) -> String {
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
        let violation = Arc::new(std::sync::OnceLock::new());
        tokio::spawn(route(conn.clone(), peer, lanes, max_payload, violation.clone()).instrument(span));
        PeerLink { peer, conn, writers, bulk, sent, violation }
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

    /// What the working bulk channel says of itself ([`BulkChannel::describe`]).
    pub fn bulk_details(&self) -> Option<String> {
        self.bulk.channel().filter(|_| self.bulk.working()).and_then(|c| c.describe())
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

    /// The violation this rank closed the connection for, once it did (see `violation`).
    pub(crate) fn violation(&self) -> Arc<std::sync::OnceLock<String>> {
        self.violation.clone()
    }

    /// Whether this link's bulk channel works and carries point-to-point messages.
    pub(crate) fn bulk_carries_point_to_point(&self) -> bool {
        self.bulk.working() && self.bulk.carries_point_to_point()
    }

    /// Whether a collective message of `len` bytes from this peer comes over its bulk channel
    /// (the channel is working and takes messages that large on either side) and through a
    /// thread of the channel's own, not a task on this rank's runtime (see
    /// [`BulkChannel::delivers_on_runtime`]).
    pub(crate) fn bulk_takes_on_thread(&self, len: usize) -> bool {
        self.bulk.takes_on_thread(len)
    }

    /// Delivers on the calling task what the link's bulk channel received whole, or hands
    /// back the `awaited` message (see [`BulkChannel::deliver_ready`]); `Some` if anything
    /// may have been.
    pub(crate) fn bulk_deliver_ready(
        &self,
        awaiting: Option<crate::transport::bulk::Awaiting<'_>>,
    ) -> Option<std::time::Duration> {
        self.bulk.deliver_ready(awaiting)
    }

    /// A receive that lent its buffer to the link's bulk channel stops spinning (see
    /// [`BulkChannel::receive_parks`](crate::transport::bulk::BulkChannel::receive_parks)).
    pub(crate) fn bulk_receive_parks(&self) {
        self.bulk.receive_parks();
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
    #[cfg(feature = "unstable-internals")]
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

    /// Sends collective or point-to-point message `msg` with its payload lent for this call
    /// over the bulk channel, when the message takes the channel and the channel can read a
    /// lent payload at once ([`BulkChannel::send_borrowed`]); `None` otherwise, for the caller
    /// to copy the payload and queue it (a collective's then takes the same transport, a
    /// point-to-point one QUIC). The payload is the concatenation of `payload`'s parts.
    /// A point-to-point message whose channel failed gets an error: the peer no longer takes
    /// this rank's messages in order.
    pub async fn send_borrowed(&self, msg: &PeerMsg, payload: &[&[u8]]) -> Option<Result<SendDone, TransportError>> {
        let len: usize = payload.iter().map(|p| p.len()).sum();
        let channel = match *msg {
            PeerMsg::Coll { comm, seq, .. } => self.bulk.route((comm, seq), len).ok()?,
            PeerMsg::P2p { .. } | PeerMsg::P2pSegment { .. } => match self.bulk.route_point_to_point() {
                Ok(channel) => channel,
                Err(false) => return None,
                Err(true) => return Some(Err(self.bulk.lost())),
            },
            _ => return None,
        };
        if !channel.has_room() {
            // Dropped while waiting, nothing was read from `payload`.
            channel.room().await;
        }
        if len >= ROOM_WAIT_MIN {
            wait_for_room(&*channel, len + GROUP_FRAMES).await;
        }
        let written = message::encode_with(msg, |body| {
            let (message_head, raw_head) = (message_head(body.len()), raw_head(len as u64));
            let frames: [&[u8]; 3] = [&message_head, body, &raw_head];
            let framed = frames.iter().map(|f| f.len()).sum::<usize>() + len;
            (with_parts(&frames, payload, |parts| channel.send_borrowed(parts)), framed)
        });
        let sent = match written {
            Ok((sent, framed)) => {
                let sent = sent?;
                self.sent.bulk(channel.name(), framed);
                sent
            }
            Err(error) => return Some(Err(TransportError::Protocol { peer: peer_name(self.peer), error })),
        };
        let slot = Arc::downgrade(&self.bulk);
        let finish = move |result: &Result<(), TransportError>| {
            if result.is_err()
                && let Some(slot) = slot.upgrade()
            {
                slot.channel_stopped();
            }
        };
        match sent {
            // A group that went into the channel at once (shared memory with room in its ring,
            // a socket that took it) is done here, without a task or a channel.
            Sent::Done(result) => {
                finish(&result);
                Some(Ok(SendDone::Now(result)))
            }
            Sent::Later(sent) => {
                let (done, wait) = oneshot::channel();
                drop(tokio::spawn(async move {
                    let result = sent.await;
                    finish(&result);
                    let _ = done.send(result);
                }));
                Some(Ok(SendDone::Later(wait)))
            }
        }
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
    #[cfg(feature = "unstable-internals")]
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
    pub fn close(&self, code: CloseCode, reason: &str) {
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
        self.conn.close(code.value().into(), reason.as_bytes());
    }
}

/// Waits up to [`ROOM_WAIT`] until a `len`-byte group fits in `channel` at once
/// ([`BulkChannel::fits_now`]; at once where the channel never copies).
async fn wait_for_room(channel: &dyn BulkChannel, len: usize) {
    let mut since: Option<Instant> = None;
    while !channel.fits_now(len) {
        let started = *since.get_or_insert_with(Instant::now);
        if started.elapsed() > ROOM_WAIT {
            return;
        }
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod room_tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;

    use super::{BulkChannel, ROOM_WAIT, wait_for_room};
    use crate::transport::bulk::BulkSend;

    /// A channel with room for a group once it has been asked `full_for` times.
    struct Filling {
        asked: AtomicUsize,
        full_for: usize,
    }

    impl BulkChannel for Filling {
        fn name(&self) -> &'static str {
            "filling"
        }
        fn send(&self, _: Vec<Bytes>) -> BulkSend {
            Box::pin(async { Ok(()) })
        }
        fn fits_now(&self, _: usize) -> bool {
            self.asked.fetch_add(1, Ordering::SeqCst) >= self.full_for
        }
    }

    #[tokio::test]
    async fn a_send_waits_until_the_channel_has_room() {
        let channel = Filling { asked: AtomicUsize::new(0), full_for: 5 };
        wait_for_room(&channel, 1 << 20).await;
        assert_eq!(channel.asked.load(Ordering::SeqCst), 6, "asked until it fitted, not after");
    }

    #[tokio::test]
    async fn a_channel_that_never_has_room_holds_a_send_only_for_the_bounded_wait() {
        let channel = Filling { asked: AtomicUsize::new(0), full_for: usize::MAX };
        let started = std::time::Instant::now();
        tokio::time::timeout(std::time::Duration::from_secs(60), wait_for_room(&channel, 1 << 20))
            .await
            .expect("the wait for room ended on its own");
        assert!(started.elapsed() >= ROOM_WAIT, "gave up before the bounded wait");
        assert!(channel.asked.load(Ordering::SeqCst) > 1, "looked again while it waited");
    }
}
