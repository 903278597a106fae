//! Failure detection: heartbeats, the verdict that a peer is dead, and how the rest of the rank
//! learns of it ([`FailureWatch`](crate::comm::FailureWatch), failed receives, gossip to the other survivors).
//!
//! A peer is declared dead when its connection ends without a goodbye, when nothing at all
//! (heartbeat or any other message) has come from it for `heartbeat_timeout`, when another
//! rank reports it dead, or when the application says so
//! ([`report_failure`](NexarClient::report_failure)). Every survivor then cuts its connection
//! to the dead rank, so a rank that was only slow or partitioned away learns that it has been
//! excluded (once most of its peers have cut it) instead of carrying on with a different view
//! of the cluster. One peer's word excludes nobody: a rank cut by a minority counts those
//! peers as gone, and the survivors' agreement settles who stays.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use quinn::ConnectionError;

pub(crate) use crate::cluster::health::Health;
use crate::cluster::health::{PeerFailure, bounded};
use crate::comm::client::{Inner, NexarClient};
use crate::comm::membership::recovery::RecoveryError;
use crate::comm::membership::route::Route;
use crate::comm::state::CommState;
use crate::config::RecoveryPolicy;
use crate::proto::close::CloseCode;
use crate::proto::message::PeerMsg;

/// The longest gap between two liveness checks.
const MAX_CHECK_PERIOD: Duration = Duration::from_millis(250);

impl Inner {
    /// Rank `from` reports that world rank `rank` is dead. One report is not enough to evict a
    /// rank that this rank hears from, or a single faulty or hostile member could evict anyone:
    /// this rank pings it and declares it dead only if it does not answer. A rank this rank has
    /// not heard from lately either is declared dead at once. Either way the news is passed on,
    /// so it floods sparse topologies. A report about this rank itself is ignored: peers that
    /// declare it dead close their connections to it, which this rank does act on.
    pub(crate) fn suspected(self: &Arc<Self>, from: usize, rank: usize, reason: String) {
        if rank == self.rank {
            tracing::warn!(from, %reason, "ignored a report that this rank is dead");
            return;
        }
        if rank >= self.links.capacity() || self.health.is_dead(rank) {
            return;
        }
        let within = (2 * self.cfg.heartbeat_interval).min(self.cfg.heartbeat_timeout);
        // This rank's own evidence agrees: it has not heard from that rank for a while either,
        // or their connection is gone. Then the news is passed on at once. A rank with no direct
        // link here (sparse topologies) sends no heartbeats here, so its silence is no evidence:
        // it is pinged through the relays instead, so one member's word never evicts it.
        let direct = self.links.get(rank);
        let silent = if direct.is_some() { self.health.liveness.silent_for(rank) } else { Duration::ZERO };
        let closed = direct.is_some_and(|l| l.connection().close_reason().is_some());
        if silent > within || closed {
            let why =
                format!("rank {from} declared it dead ({reason}), and this rank has not heard from it for {silent:?}");
            self.peer_failed(rank, why, true, true);
            return;
        }
        if !self.health.start_check(rank) {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let Some(inner) = weak.upgrade() else { return };
            let answers = inner.peer_answers(rank, within).await;
            inner.health.end_check(rank);
            if answers {
                tracing::warn!(from, rank, %reason, "rank {from} reported rank {rank} dead, but it answers: ignored");
            } else {
                let why =
                    format!("rank {from} declared it dead ({reason}), and it did not answer a ping within {within:?}");
                inner.peer_failed(rank, why, true, true);
            }
        });
    }

    /// Whether world rank `peer` answers a ping over QUIC within `within`.
    pub(crate) async fn peer_answers(&self, peer: usize, within: Duration) -> bool {
        let Some(route) = self.route(peer) else { return false };
        let nonce: u64 = rand::random();
        let (tx, rx) = tokio::sync::oneshot::channel();
        crate::sync::lock(&self.pings).insert(nonce, tx);
        let answered = tokio::time::timeout(within, async {
            route.send(&PeerMsg::Ping { nonce }, None).await.is_ok() && rx.await.is_ok()
        })
        .await
        .unwrap_or(false);
        crate::sync::lock(&self.pings).remove(&nonce);
        answered
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
            let reason = format!(
                "it declared this rank dead and cut their link ({why}); {votes} of this rank's {peers} peers have, \
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

/// Sends heartbeats and declares silent peers dead, until the rank is gone.
pub(crate) async fn monitor(inner: Weak<Inner>, interval: Duration, timeout: Duration) {
    // Checks at least four times per timeout, so that a normal gap between checks is never
    // mistaken for this rank being stalled.
    let mut tick = tokio::time::interval(interval.min(MAX_CHECK_PERIOD).min(timeout / 4));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_beat: Option<Instant> = None;
    // Silence is counted from the moment the mesh is up, not from when this rank started.
    if let Some(inner) = inner.upgrade() {
        for link in inner.links.iter() {
            inner.health.liveness.heard(link.peer());
        }
    }
    let mut last_check = Instant::now();
    // Authenticated QUIC frames seen from each peer by the last check (see `frames_from`).
    let mut frames_seen: Vec<u64> = Vec::new();
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        if inner.health.is_shutting_down() {
            return;
        }
        // If this task itself was not scheduled for a long time (the process was paused,
        // swapped out, or starved of CPU), the silence is ours, not the peers': give them a
        // fresh window instead of declaring everyone dead.
        let gap = last_check.elapsed();
        last_check = Instant::now();
        if gap > timeout / 2 {
            tracing::warn!(rank = inner.rank, stalled = ?gap, "this rank was stalled; not judging peers on this check");
            for link in inner.links.iter() {
                inner.health.liveness.heard(link.peer());
            }
            continue;
        }
        if last_beat.is_none_or(|t| t.elapsed() >= interval) {
            last_beat = Some(Instant::now());
            for link in inner.links.iter() {
                // A full control lane is itself traffic the peer will count as life.
                let _ = link.try_send(&PeerMsg::Heartbeat);
            }
        }
        for link in inner.links.iter() {
            let peer = link.peer() as usize;
            // A heartbeat can wait behind a large message on a lossy connection (the
            // congestion window is the connection's); any frame the peer's QUIC stack sent
            // since the last check (an acknowledgement, stream data) shows it runs too.
            let frames = frames_from(link.connection());
            if frames_seen.len() <= peer {
                frames_seen.resize(peer + 1, 0);
            }
            if frames > std::mem::replace(&mut frames_seen[peer], frames) {
                inner.health.liveness.heard(peer as u32);
            }
            let silent = inner.health.liveness.silent_for(peer);
            if silent > timeout && !inner.health.is_dead(peer) && !inner.health.has_left(peer) {
                let reason = format!(
                    "nothing heard from it for {:.1} s (heartbeat timeout {} ms, NEXAR_HEARTBEAT_TIMEOUT_MS)",
                    silent.as_secs_f64(),
                    timeout.as_millis()
                );
                inner.peer_failed(peer, reason, true, true);
            }
        }
    }
}

/// Frames received on `conn` that prove the peer's QUIC stack is running: acknowledgements,
/// stream data and pings. quinn counts frames only once their packet decrypted, so a stranger
/// who knows the connection's id cannot fake them.
fn frames_from(conn: &quinn::Connection) -> u64 {
    let rx = conn.stats().frame_rx;
    rx.acks + rx.stream + rx.ping
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
