//! Agreeing on the failure set and rebuilding a communicator without the failed ranks.
//!
//! The agreement runs on point-to-point messages of a private communicator made for it. The
//! lowest-numbered rank not in the failure set coordinates: every other survivor sends it the
//! ranks it believes failed, the coordinator takes the union (adding any rank that fails while
//! it waits), and sends the decision to everyone. A survivor whose coordinator fails moves on
//! to the next lowest rank with the coordinator added to its set; a rank that has decided
//! sends its decision on to every other rank still reachable, which adopts it if it is still
//! deciding. Every survivor therefore leaves with the same set, which contains every failure
//! any survivor reported, and builds the same communicator from it: the remaining members, in
//! their old order, numbered densely from 0.
//!
//! A rank that one peer cut (declaring it dead) while the others still hold it alive counts
//! that peer as gone, but says so as a *cut*, not as a failure it saw: the decision leaves out
//! the rank that was cut, unless some survivor saw the cutter itself fail. So whichever
//! proposal reaches the coordinator first, the accuser's word wins, as it does when the
//! accused rank coordinates.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use tokio::task::JoinSet;

use crate::comm::client::NexarClient;
pub use crate::comm::membership::recovery_error::RecoveryError;
use crate::comm::p2p::P2pError;
use crate::comm::state::CommState;

/// Tag of a survivor's proposal on the agreement communicator.
const TAG_PROPOSE: u64 = 1;
/// Failed ranks of the agreement, each with the rank that named it (the first to, at the
/// coordinator), so that an excluded rank learns who cut it whatever order messages arrive in.
type FailureSet = BTreeMap<usize, usize>;

/// What a rank brings to the agreement, or what a coordinator has gathered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Namings {
    /// Ranks seen failed (or named by the application), each with who named it.
    failed: FailureSet,
    /// `(cutter, victim)`: `cutter` cut its link to `victim`, declaring it dead, and `victim`
    /// counts `cutter` as gone only for that.
    cuts: BTreeSet<(usize, usize)>,
}

impl Namings {
    /// Whether rank `me` expects nothing from `peer` in the agreement: it names `peer` failed,
    /// or `peer` cut it.
    fn out_of_reach(&self, peer: usize, me: usize) -> bool {
        self.failed.contains_key(&peer) || self.cuts.contains(&(peer, me))
    }

    /// Takes in `peer`'s proposal. The proposer is the one naming these ranks, and the one
    /// cut, whatever it wrote.
    fn take_proposal(&mut self, proposal: Namings, peer: usize) {
        for failed in proposal.failed.into_keys() {
            self.failed.entry(failed).or_insert(peer);
        }
        self.cuts.extend(proposal.cuts.into_iter().map(|(cutter, _)| (cutter, peer)));
    }

    /// The decision: every rank named failed, and the rank cut in every cut whose cutter
    /// nobody names failed (its word against the rank it cut stands; the cut rank counting it
    /// gone is no evidence).
    fn decide(self) -> FailureSet {
        let mut decided = self.failed.clone();
        for (cutter, victim) in self.cuts {
            if !self.failed.contains_key(&cutter) {
                decided.entry(victim).or_insert(cutter);
            }
        }
        decided
    }
}

/// Tag of the coordinator's decision.
pub(in crate::comm) const TAG_DECIDE: u64 = 2;

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
        let mut set = self.own_namings(also);
        let mut decided_by = None;
        let decided = loop {
            self.check_not_excluded()?;
            let Some(coordinator) = (0..world).find(|r| !set.out_of_reach(*r, me)) else { break set.decide() };
            if coordinator == me {
                break self.coordinate(&view, set).await?;
            }
            if view.send(&encode(&set), coordinator, TAG_PROPOSE).await.is_err() {
                self.count_lost(&mut set, coordinator).await;
                continue;
            }
            match view.recv_vec::<u32>(coordinator, TAG_DECIDE).await {
                Ok(decision) => {
                    decided_by = Some(coordinator);
                    break decode(&decision, world, coordinator, me)?.decide();
                }
                Err(P2pError::Closed { .. }) => return Err(RecoveryError::Closed { rank: me }),
                Err(e) => {
                    tracing::debug!(rank = me, coordinator, error = %e, "agreement coordinator lost; moving on");
                    self.absent_from_agreement(coordinator, &e);
                    self.count_lost(&mut set, coordinator).await;
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

    /// What this rank brings to the agreement: `also` and every peer it counts as dead,
    /// named failed, except the peers it counts as gone only because they cut it, which it
    /// brings as cuts.
    fn own_namings(&self, also: &[usize]) -> Namings {
        let me = self.rank();
        let mut namings = Namings::default();
        for rank in self.failed_ranks() {
            if self.inner.health.gone_for_cutting(self.comm.members[rank]) {
                namings.cuts.insert((rank, me));
            } else {
                namings.failed.insert(rank, me);
            }
        }
        namings.failed.extend(also.iter().map(|r| (*r, me)));
        namings
    }

    /// Counts `peer`, lost to this rank during the agreement, in `set`: as a cut when it cut
    /// this rank (declaring it dead), as failed otherwise. A lost link is followed by this
    /// rank's verdict on the peer, which tells the two apart; it waits for that verdict, at most
    /// a heartbeat timeout.
    async fn count_lost(&self, set: &mut Namings, peer: usize) {
        let world_peer = self.comm.members[peer];
        let verdict = self.inner.wait_dead(world_peer);
        if tokio::time::timeout(self.config().heartbeat_timeout, verdict).await.is_ok()
            && self.inner.health.gone_for_cutting(world_peer)
        {
            set.cuts.insert((peer, self.rank()));
        } else {
            set.failed.insert(peer, self.rank());
        }
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
    async fn coordinate(&self, view: &NexarClient, mut set: Namings) -> Result<FailureSet, RecoveryError> {
        let (me, world) = (self.rank(), self.world_size());
        let mut waits = JoinSet::new();
        let mut pending = HashMap::new();
        for peer in (0..world).filter(|r| *r != me && !set.out_of_reach(*r, me)) {
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
                        Ok(proposal) => set.take_proposal(decode(&proposal, world, peer, me)?, peer),
                        Err(P2pError::Closed { .. }) => return Err(RecoveryError::Closed { rank: me }),
                        Err(e) => {
                            tracing::debug!(rank = me, peer, error = %e, "no proposal; counting it failed");
                            self.absent_from_agreement(peer, &e);
                            self.count_lost(&mut set, peer).await;
                        }
                    }
                    // Stop waiting for ranks someone else reported failed (not for a rank
                    // only said to have cut another: it is alive, and its word counts).
                    pending.retain(|peer, handle| {
                        let keep = !set.failed.contains_key(peer);
                        if !keep {
                            handle.abort();
                        }
                        keep
                    });
                }
                // Matched inside, not in the pattern: a pattern that fails to match (a failed
                // rank's receive ends at once) would disable this branch until the select ends,
                // and the select may wait on ranks that will never propose to this one.
                Some(joined) = decisions.join_next() => {
                    if let Ok((peer, Ok(decision))) = joined {
                        tracing::debug!(rank = me, peer, "adopting a decision made before this rank coordinated");
                        adopted = Some(decode(&decision, world, peer, me)?.decide());
                    }
                }
            }
        }
        waits.abort_all();
        decisions.abort_all();
        // A coordinator the others have cut off must not speak for them.
        self.check_not_excluded()?;
        let decided = adopted.unwrap_or_else(|| set.decide());
        announce(view, &decided).await;
        Ok(decided)
    }

    pub(in crate::comm) fn check_not_excluded(&self) -> Result<(), RecoveryError> {
        match self.inner.health.excluded() {
            Some(reason) => Err(RecoveryError::Excluded { rank: self.rank(), reason }),
            None => Ok(()),
        }
    }
}

/// The other members of `view` this rank is still connected to (some may be in the failure
/// set: excluded ranks learn of it from the decision).
fn reachable(view: &NexarClient) -> impl Iterator<Item = usize> + '_ {
    (0..view.world_size()).filter(|peer| {
        *peer != view.rank() && view.link(*peer).is_some_and(|r| r.first_hop().connection().close_reason().is_none())
    })
}

/// Sends the decision to every other member still connected.
async fn announce(view: &NexarClient, decided: &FailureSet) {
    let decision = encode_decision(decided);
    let mut sends = JoinSet::new();
    for peer in reachable(view) {
        let (view, decision) = (view.clone(), decision.clone());
        sends.spawn(async move { view.send(&decision, peer, TAG_DECIDE).await });
    }
    while sends.join_next().await.is_some() {}
}

/// After deciding: sends the decision to every other rank still connected but the coordinator
/// it came from, at once. A survivor still deciding then finds it whichever way its agreement went on:
/// as the answer of a coordinator it turned to after its own failed (or that it wrongly took
/// for failed, on a loaded machine), or, if it coordinates itself, as a decision to adopt (so
/// it does not wait for proposals from ranks that have already decided). Every decided rank
/// holds the one decision, so every survivor leaves with the same set. A rank the decision
/// leaves out learns it the same way, even one that coordinates in vain because the
/// coordinator cut it. A copy that nobody waits for stays in this agreement's private
/// communicator.
fn pass_on(view: NexarClient, decided: &FailureSet, decided_by: usize) {
    let decision = encode_decision(decided);
    let others: Vec<usize> = reachable(&view).filter(|peer| *peer != decided_by).collect();
    for peer in others {
        let (view, decision) = (view.clone(), decision.clone());
        tokio::spawn(async move {
            let _ = view.send(&decision, peer, TAG_DECIDE).await;
        });
    }
}

/// Wire code of a [`Namings::failed`] entry: (failed rank, rank that named it).
const FAILED: u32 = 0;
/// Wire code of a [`Namings::cuts`] entry: (cutter, rank it cut).
const CUT: u32 = 1;

/// Namings on the wire: triples of (rank, rank, kind).
fn encode(namings: &Namings) -> Vec<u32> {
    let mut words = encode_decision(&namings.failed);
    words.extend(namings.cuts.iter().flat_map(|(cutter, victim)| [*cutter as u32, *victim as u32, CUT]));
    words
}

/// A decision on the wire: namings with only failed entries.
fn encode_decision(decided: &FailureSet) -> Vec<u32> {
    decided.iter().flat_map(|(failed, by)| [*failed as u32, *by as u32, FAILED]).collect()
}

/// Validates namings received from `peer`: whole triples, ranks inside the communicator,
/// known kinds, and no more entries than a rank can name (each rank failed once, and each
/// rank cutting at most once, in a `world`-rank communicator).
fn decode(words: &[u32], world: usize, peer: usize, me: usize) -> Result<Namings, RecoveryError> {
    let invalid = |what: String| RecoveryError::Protocol { rank: me, peer, what };
    if !words.len().is_multiple_of(3) || words.len() / 3 > 2 * world {
        return Err(invalid(format!(
            "{} words for (rank, rank, kind) triples in a {world}-rank communicator",
            words.len()
        )));
    }
    let rank = |w: u32| match w as usize {
        r if r < world => Ok(r),
        r => Err(invalid(format!("rank {r} in a {world}-rank communicator"))),
    };
    let mut namings = Namings::default();
    for triple in words.chunks_exact(3) {
        let (a, b) = (rank(triple[0])?, rank(triple[1])?);
        match triple[2] {
            FAILED => {
                namings.failed.insert(a, b);
            }
            CUT => {
                namings.cuts.insert((a, b));
            }
            kind => return Err(invalid(format!("naming kind {kind} (known: {FAILED} failed, {CUT} cut)"))),
        }
    }
    Ok(namings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namings(failed: &[(usize, usize)], cuts: &[(usize, usize)]) -> Namings {
        Namings { failed: failed.iter().copied().collect(), cuts: cuts.iter().copied().collect() }
    }

    #[test]
    fn received_namings_are_validated() {
        let set = namings(&[(0, 1), (2, 1)], &[(2, 0)]);
        assert_eq!(decode(&encode(&set), 3, 1, 0).unwrap(), set);
        assert!(decode(&[5, 0, FAILED], 3, 1, 0).unwrap_err().to_string().contains("rank 5 in a 3-rank"));
        assert!(decode(&[0, 7, CUT], 3, 1, 0).unwrap_err().to_string().contains("rank 7 in a 3-rank"));
        assert!(decode(&[0, 1, 9], 3, 1, 0).unwrap_err().to_string().contains("naming kind 9"));
        assert!(decode(&[0, 1], 3, 1, 0).is_err(), "not whole triples");
        assert!(decode(&[0, 0, 0].repeat(7), 3, 1, 0).is_err(), "more entries than a rank can name");
    }

    #[test]
    fn the_rank_cut_is_left_out_whichever_proposal_comes_first() {
        // Rank 3 cut rank 1; rank 1 counts 3 as gone only for that. Coordinator 0 saw nothing.
        let (accuser, accused) = (namings(&[(1, 3)], &[]), namings(&[], &[(3, 1)]));
        for order in [[(accuser.clone(), 3), (accused.clone(), 1)], [(accused.clone(), 1), (accuser.clone(), 3)]] {
            let mut at_coordinator = Namings::default();
            for (proposal, peer) in order {
                at_coordinator.take_proposal(proposal, peer);
            }
            assert_eq!(at_coordinator.decide(), FailureSet::from([(1, 3)]), "rank 1 out, named by rank 3");
        }
        // Rank 3 cut rank 1 and then died, as rank 2 saw: rank 1 stays.
        let mut gathered = namings(&[], &[(3, 1)]);
        gathered.take_proposal(namings(&[(3, 2)], &[]), 2);
        assert_eq!(gathered.decide(), FailureSet::from([(3, 2)]));
        // The coordinator itself was cut (by rank 2): it decides its own exclusion.
        assert_eq!(namings(&[], &[(2, 0)]).decide(), FailureSet::from([(0, 2)]));
        assert!(namings(&[], &[(2, 0)]).out_of_reach(2, 0), "the coordinator waits for no proposal from its cutter");
    }

    #[test]
    fn a_proposal_names_its_proposer_whatever_it_wrote() {
        let mut gathered = Namings::default();
        gathered.take_proposal(namings(&[(3, 0)], &[(2, 0)]), 1);
        assert_eq!(gathered, namings(&[(3, 1)], &[(2, 1)]));
    }
}
