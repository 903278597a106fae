//! How a message reaches a rank: over the direct link when there is one, otherwise in a relay
//! envelope through the neighbour that starts a shortest path over live ranks (sparse
//! topologies; the paths are `cluster::Routes`'), sealed end to end; and passing on the
//! envelopes addressed to other ranks.

use std::sync::Weak;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::client::Inner;
use crate::proto::message::PeerMsg;
use crate::proto::relay::{self, MAX_HOPS};
use crate::proto::topology::Topology;
use crate::transport::TransportError;
use crate::transport::link::{Incoming, Lane, PeerLink};
use crate::transport::relay_seal::RelaySeals;

/// The way to one peer.
pub(crate) enum Route<'a> {
    /// A direct link.
    Direct(&'a PeerLink),
    /// Through `via`, in an envelope from `src` to `dst`, sealed end to end with `seals` (when
    /// the cluster has relay keys).
    Relay { via: &'a PeerLink, src: u32, dst: u32, seals: Option<&'a RelaySeals> },
}

impl Route<'_> {
    /// Sends `msg` (and its payload), returning once it is handed to QUIC.
    pub async fn send(&self, msg: &PeerMsg, payload: Option<Bytes>) -> Result<(), TransportError> {
        let wait = self.send_queued(msg, payload).await?;
        wait.await.map_err(|_| self.lost("its writer has stopped"))?
    }

    /// Queues `msg` (and its payload) on the first hop; see [`PeerLink::send_queued`].
    pub async fn send_queued(
        &self,
        msg: &PeerMsg,
        payload: Option<Bytes>,
    ) -> Result<oneshot::Receiver<Result<(), TransportError>>, TransportError> {
        match *self {
            Route::Direct(link) => link.send_queued(msg, payload).await,
            Route::Relay { via, src, dst, seals } => {
                let lane = Lane::of(msg) as u8;
                let parts = relay::pack(msg, payload)
                    .map_err(|error| TransportError::Protocol { peer: format!("rank {dst}"), error })?;
                let (seq, parts) = match seals {
                    Some(seals) => seal(seals, dst, lane, &parts)?,
                    None => (0, parts),
                };
                let len = parts.iter().map(|p| p.len() as u64).sum();
                let envelope = PeerMsg::Relay { src, dst, lane, hops: 0, seq, len };
                via.send_queued_parts(&envelope, parts).await
            }
        }
    }

    /// Hands a collective message with a lent payload to the direct link's bulk channel when
    /// it takes it and can read the payload now; `None` when the caller must copy the payload
    /// and queue it (relayed routes, QUIC, channels that cannot).
    pub async fn send_borrowed(
        &self,
        msg: &PeerMsg,
        payload: &[&[u8]],
    ) -> Option<Result<oneshot::Receiver<Result<(), TransportError>>, TransportError>> {
        match *self {
            Route::Direct(link) => link.send_borrowed(msg, payload).await,
            Route::Relay { .. } => None,
        }
    }

    /// The first hop's link.
    pub fn first_hop(&self) -> &PeerLink {
        match self {
            Route::Direct(link) | Route::Relay { via: link, .. } => link,
        }
    }

    fn lost(&self, reason: &str) -> TransportError {
        let peer = match self {
            Route::Direct(l) => format!("rank {}", l.peer()),
            Route::Relay { dst, via, .. } => format!("rank {dst} (via rank {})", via.peer()),
        };
        TransportError::ConnectionLost { peer, reason: reason.into() }
    }
}

/// Seals a relay body's `parts` for `dst` in one buffer: its sequence number and the sealed body.
fn seal(seals: &RelaySeals, dst: u32, lane: u8, parts: &[Bytes]) -> Result<(u64, Vec<Bytes>), TransportError> {
    let len: usize = parts.iter().map(Bytes::len).sum();
    let mut body = Vec::with_capacity(len + relay::SEAL_TAG_LEN as usize);
    for part in parts {
        body.extend_from_slice(part);
    }
    let seq = seals
        .seal(dst, lane, &mut body)
        .map_err(|e| TransportError::Tls(format!("cannot seal a relayed message for rank {dst}: {e}")))?;
    Ok((seq, vec![Bytes::from(body)]))
}

impl Inner {
    /// The route to world rank `peer`: its direct link, or (on sparse topologies) a relay.
    pub(crate) fn route(&self, peer: usize) -> Option<Route<'_>> {
        if let Some(link) = self.links.get(peer) {
            return Some(Route::Direct(link));
        }
        if self.cfg.topology == Topology::FullMesh {
            return None;
        }
        let hop = self.next_hop(peer)?;
        let seals = self.relay_seals.as_deref();
        Some(Route::Relay { via: self.links.get(hop)?, src: self.rank as u32, dst: peer as u32, seals })
    }

    /// The neighbour that starts a shortest path to `peer` over live ranks.
    fn next_hop(&self, peer: usize) -> Option<usize> {
        self.routes.next_hop(peer, || self.linked_peers(), &self.health.dead())
    }

    /// The peers this rank has a direct link to.
    fn linked_peers(&self) -> Vec<usize> {
        self.links.iter().map(|l| l.peer() as usize).collect()
    }

    /// The link that carries an envelope for `dst` that arrived from neighbour `from` one hop
    /// further. Never `from` itself: when the usual route leads back there, the sender knows of
    /// a failure this rank has not heard of yet (it routed around a rank this one still counts
    /// as alive), and handing the envelope back would bounce it between the two until its hops
    /// ran out. The envelope then takes the shortest live path that avoids `from`.
    fn forward_link(&self, dst: usize, from: usize) -> Option<&PeerLink> {
        let (Route::Direct(usual) | Route::Relay { via: usual, .. }) = self.route(dst)?;
        if usual.peer() as usize != from {
            return Some(usual);
        }
        let hop = self.routes.next_hop_avoiding(dst, from, &self.linked_peers(), &self.health.dead())?;
        self.links.get(hop)
    }
}

/// Passes on relay envelopes addressed to other ranks, one hop further each time.
pub(crate) async fn forward(inner: Weak<Inner>, mut envelopes: mpsc::Receiver<Incoming>) {
    while let Some(incoming) = envelopes.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let PeerMsg::Relay { src, dst, lane, hops, seq, len } = incoming.msg else { continue };
        if hops >= MAX_HOPS || inner.health.is_dead(dst as usize) {
            tracing::debug!(src, dst, hops, "dropped a relayed message: too many hops or a dead destination");
            continue;
        }
        let Some(next) = inner.forward_link(dst as usize, incoming.from as usize) else {
            tracing::debug!(src, dst, "dropped a relayed message: no route");
            continue;
        };
        let envelope = PeerMsg::Relay { src, dst, lane, hops: hops + 1, seq, len };
        let chunks = match incoming.payload.to_chunks() {
            Ok(chunks) => chunks,
            Err(e) => {
                tracing::warn!(src, dst, error = %e, "dropped a relayed message");
                continue;
            }
        };
        match next.send_queued_parts(&envelope, chunks).await {
            // The envelope's share of the relay budget is held until it is written.
            Ok(written) => {
                if let Some(held) = incoming.budget {
                    tokio::spawn(async move {
                        let _held = held;
                        let _ = written.await;
                    });
                }
            }
            Err(e) => tracing::debug!(src, dst, error = %e, "could not forward a relayed message"),
        }
    }
}
