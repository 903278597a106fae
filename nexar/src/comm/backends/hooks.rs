//! Hooks for transport back ends (RDMA and the like): small setup messages on the control
//! lane, matched by `(sender, tag)`, and attaching a [`BulkChannel`] under a peer's raw lane.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::client::NexarClient;
use crate::proto::frame::MAX_CONTROL_FRAME;
use crate::proto::message::PeerMsg;
use crate::transport::TransportError;
use crate::transport::bulk::{BULK_DOWN_TAG, BulkChannel, BulkInbound, Settle};

/// Largest body of a setup message (the rest of a control frame is the envelope).
pub const MAX_SETUP_BODY: usize = (MAX_CONTROL_FRAME as usize) - 1024;

/// How often a waiting [`NexarClient::recv_setup`] looks whether its peer died.
const DEATH_CHECK: Duration = Duration::from_millis(100);

/// Why a back-end hook failed.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The peer is not a rank of this communicator (or is this rank).
    #[error("rank {rank} {op}: rank {peer} is not another rank of this communicator (size {size})")]
    NoSuchPeer {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The rank asked for.
        peer: usize,
        /// The communicator's size.
        size: usize,
    },
    /// The setup message is larger than a control frame allows.
    #[error("rank {rank} send_setup: {len}-byte body is over the {limit}-byte limit")]
    TooLarge {
        /// This rank.
        rank: usize,
        /// The body's length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The peer was declared dead or has no route.
    #[error("rank {rank} {op}: rank {peer} is gone")]
    PeerGone {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The peer.
        peer: usize,
    },
    /// No setup message with this tag came in time.
    #[error("rank {rank} recv_setup: nothing from rank {peer} with tag {tag:#x} within {after:?}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The tag waited for.
        tag: u64,
        /// The limit (the configured operation timeout).
        after: Duration,
    },
    /// Bulk channels attach to direct links only; on sparse topologies some peers have none.
    #[error("rank {rank} attach_bulk: no direct link to rank {peer}")]
    NoDirectLink {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
    },
    /// The link already has a bulk channel (one per link, for the link's life).
    #[error("rank {rank} attach_bulk: rank {peer}'s raw lane already goes over {name}")]
    AlreadyAttached {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The channel already attached.
        name: &'static str,
    },
    /// `attach_bulk` needs a Tokio runtime (it watches the channel for failure).
    #[error("rank {rank} attach_bulk: called outside a Tokio runtime")]
    NoRuntime {
        /// This rank.
        rank: usize,
    },
    /// The tag is reserved by nexar.
    #[error("rank {rank} send_setup: tag {tag:#x} is reserved")]
    ReservedTag {
        /// This rank.
        rank: usize,
        /// The tag.
        tag: u64,
    },
    /// Sending failed.
    #[error("rank {rank} send_setup to rank {peer}: {source}")]
    Transport {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What the transport said.
        source: TransportError,
    },
}

/// After world rank `peer`'s bulk channel stopped: returns once the peer answers a ping over
/// QUIC (only the channel failed), is declared dead, or a heartbeat timeout and two intervals
/// have passed.
async fn settle_after_channel_stop(inner: std::sync::Weak<crate::comm::client::Inner>, peer: usize) {
    let Some(inner) = inner.upgrade() else { return };
    let bound = inner.cfg.heartbeat_timeout + 2 * inner.cfg.heartbeat_interval;
    let deadline = Instant::now() + bound;
    let declared_dead = async {
        while !inner.health.is_dead(peer) {
            tokio::time::sleep(DEATH_CHECK / 10).await;
        }
    };
    let answered_or_dead = async {
        tokio::select! {
            answered = inner.peer_answers(peer, bound) => answered,
            () = declared_dead => true,
        }
    };
    if !answered_or_dead.await {
        // No answer (its connection may just have closed): give the death a moment to land.
        while !inner.health.is_dead(peer) && Instant::now() < deadline {
            tokio::time::sleep(DEATH_CHECK / 10).await;
        }
    }
}

impl NexarClient {
    /// Sends a small setup message for a transport back end to `peer` (a rank of this
    /// communicator) on the control lane, where [`recv_setup`](Self::recv_setup) with the
    /// same `tag` takes it. Bodies are at most [`MAX_SETUP_BODY`] bytes.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::BackendError> {
    /// const HELLO: u64 = 0x5244_4d41; // the back end's own tag
    /// comm.send_setup(1, HELLO, b"queue pair 17".to_vec()).await?;
    /// let theirs = comm.recv_setup(1, HELLO).await?;
    /// # Ok(()) }
    /// ```
    pub async fn send_setup(&self, peer: usize, tag: u64, body: Vec<u8>) -> Result<(), BackendError> {
        let rank = self.rank();
        self.check_backend_peer("send_setup", peer)?;
        if tag == BULK_DOWN_TAG {
            return Err(BackendError::ReservedTag { rank, tag });
        }
        if body.len() > MAX_SETUP_BODY {
            return Err(BackendError::TooLarge { rank, len: body.len(), limit: MAX_SETUP_BODY });
        }
        let route = self.link(peer).ok_or(BackendError::PeerGone { rank, op: "send_setup", peer })?;
        route.send(&PeerMsg::Setup { tag, body }, None).await.map_err(|source| BackendError::Transport {
            rank,
            peer,
            source,
        })
    }

    /// Waits for the next setup message from `peer` with `tag` (at most the configured
    /// operation timeout; at once when `peer` is declared dead).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::BackendError> {
    /// let offer = comm.recv_setup(0, 7).await?;
    /// # Ok(()) }
    /// ```
    pub async fn recv_setup(&self, peer: usize, tag: u64) -> Result<Vec<u8>, BackendError> {
        let rank = self.rank();
        self.check_backend_peer("recv_setup", peer)?;
        let world = self.comm.members[peer];
        let inbox = &self.inner.setup;
        let after = self.config().op_timeout;
        let deadline = Instant::now() + after;
        loop {
            let arrived = inbox.arrived();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if let Some(body) = inbox.take(world as u32, tag) {
                return Ok(body);
            }
            if self.inner.health.is_dead(world) {
                return Err(BackendError::PeerGone { rank, op: "recv_setup", peer });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(BackendError::Timeout { rank, peer, tag, after });
            }
            let _ = tokio::time::timeout(DEATH_CHECK.min(deadline - now), arrived).await;
        }
    }

    /// Numbers a transport back end's setup exchanges on this communicator: 0, 1, 2, ... on
    /// every member alike when every member calls it for the same exchanges, in the same order
    /// (like a collective). Back ends put it in their tags, so messages an abandoned exchange
    /// left unread never meet a later one.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// let attempt = comm.next_setup_number();
    /// let tag = 0x5244_4d41_0000 + attempt;
    /// # }
    /// ```
    pub fn next_setup_number(&self) -> u64 {
        self.comm.next_setup()
    }

    /// Takes a setup message from `peer` with `tag` if one is held, without waiting (for
    /// example to discard what an earlier attempt left unread).
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) -> Result<(), nexar::BackendError> {
    /// while comm.try_recv_setup(1, 7)?.is_some() {} // drop leftovers of an abandoned exchange
    /// # Ok(()) }
    /// ```
    pub fn try_recv_setup(&self, peer: usize, tag: u64) -> Result<Option<Vec<u8>>, BackendError> {
        self.check_backend_peer("try_recv_setup", peer)?;
        Ok(self.inner.setup.take(self.comm.members[peer] as u32, tag))
    }

    /// Hands the raw lane to `peer` (collective payloads) to `channel`; everything else stays
    /// on QUIC. Each side attaches its own channel; the peer feeds what arrives to its
    /// [`bulk_inbound`](Self::bulk_inbound).
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient, channel: std::sync::Arc<dyn nexar::backend::BulkChannel>) {
    /// comm.attach_bulk(1, channel).expect("a direct link to rank 1");
    /// assert_ne!(comm.bulk_transport(1), Some("quic"));
    /// # }
    /// ```
    pub fn attach_bulk(&self, peer: usize, channel: Arc<dyn BulkChannel>) -> Result<(), BackendError> {
        let rank = self.rank();
        self.check_backend_peer("attach_bulk", peer)?;
        let world = self.comm.members[peer];
        let link = self.inner.links.get(world).ok_or(BackendError::NoDirectLink { rank, peer })?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(BackendError::NoRuntime { rank });
        }
        let name = channel.name();
        // When the channel stops, first learn whether the peer itself died (its QUIC link
        // says so or stops answering): then its collectives fail naming the dead peer.
        let inner = Arc::downgrade(&self.inner);
        let settle: Settle = Box::new(move || Box::pin(settle_after_channel_stop(inner, world)));
        link.attach_bulk(channel, Some(settle)).map_err(|_| BackendError::AlreadyAttached {
            rank,
            peer,
            name: link.attached_bulk().unwrap_or("another channel"),
        })?;
        tracing::info!(rank, peer, transport = name, "collective payloads to this peer use another transport");
        Ok(())
    }

    /// Where a bulk transport delivers what it received from `peer` (a rank of this
    /// communicator); `None` for this rank itself, a rank out of range or without a direct link.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// let inbound = comm.bulk_inbound(1).unwrap();
    /// assert_eq!(inbound.peer(), 1);
    /// # }
    /// ```
    pub fn bulk_inbound(&self, peer: usize) -> Option<BulkInbound> {
        self.check_backend_peer("bulk_inbound", peer).ok()?;
        let world = self.comm.members[peer];
        let slot = self.inner.links.get(world)?.bulk_slot();
        Some(BulkInbound::new(world as u32, self.inner.self_lanes.clone(), self.config().max_message_bytes, &slot))
    }

    /// The transport that carries collective payloads to `peer`: `"quic"`, an attached
    /// channel's name, or `None` without a direct link.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// println!("to rank 1 over {:?}", comm.bulk_transport(1));
    /// # }
    /// ```
    pub fn bulk_transport(&self, peer: usize) -> Option<&'static str> {
        let world = *self.comm.members.get(peer)?;
        self.inner.links.get(world).map(|l| l.bulk_transport())
    }

    /// What the channel carrying collective payloads to `peer` says of itself: for the TCP
    /// lane, whether its records are sealed (and with which cipher, [`crate::LaneCipher`], and
    /// for AES-GCM which implementation, [`crate::LaneAes`]) and which congestion control its
    /// connection runs (`"sealed, AEGIS-128X2, cubic congestion control"`, `"sealed, AES-GCM
    /// from ring, cubic congestion control"`); `None` over QUIC or without a direct link.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// if let Some(details) = comm.bulk_transport_details(1) {
    ///     println!("to rank 1 over {:?} ({details})", comm.bulk_transport(1));
    /// }
    /// # }
    /// ```
    pub fn bulk_transport_details(&self, peer: usize) -> Option<String> {
        let world = *self.comm.members.get(peer)?;
        self.inner.links.get(world)?.bulk_details()
    }

    /// The channel attached to the link to `peer`, working or failed; `None` when there is
    /// none (or no direct link). A link takes one channel in its life.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// if comm.attached_bulk(1).is_none() { /* free to attach one */ }
    /// # }
    /// ```
    pub fn attached_bulk(&self, peer: usize) -> Option<&'static str> {
        let world = *self.comm.members.get(peer)?;
        self.inner.links.get(world)?.attached_bulk()
    }

    /// Stops the bulk channel to `peer` as if its network failed, for fault tests; `false`
    /// when none is attached.
    #[doc(hidden)]
    pub fn inject_bulk_fault(&self, peer: usize) -> bool {
        let Some(world) = self.comm.members.get(peer) else { return false };
        self.inner.links.get(*world).is_some_and(|l| l.bulk_slot().break_channel())
    }

    fn check_backend_peer(&self, op: &'static str, peer: usize) -> Result<(), BackendError> {
        let size = self.world_size();
        if peer >= size || peer == self.rank() {
            return Err(BackendError::NoSuchPeer { rank: self.rank(), op, peer, size });
        }
        Ok(())
    }
}
