//! Growing a communicator by workers that joined the running cluster through the seed.
//!
//! A new worker connects like any other ([`NexarClient::connect`]): the seed authenticates it,
//! gives it the next unused world rank and the current peer table, and it dials every live
//! rank. The members then call [`rebuild_adding`](NexarClient::rebuild_adding): the
//! communicator's rank 0 decides which joined ranks to add, tells the other members and
//! admits the new ranks, which receive the grown communicator from
//! [`admitted`](NexarClient::admitted).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::comm::client::NexarClient;
use crate::comm::membership::recovery::{RecoveryError, TAG_DECIDE};
use crate::comm::p2p::P2pError;
use crate::comm::state::CommState;
use crate::proto::message::PeerMsg;

/// How often waits for joining ranks re-check.
const POLL: Duration = Duration::from_millis(100);

impl NexarClient {
    /// Grows this communicator by the workers that have joined the running cluster, waiting
    /// (at most `join_timeout`) until at least `at_least` have. Every member must call it; the
    /// joined workers call [`admitted`](Self::admitted). The grown communicator keeps the
    /// members' ranks and numbers the new ranks after them, in the order of their world
    /// ranks. `min_world_size`/`max_world_size` bound the result.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// // One more worker was started with the cluster's token; take it in.
    /// let bigger = comm.rebuild_adding(1).await?;
    /// assert!(bigger.world_size() > comm.world_size());
    /// # Ok(()) }
    /// ```
    pub async fn rebuild_adding(&self, at_least: usize) -> Result<NexarClient, RecoveryError> {
        self.check_not_excluded()?;
        let (me, rank) = (self.comm.me, self.rank());
        let epoch = self.comm.next_recovery();
        let view_id = nexar_types::stable_id(&["grow", &self.comm.id.to_string(), &epoch.to_string()]).max(1);
        let view = self.with_comm(CommState::new(view_id, self.comm.members.clone(), me));
        let decision = if me == 0 {
            let joiners = match self.growth_joiners(at_least).await {
                Ok(j) => j,
                Err(e) => {
                    // Tell the members at once rather than let them wait for a decision.
                    self.tell_members(&view, Vec::new()).await;
                    return Err(e);
                }
            };
            let members: Vec<usize> = self.comm.members.iter().copied().chain(joiners.iter().copied()).collect();
            let listed: Vec<String> = members.iter().map(ToString::to_string).collect();
            let id =
                nexar_types::stable_id(&["grown", &self.comm.id.to_string(), &epoch.to_string(), &listed.join(",")]);
            let decision: Vec<u64> = std::iter::once(id.max(1)).chain(members.iter().map(|m| *m as u64)).collect();
            self.tell_members(&view, decision.clone()).await;
            let admit = PeerMsg::Admit { comm: id.max(1), members: members.iter().map(|m| *m as u32).collect() };
            for j in &joiners {
                if let Some(link) = self.inner.route(*j)
                    && let Err(e) = link.send(&admit, None).await
                {
                    tracing::warn!(rank, joiner = j, error = %e, "could not admit a joined rank");
                }
            }
            decision
        } else {
            self.receive_growth(&view).await?
        };
        let (id, members) = self.check_growth(&decision)?;
        self.wait_for_links(&members, "rebuild_adding").await?;
        self.inner.growth.admit(&members);
        tracing::info!(rank, world = members.len(), "communicator grown");
        Ok(self.with_comm(CommState::new(id, members, me)))
    }

    /// On a worker that joined a running cluster: waits (at most `join_timeout`) until the
    /// members take it into a communicator with
    /// [`rebuild_adding`](Self::rebuild_adding), and returns that communicator.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// let me = nexar::NexarClient::from_env().await?; // joins the running cluster
    /// let comm = me.admitted().await?;
    /// comm.barrier().await?;
    /// # Ok(()) }
    /// ```
    pub async fn admitted(&self) -> Result<NexarClient, RecoveryError> {
        let limit = self.config().join_timeout;
        let mut rx = self.inner.growth.admission();
        let (id, members) = match tokio::time::timeout(limit, rx.wait_for(Option::is_some)).await {
            Ok(Ok(admission)) => admission.clone().unwrap_or_default(),
            Ok(Err(_)) => return Err(RecoveryError::Closed { rank: self.inner.rank }),
            Err(_) => {
                let what = "admission to a communicator".to_string();
                return Err(RecoveryError::Timeout { rank: self.inner.rank, op: "admitted", what, after: limit });
            }
        };
        self.wait_for_links(&members, "admitted").await?;
        let me = members.iter().position(|m| *m == self.inner.rank).ok_or_else(|| RecoveryError::Excluded {
            rank: self.inner.rank,
            reason: "the admission does not name this rank".into(),
        })?;
        Ok(self.with_comm(CommState::new(id, members, me)))
    }

    /// The joined ranks to add, checked against the maximum world size.
    async fn growth_joiners(&self, at_least: usize) -> Result<Vec<usize>, RecoveryError> {
        let joiners = self.wait_for_joiners(at_least).await?;
        let (size, max) = (self.world_size() + joiners.len(), self.config().max_world_size);
        if size > max {
            let reason = format!("{size} ranks would exceed the maximum world size {max} (NEXAR_MAX_WORLD_SIZE)");
            return Err(RecoveryError::InvalidArgument { rank: self.rank(), op: "rebuild_adding", reason });
        }
        Ok(joiners)
    }

    /// Sends rank 0's growth decision (empty: it gave up) to every other member.
    async fn tell_members(&self, view: &NexarClient, decision: Vec<u64>) {
        let mut sends = JoinSet::new();
        for peer in 1..self.world_size() {
            let (view, decision) = (view.clone(), decision.clone());
            sends.spawn(async move { view.send(&decision, peer, TAG_DECIDE).await });
        }
        while sends.join_next().await.is_some() {}
    }

    /// Joined ranks that are connected, alive and not yet members, once there are `at_least`.
    async fn wait_for_joiners(&self, at_least: usize) -> Result<Vec<usize>, RecoveryError> {
        let limit = self.config().join_timeout;
        let start = Instant::now();
        loop {
            let notified = self.inner.growth.next_connection();
            let mut joiners: Vec<usize> = self
                .inner
                .growth
                .joiners()
                .into_iter()
                .filter(|j| !self.comm.members.contains(j) && !self.inner.health.is_dead(*j))
                .collect();
            joiners.sort_unstable();
            if joiners.len() >= at_least {
                return Ok(joiners);
            }
            if start.elapsed() >= limit {
                let what = format!("{at_least} new ranks joining (only {} did)", joiners.len());
                return Err(RecoveryError::Timeout { rank: self.rank(), op: "rebuild_adding", what, after: limit });
            }
            let _ = tokio::time::timeout(POLL, notified).await;
        }
    }

    /// A member's side: the decision from rank 0, which may wait up to `join_timeout` for
    /// joiners before it sends it.
    async fn receive_growth(&self, view: &NexarClient) -> Result<Vec<u64>, RecoveryError> {
        let limit = self.config().join_timeout + self.config().op_timeout;
        let start = Instant::now();
        loop {
            match view.recv_vec::<u64>(0, TAG_DECIDE).await {
                Ok(d) => return Ok(d),
                Err(P2pError::Timeout { .. }) if start.elapsed() < limit => continue,
                Err(P2pError::Closed { .. }) => return Err(RecoveryError::Closed { rank: self.rank() }),
                Err(e) => {
                    let what = format!("rank 0's growth decision ({e})");
                    return Err(RecoveryError::Timeout { rank: self.rank(), op: "rebuild_adding", what, after: limit });
                }
            }
        }
    }

    /// Validates a growth decision `[id, members...]`: the members are this communicator's,
    /// in order, followed by distinct ranks this rank has room for.
    fn check_growth(&self, decision: &[u64]) -> Result<(u64, Vec<usize>), RecoveryError> {
        let bad = |what: String| RecoveryError::Protocol { rank: self.rank(), peer: 0, what };
        let (&id, rest) = decision
            .split_first()
            .ok_or_else(|| bad("rank 0 gave up growing the communicator (see its error)".into()))?;
        let members: Vec<usize> = rest.iter().map(|m| usize::try_from(*m).unwrap_or(usize::MAX)).collect();
        let old = &self.comm.members;
        if members.len() < old.len() || members[..old.len()] != old[..] {
            return Err(bad("the growth decision does not keep the current members in order".into()));
        }
        let capacity = self.inner.links.capacity();
        let distinct: BTreeSet<usize> = members.iter().copied().collect();
        if distinct.len() != members.len() || members.iter().any(|m| *m >= capacity) {
            return Err(bad(format!("the growth decision lists duplicate ranks or ranks beyond {capacity}")));
        }
        Ok((id, members))
    }

    /// Waits (at most `mesh_timeout`) until this rank has a link to every other member.
    async fn wait_for_links(&self, members: &[usize], op: &'static str) -> Result<(), RecoveryError> {
        let limit = self.config().mesh_timeout;
        let start = Instant::now();
        loop {
            let notified = self.inner.growth.next_connection();
            let missing: Vec<usize> =
                members.iter().copied().filter(|m| *m != self.inner.rank && self.inner.route(*m).is_none()).collect();
            if missing.is_empty() {
                return Ok(());
            }
            if start.elapsed() >= limit {
                let what = format!("connections from ranks {missing:?}");
                return Err(RecoveryError::Timeout { rank: self.rank(), op, what, after: limit });
            }
            let _ = tokio::time::timeout(POLL, notified).await;
        }
    }
}
