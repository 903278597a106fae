//! The verdict that a peer is dead, and how the rest of the rank learns of it
//! ([`FailureWatch`](crate::comm::FailureWatch), failed receives, gossip to the other survivors).
//!
//! A peer is declared dead on evidence: its connection ends without a goodbye, it stays
//! silent past what its rhythm allows and then answers neither this rank's ping nor probes
//! through others (`monitor.rs`, `probe.rs`), or the application says so
//! ([`report_failure`](NexarClient::report_failure)). Another rank's report only starts the
//! probes. Every survivor then cuts its connection to the dead rank, so a rank that was only
//! slow or partitioned away learns that it has been excluded (once most of its peers have cut
//! it) instead of carrying on with a different view of the cluster. One peer's word excludes
//! nobody: a rank cut by a minority counts those peers as gone, and the survivors' agreement
//! settles who stays.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use quinn::ConnectionError;

pub(crate) use crate::cluster::health::Health;
use crate::cluster::health::{PeerFailure, bounded};
use crate::comm::client::{Inner, NexarClient};
use crate::comm::membership::probe::Cause;
use crate::comm::membership::recovery::RecoveryError;
use crate::comm::membership::route::Route;
use crate::comm::state::CommState;
use crate::config::RecoveryPolicy;
use crate::proto::close::CloseCode;
use crate::proto::message::PeerMsg;

impl Inner {
    /// Rank `from` reports that world rank `rank` is dead. A report is not evidence, or a
    /// single faulty or hostile member could evict anyone, and one rank's short silence added
    /// to another's word made chains of hearsay: this rank probes `rank` itself, directly and
    /// through others, and declares it dead only if nobody can reach it (`probe.rs`). A closed
    /// connection is evidence of its own. A report about this rank itself is refuted with
    /// heartbeats to everyone.
    pub(crate) fn suspected(self: &Arc<Self>, from: usize, rank: usize, reason: String) {
        if rank == self.rank {
            tracing::debug!(from, %reason, "a report that this rank is dead");
            self.refute(from);
            return;
        }
        if rank >= self.links.capacity() || self.health.is_dead(rank) {
            return;
        }
        tracing::debug!(from, rank, %reason, "a peer reported a rank dead; probing it");
        if let Some(closed) = self.links.get(rank).and_then(|l| l.connection().close_reason()) {
            // Its own words where it said goodbye ("… dropped its client without calling
            // shutdown()"), not only the report.
            let why = format!("its connection ended ({closed}), and rank {from} reported it unresponsive");
            self.peer_failed(rank, why, true, true);
            return;
        }
        self.investigate(rank, Cause::Reported { by: from });
    }

    /// Declares world rank `peer` dead for `reason`: pending and later receives from it fail,
    /// its connection is cut (when `cut`), the other peers are told (when `gossip`), the
    /// application's watchers are woken, and the recovery policy applies. Idempotent.
    pub(crate) fn peer_failed(&self, peer: usize, reason: String, cut: bool, gossip: bool) {
        if peer == self.rank || peer >= self.links.capacity() {
            return;
        }
        let reason = bounded(reason);
        if self.health.excluded().is_some() {
            // This rank is out of the cluster; what it sees is no longer news for anyone.
            self.mailbox.source_gone(peer as u32, &reason);
            self.coll.source_gone(peer as u32, &reason);
            return;
        }
        let failure = PeerFailure { rank: peer, reason: reason.clone(), detected_at: Instant::now() };
        if !self.health.declare_dead(failure.clone()) {
            return;
        }
        tracing::warn!(rank = self.rank, peer, %reason, "peer declared dead");
        self.mailbox.source_gone(peer as u32, &reason);
        self.coll.source_gone(peer as u32, &reason);
        if let Some(link) = self.links.get(peer) {
            // Its bulk channel (if any) can carry nothing more; the collectives it carried fail
            // for the death (above, and as they meet it), not as a lost link.
            link.bulk_slot().retire();
        }
        if cut && let Some(link) = self.links.get(peer) {
            link.close(CloseCode::DeclaredDead, &format!("rank {} declared rank {peer} dead: {reason}", self.rank));
        }
        if gossip {
            let msg = PeerMsg::Suspect { rank: peer as u32, reason };
            for link in self.links.iter().filter(|l| !self.health.is_dead(l.peer() as usize)) {
                if !link.try_send(&msg) {
                    tracing::debug!(peer = link.peer(), "control lane full; the failure report waits for the next one");
                }
            }
        }
        self.health.publish(failure.clone());
        // A worker that joined but was never taken into a communicator is nobody's member.
        let member = peer < self.initial_world || self.growth.is_admitted(peer);
        if self.cfg.recovery_policy == RecoveryPolicy::Abort && member {
            self.abort_all(&format!("rank {peer} failed ({}); recovery policy is abort", failure.reason));
        }
    }

    /// Resolves, with the reason, once world rank `peer` is declared dead.
    pub(crate) async fn wait_dead(&self, peer: usize) -> String {
        let mut events = self.health.subscribe();
        loop {
            let reason = events.borrow_and_update().iter().find(|f| f.rank == peer).map(|f| f.reason.clone());
            if let Some(reason) = reason {
                return reason;
            }
            if events.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Resolves, with the reason, once `route` can no longer deliver: its direct connection
    /// closed, or its relayed destination was declared dead.
    pub(crate) async fn route_lost(&self, route: &Route<'_>) -> String {
        match route {
            Route::Direct(link) => link.connection().closed().await.to_string(),
            Route::Relay { dst, .. } => self.wait_dead(*dst as usize).await,
        }
    }

    /// Records that the other ranks (the latest: `by`) declared this one dead, for `why`:
    /// this rank leaves everyone, so that no peer keeps it in its view of the cluster.
    pub(crate) fn excluded_by(&self, by: usize, why: &str) {
        let why = bounded(why.to_string());
        let first = self.health.exclude(&why);
        if first {
            tracing::warn!(rank = self.rank, %why, "this rank was excluded from the cluster");
        }
        self.mailbox.source_gone(by as u32, &why);
        self.coll.source_gone(by as u32, &why);
        if first {
            for link in self.links.iter() {
                link.close(CloseCode::Excluded, &format!("rank {} was excluded and leaves: {why}", self.rank));
            }
        }
        self.health.wake();
    }

    /// `peer` cut its link to this rank, declaring this rank dead, for `why`. One peer's word
    /// does not exclude a rank (a faulty or hostile member could evict anyone that way): this
    /// rank leaves only once most of its direct peers have cut it, as they all do when this
    /// rank really was stalled or cut off. Until then it counts `peer` as gone (their link is
    /// gone either way) and tells the others, who check `peer` for themselves.
    fn declared_dead_by(&self, peer: usize, why: &str) {
        let cut = self.health.cut_by(peer, why, self.links.iter().map(|l| l.peer() as usize));
        let (votes, peers) = (cut.votes, cut.peers);
        if cut.excludes() {
            self.excluded_by(peer, &format!("{why} ({votes} of this rank's {peers} peers cut it)"));
        } else {
            tracing::warn!(rank = self.rank, peer, %why, votes, peers, "a peer cut this rank; not a majority, so this rank stays");
            // Its reason is in the log above; the verdict is this rank's own, in one sentence.
            let reason = format!(
                "it declared this rank dead and cut their link; {votes} of this rank's {peers} peers have, \
                 not a majority, so this rank stays and counts rank {peer} as gone"
            );
            self.peer_failed(peer, reason, false, true);
        }
    }

    /// Judges how a peer's connection ended; `violation` is the wire-protocol violation this
    /// rank closed it for, if it did.
    pub(crate) fn connection_ended(&self, peer: usize, reason: &ConnectionError, violation: Option<&str>) {
        let orderly = self.health.ends_in_order(peer);
        let why = match violation {
            Some(v) => format!("this rank cut it for breaking the wire protocol: {v}"),
            None => format!("its connection ended ({reason})"),
        };
        if orderly {
            self.mailbox.source_gone(peer as u32, &why);
            self.coll.source_gone(peer as u32, &why);
            return;
        }
        match reason {
            ConnectionError::ApplicationClosed(close)
                if CloseCode::of(close.error_code.into_inner()) == Some(CloseCode::DeclaredDead) =>
            {
                self.declared_dead_by(peer, &String::from_utf8_lossy(&close.reason));
            }
            ConnectionError::ApplicationClosed(close)
                if CloseCode::of(close.error_code.into_inner()) == Some(CloseCode::Excluded) =>
            {
                self.peer_failed(peer, String::from_utf8_lossy(&close.reason).into_owned(), false, true);
            }
            // Closed here: after declaring it dead (then this does nothing), or because it broke
            // the wire protocol.
            _ => self.peer_failed(peer, why, false, true),
        }
    }
}

/// Under [`RecoveryPolicy::Automatic`]: after each failure, agree and rebuild the current
/// communicator (the world first, then each rebuilt one) and publish the result.
pub(crate) async fn recover_automatically(inner: Weak<Inner>, mut current: Arc<CommState>) {
    // Subscribed and marked changed before the task first waits: a failure seen before this
    // task ever ran (a busy machine) is still handled.
    let Some(mut events) = inner.upgrade().map(|i| i.health.subscribe()) else { return };
    events.mark_changed();
    loop {
        if events.changed().await.is_err() {
            return;
        }
        let Some(strong) = inner.upgrade() else { return };
        let dead = strong.health.dead();
        if !current.members.iter().any(|m| dead.contains(m)) && strong.health.excluded().is_none() {
            continue;
        }
        // Let reports of simultaneous failures arrive, so one rebuild covers them all.
        tokio::time::sleep(Duration::from_millis(50)).await;
        events.borrow_and_update();
        // Only while the program still holds the rank: a rebuild is for its handles.
        let Some(user) = strong.user.get().and_then(std::sync::Weak::upgrade) else { return };
        let client = NexarClient { user, inner: strong.clone(), comm: current.clone() };
        let result = client.recover().await.map(|c| c.comm);
        if let Ok(comm) = &result {
            current = comm.clone();
        }
        // Excluded or shut down: nothing more to rebuild. Other errors (a timeout) may pass:
        // try again at the next failure.
        let stop = matches!(result, Err(RecoveryError::Excluded { .. } | RecoveryError::Closed { .. }));
        strong.rebuilt.send_modify(|(n, slot)| {
            *n += 1;
            *slot = Some(result);
        });
        if stop {
            return;
        }
    }
}
