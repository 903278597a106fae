//! The control lane: pings, goodbyes, suspicions and the other control messages a rank
//! answers, and what a new link is told first.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::comm::client::Inner;
use crate::proto::close::CloseCode;
use crate::proto::message::PeerMsg;
use crate::transport::link::{Incoming, PeerLink};

impl Inner {
    /// Starts watching a new link (when its connection ends, receives and collective steps
    /// waiting on that peer fail at once, naming it) and tells the peer which RPC functions
    /// this rank serves, so a call to a missing function fails at once.
    pub(in crate::comm) async fn welcome_link(self: &Arc<Self>, link: &PeerLink) {
        let (weak, conn, peer) = (Arc::downgrade(self), link.connection().clone(), link.peer());
        let (violation, bulk) = (link.violation(), link.bulk_slot());
        let watcher = tokio::spawn(async move {
            let reason = conn.closed().await;
            if left_on_its_own(&reason) {
                // It said goodbye on its bulk channel before it closed the connection: take in
                // what it sent before, so that a collective it finished here still completes.
                let _ = tokio::time::timeout(DRAIN_LIMIT, bulk.drained()).await;
            }
            if let Some(inner) = weak.upgrade() {
                tracing::debug!(peer, %reason, "peer connection ended");
                inner.connection_ended(peer as usize, &reason, violation.get().map(String::as_str));
            }
        });
        crate::sync::lock(&self.tasks).push(watcher);
        let announce = PeerMsg::Registry { entries: self.rpc.registry().entries() };
        if let Err(e) = link.send_queued(&announce, None).await {
            tracing::debug!(peer, error = %e, "could not announce the rpc registry");
        }
    }
}

/// How long a peer that left is given for this rank to take in what its bulk channel still
/// holds (its goodbye is already in it when its connection closes).
const DRAIN_LIMIT: Duration = Duration::from_secs(1);

/// Whether the peer closed the connection itself on leaving (`shutdown()`, or a client dropped
/// without it), rather than it being lost, cut or refused.
fn left_on_its_own(reason: &quinn::ConnectionError) -> bool {
    matches!(reason, quinn::ConnectionError::ApplicationClosed(close)
        if CloseCode::of(close.error_code.into_inner()) == Some(CloseCode::Shutdown))
}

/// Answers pings and completes our own.
pub(in crate::comm) async fn serve_control(inner: Weak<Inner>, mut control: mpsc::Receiver<Incoming>) {
    while let Some(incoming) = control.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        match incoming.msg {
            PeerMsg::Ping { nonce } => {
                if let Some(link) = inner.route(incoming.from as usize) {
                    let link_msg = PeerMsg::Pong { nonce };
                    if let Err(e) = link.send(&link_msg, None).await {
                        tracing::debug!(peer = incoming.from, error = %e, "could not answer a ping");
                    }
                }
            }
            PeerMsg::Pong { nonce } => {
                if let Some(tx) = crate::sync::lock(&inner.pings).remove(&nonce) {
                    let _ = tx.send(());
                }
            }
            PeerMsg::Goodbye => {
                inner.health.said_goodbye(incoming.from as usize);
                inner.goodbyes.notify_waiters();
            }
            PeerMsg::Abort { comm, seq, reason } => {
                tracing::debug!(from = incoming.from, comm, seq, %reason, "a peer aborted a collective");
                inner.coll.abort(comm, seq, &reason);
            }
            PeerMsg::Registry { entries } => {
                inner.rpc.learn(incoming.from as usize, entries);
            }
            PeerMsg::Admit { comm, members } => {
                let members: Vec<usize> = members.into_iter().map(|m| m as usize).collect();
                if members.len() <= inner.links.capacity() && members.contains(&inner.rank) {
                    tracing::info!(
                        from = incoming.from,
                        comm,
                        world = members.len(),
                        "admitted to a grown communicator"
                    );
                    inner.growth.admitted_to(comm, members);
                } else {
                    tracing::warn!(from = incoming.from, "ignored an admission that does not name this rank");
                }
            }
            PeerMsg::Suspect { rank, reason } => inner.suspected(incoming.from as usize, rank as usize, reason),
            PeerMsg::Setup { tag: crate::transport::bulk::BULK_DOWN_TAG, body } => {
                if let Some(link) = inner.links.get(incoming.from as usize) {
                    // Answered with what this side carried, so both sides fail the same set.
                    link.bulk_slot().fail(crate::transport::bulk::decode_keys(&body));
                }
            }
            PeerMsg::Setup { tag, body } => inner.setup.put(incoming.from, tag, body),
            PeerMsg::WhereAreYou { nonce, comm } => inner.answer_position(incoming.from, nonce, comm).await,
            PeerMsg::Position { nonce, comm: _, active, last_started, last_completed } => {
                let mut positions = crate::sync::lock(&inner.positions);
                // Only the rank asked can answer.
                if positions.get(&nonce).is_some_and(|(asked, _)| *asked == incoming.from)
                    && let Some((_, tx)) = positions.remove(&nonce)
                {
                    let _ = tx.send(crate::trace::Answer::Position { active, last_started, last_completed });
                }
            }
            PeerMsg::ProbeFor { nonce, target, within_ms } => inner.answer_probe(
                incoming.from as usize,
                nonce,
                target as usize,
                std::time::Duration::from_millis(within_ms),
            ),
            PeerMsg::ProbeResult { nonce, target: _, alive, heard_ms } => {
                inner.probe_answered(incoming.from as usize, nonce, alive, heard_ms)
            }
            PeerMsg::P2p { .. }
            | PeerMsg::P2pSegment { .. }
            | PeerMsg::Coll { .. }
            | PeerMsg::RpcRequest { .. }
            | PeerMsg::RpcResponse { .. }
            | PeerMsg::Heartbeat
            | PeerMsg::Relay { .. } => {}
        }
    }
}
