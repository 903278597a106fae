//! Agreeing on the failure set and rebuilding a communicator without the failed ranks.
//!
//! The agreement runs on point-to-point messages of a private communicator made for it. The
//! lowest-numbered rank not in the failure set coordinates: every other survivor sends it the
//! ranks it believes failed, the coordinator takes the union (adding any rank that fails while
//! it waits), and sends the decision to everyone. A survivor whose coordinator fails moves on
//! to the next lowest rank with the coordinator added to its set; a rank that has decided
//! sends its decision on to every survivor still deciding, which adopts it. Every survivor therefore leaves with the same set,
//! which contains every failure any survivor reported, and builds the same communicator from
//! it: the remaining members, in their old order, numbered densely from 0.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use tokio::task::JoinSet;

use super::client::NexarClient;
use super::p2p::P2pError;
pub use super::recovery_error::RecoveryError;
use super::state::CommState;

/// Tag of a survivor's proposal on the agreement communicator.
const TAG_PROPOSE: u64 = 1;
/// Failed ranks of the agreement, each with the rank that named it (the first to, at the
/// coordinator), so that an excluded rank learns who cut it whatever order messages arrive in.
type FailureSet = BTreeMap<usize, usize>;

/// Tag of the coordinator's decision.
pub(super) const TAG_DECIDE: u64 = 2;

impl NexarClient {
    /// Agrees with the other survivors on which ranks of this communicator have failed and
    /// returns a new communicator without them, with dense ranks (the survivors in their old
    /// order, numbered from 0). Every survivor must call it; ranks declared dead need not. The
    /// old communicator stays as it was (its collectives with failed ranks keep failing).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn step(comm: NexarClient, grads: &mut [f32]) -> Result<NexarClient, NexarError> {
    /// match comm.all_reduce(grads, Sum).await {
    ///     Ok(()) => Ok(comm),
    ///     Err(e) => {
    ///         eprintln!("{e}; rebuilding");
    ///         Ok(comm.recover().await?)
    ///     }
    /// }
    /// # }
    /// ```
    pub async fn recover(&self) -> Result<NexarClient, RecoveryError> {
        self.rebuild_excluding(&[]).await
    }

    /// Like [`recover`](Self::recover), also leaving out `ranks` (ranks of this communicator):
    /// a way to shrink by choice. A rank named here that calls it gets
    /// [`RecoveryError::Excluded`]. The agreed set is the union of what every survivor names
    /// and every failure any of them has seen.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// // Retire the last rank.
    /// match comm.rebuild_excluding(&[comm.world_size() - 1]).await {
    ///     Ok(smaller) => assert_eq!(smaller.world_size(), comm.world_size() - 1),
    ///     Err(nexar::RecoveryError::Excluded { .. }) => return Ok(()), // this was the last rank
    ///     Err(e) => return Err(e.into()),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn rebuild_excluding(&self, ranks: &[usize]) -> Result<NexarClient, RecoveryError> {
        let (epoch, failed) = self.agree(ranks, "rebuild_excluding").await?;
        let members: Vec<usize> =
            self.comm.members.iter().enumerate().filter(|(r, _)| !failed.contains(r)).map(|(_, w)| *w).collect();
        let min = self.config().min_world_size;
        if members.len() < min {
            return Err(RecoveryError::TooFew { rank: self.rank(), survivors: members.len(), min });
        }
        let me = members.iter().position(|w| *w == self.inner.rank).ok_or_else(|| RecoveryError::Excluded {
            rank: self.rank(),
            reason: "the agreed failure set contains this rank".into(),
        })?;
        let set: Vec<String> = failed.iter().map(ToString::to_string).collect();
        let id = nexar_types::stable_id(&["rebuilt", &self.comm.id.to_string(), &epoch.to_string(), &set.join(",")]);
        tracing::info!(rank = self.rank(), ?failed, new_world = members.len(), "communicator rebuilt");
        Ok(self.with_comm(CommState::new(id.max(1), members, me)))
    }

    /// Agrees with the other survivors on the failed ranks of this communicator, adding
    /// `also` to this rank's proposal, and returns the agreed set (ranks of this communicator,
    /// ascending). Every survivor must call it.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let failed = comm.agree_failures(&[]).await?;
    /// println!("the survivors agree that {failed:?} failed");
    /// # Ok(()) }
    /// ```
    pub async fn agree_failures(&self, also: &[usize]) -> Result<Vec<usize>, RecoveryError> {
        Ok(self.agree(also, "agree_failures").await?.1.into_iter().collect())
    }

    /// The agreement protocol (see the module docs). Returns the agreement's number on this
    /// communicator and the agreed set.
    async fn agree(&self, also: &[usize], op: &'static str) -> Result<(u64, BTreeSet<usize>), RecoveryError> {
        let (me, world) = (self.rank(), self.world_size());
        if let Some(bad) = also.iter().find(|r| **r >= world) {
            let reason = format!("rank {bad} is outside this {world}-rank communicator");
            return Err(RecoveryError::InvalidArgument { rank: me, op, reason });
        }
        self.check_not_excluded()?;
        let epoch = self.comm.next_recovery();
        let id = nexar_types::stable_id(&["agree", &self.comm.id.to_string(), &epoch.to_string()]).max(1);
        let view = self.with_comm(CommState::new(id, self.comm.members.clone(), me));
        let mut set: FailureSet = also.iter().copied().chain(self.failed_ranks()).map(|r| (r, me)).collect();
        let mut decided_by = None;
        let decided = loop {
            self.check_not_excluded()?;
            let Some(coordinator) = (0..world).find(|r| !set.contains_key(r)) else { break set };
            if coordinator == me {
                break self.coordinate(&view, set).await?;
            }
            if view.send(&encode(&set), coordinator, TAG_PROPOSE).await.is_err() {
                set.insert(coordinator, me);
                continue;
            }
            match view.recv_vec::<u32>(coordinator, TAG_DECIDE).await {
                Ok(decision) => {
                    decided_by = Some(coordinator);
                    break decode(&decision, world, coordinator, me)?;
                }
                Err(P2pError::Closed { .. }) => return Err(RecoveryError::Closed { rank: me }),
                Err(e) => {
                    tracing::debug!(rank = me, coordinator, error = %e, "agreement coordinator lost; moving on");
                    self.absent_from_agreement(coordinator, &e);
                    set.insert(coordinator, me);
                }
            }
        };
        self.check_not_excluded()?;
        if let Some(named_by) = decided.get(&me) {
            let mut reason = format!("the survivors agreed to leave it out (rank {named_by} named it failed)");
            let cut_by = self.inner.health.declared_me_dead();
            if !cut_by.is_empty() {
                reason = format!("{reason}; before that, {}", cut_by.join("; "));
            }
            return Err(RecoveryError::Excluded { rank: me, reason });
        }
        if let Some(coordinator) = decided_by {
            // A coordinator has told everyone already (`announce`).
            pass_on(view, &decided, coordinator);
        }
        Ok((epoch, decided.into_keys().collect()))
    }

    /// A rank that did not answer within `op_timeout` is declared dead, so that every survivor
    /// counts it out, not only this one.
    fn absent_from_agreement(&self, peer: usize, error: &P2pError) {
        if let P2pError::Timeout { after, .. } = error {
            let world_peer = self.comm.members[peer];
            let reason = format!("took no part in the failure agreement within {after:?} (NEXAR_OP_TIMEOUT_MS)");
            self.inner.peer_failed(world_peer, reason, true, true);
        }
    }

    /// Collects every other survivor's proposal, then sends everyone the union. A decision
    /// that reaches it meanwhile (from a rank whose coordinator failed after telling it) is
    /// adopted and passed on instead, so that every survivor leaves with the same set.
    async fn coordinate(&self, view: &NexarClient, mut set: FailureSet) -> Result<FailureSet, RecoveryError> {
        let (me, world) = (self.rank(), self.world_size());
        let mut waits = JoinSet::new();
        let mut pending = HashMap::new();
        for peer in (0..world).filter(|r| *r != me && !set.contains_key(r)) {
            let view = view.clone();
            let handle = waits.spawn(async move { (peer, view.recv_vec::<u32>(peer, TAG_PROPOSE).await) });
            pending.insert(peer, handle);
        }
        let mut decisions = JoinSet::new();
        for peer in (0..world).filter(|r| *r != me) {
            let view = view.clone();
            decisions.spawn(async move { (peer, view.recv_vec::<u32>(peer, TAG_DECIDE).await) });
        }
        let mut adopted = None;
        while !pending.is_empty() && adopted.is_none() {
            tokio::select! {
                Some(joined) = waits.join_next() => {
                    let Ok((peer, result)) = joined else { continue };
                    if pending.remove(&peer).is_none() {
                        continue;
                    }
                    match result {
                        Ok(proposal) => {
                            // The proposer is the one naming these ranks, whatever it wrote.
                            for failed in decode(&proposal, world, peer, me)?.into_keys() {
                                set.entry(failed).or_insert(peer);
                            }
                        }
                        Err(P2pError::Closed { .. }) => return Err(RecoveryError::Closed { rank: me }),
                        Err(e) => {
                            tracing::debug!(rank = me, peer, error = %e, "no proposal; counting it failed");
                            self.absent_from_agreement(peer, &e);
                            set.insert(peer, me);
                        }
                    }
                    // Stop waiting for ranks someone else reported failed.
                    pending.retain(|peer, handle| {
                        let keep = !set.contains_key(peer);
                        if !keep {
                            handle.abort();
                        }
                        keep
                    });
                }
                Some(Ok((peer, Ok(decision)))) = decisions.join_next() => {
                    tracing::debug!(rank = me, peer, "adopting a decision made before this rank coordinated");
                    adopted = Some(decode(&decision, world, peer, me)?);
                }
            }
        }
        waits.abort_all();
        decisions.abort_all();
        // A coordinator the others have cut off must not speak for them.
        self.check_not_excluded()?;
        let set = adopted.unwrap_or(set);
        announce(view, &set).await;
        Ok(set)
    }

    pub(super) fn check_not_excluded(&self) -> Result<(), RecoveryError> {
        match self.inner.health.excluded() {
            Some(reason) => Err(RecoveryError::Excluded { rank: self.rank(), reason }),
            None => Ok(()),
        }
    }
}

/// Sends the decision to every other member still connected (excluded ones learn from it).
async fn announce(view: &NexarClient, set: &FailureSet) {
    let decision = encode(set);
    let mut sends = JoinSet::new();
    for peer in (0..view.world_size()).filter(|r| *r != view.rank()) {
        if view.link(peer).is_some_and(|r| r.first_hop().connection().close_reason().is_none()) {
            let (view, decision) = (view.clone(), decision.clone());
            sends.spawn(async move { view.send(&decision, peer, TAG_DECIDE).await });
        }
    }
    while sends.join_next().await.is_some() {}
}

/// After deciding: sends the decision to every other survivor but the coordinator it came
/// from, at once. A survivor still deciding then finds it whichever way its agreement went on:
/// as the answer of a coordinator it turned to after its own failed (or that it wrongly took
/// for failed, on a loaded machine), or, if it coordinates itself, as a decision to adopt (so
/// it does not wait for proposals from ranks that have already decided). Every decided rank
/// holds the one decision, so every survivor leaves with the same set. A copy that nobody
/// waits for stays in this agreement's private communicator.
fn pass_on(view: NexarClient, decided: &FailureSet, decided_by: usize) {
    let decision = encode(decided);
    let undecided =
        (0..view.world_size()).filter(|r| *r != view.rank() && !decided.contains_key(r) && *r != decided_by);
    for peer in undecided {
        let (view, decision) = (view.clone(), decision.clone());
        tokio::spawn(async move {
            let _ = view.send(&decision, peer, TAG_DECIDE).await;
        });
    }
}

/// A failure set on the wire: pairs of (failed rank, rank that named it).
fn encode(set: &FailureSet) -> Vec<u32> {
    set.iter().flat_map(|(failed, by)| [*failed as u32, *by as u32]).collect()
}

/// Validates a failure set received from `peer`.
fn decode(words: &[u32], world: usize, peer: usize, me: usize) -> Result<FailureSet, RecoveryError> {
    let invalid = |what: String| RecoveryError::Protocol { rank: me, peer, what };
    if !words.len().is_multiple_of(2) || words.len() / 2 > world {
        return Err(invalid(format!(
            "{} words for (rank, named by) pairs in a {world}-rank communicator",
            words.len()
        )));
    }
    let rank = |w: u32| match w as usize {
        r if r < world => Ok(r),
        r => Err(invalid(format!("rank {r} in a {world}-rank communicator"))),
    };
    words.chunks_exact(2).map(|pair| Ok((rank(pair[0])?, rank(pair[1])?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn received_sets_are_validated() {
        let set = FailureSet::from([(0, 1), (2, 1)]);
        assert_eq!(decode(&encode(&set), 3, 1, 0).unwrap(), set);
        assert!(decode(&[5, 0], 3, 1, 0).unwrap_err().to_string().contains("rank 5 in a 3-rank"));
        assert!(decode(&[0, 7], 3, 1, 0).unwrap_err().to_string().contains("rank 7 in a 3-rank"));
        assert!(decode(&[0], 3, 1, 0).is_err(), "an odd number of words");
        assert!(decode(&[0, 0, 1, 0, 2, 0, 0, 0], 3, 1, 0).is_err(), "more pairs than ranks");
    }
}
