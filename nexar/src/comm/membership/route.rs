//! Which way a message takes to a rank: the direct link when there is one, otherwise a relay
//! through the neighbour that starts a shortest path over live ranks (sparse topologies; the
//! paths are `cluster::Routes`', the envelopes `transport::route`'s); and passing on the
//! envelopes addressed to other ranks.

use std::sync::Weak;

use tokio::sync::mpsc;

use crate::comm::client::Inner;
use crate::proto::message::PeerMsg;
use crate::proto::relay::MAX_HOPS;
use crate::proto::topology::Topology;
use crate::transport::link::{Incoming, PeerLink};
pub(crate) use crate::transport::route::Route;

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
