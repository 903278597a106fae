//! The seed's table of ranks: which are taken, by which worker (its address, its keys, the
//! variable its rank came from), and when the table is complete.

use std::net::SocketAddr;

use super::Shared;
use crate::proto::message::RankClaim;
use crate::transport::relay_seal::RelayPublicKey;
use crate::transport::tls::KeyPin;

/// What the seed vouches for about a member's keys: the pin of the key it certified, and its
/// public relay key.
#[derive(Clone, Copy)]
pub(super) struct MemberKeys {
    pub(super) pin: KeyPin,
    pub(super) relay: RelayPublicKey,
}

pub(super) struct Slots {
    /// Where each rank listens; `None` for a rank not joined yet (before formation) or gone.
    pub(super) addrs: Vec<Option<SocketAddr>>,
    /// For each rank a worker asked for by its launcher's number, the variable it read it from.
    pub(super) claimed_by: Vec<Option<String>>,
    /// The pin of each rank's certified key and its relay key, set with its address.
    pub(super) keys: Vec<Option<MemberKeys>>,
    pub(super) formed: bool,
}

impl Slots {
    /// The peer table as it stands: ranks that left are listed with port 0.
    pub(super) fn table(&self) -> Vec<SocketAddr> {
        self.addrs.iter().map(|a| a.unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))).collect()
    }

    /// Each rank's key pin and relay key as the peer table lists them (empty: none).
    pub(super) fn keys(&self, ranks: usize) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let of = |r: usize| self.keys.get(r).copied().flatten();
        let pins = (0..ranks).map(|r| of(r).map(|k| k.pin.to_vec()).unwrap_or_default()).collect();
        let relay = (0..ranks).map(|r| of(r).map(|k| k.relay.to_vec()).unwrap_or_default()).collect();
        (pins, relay)
    }

    /// Takes `rank` for a worker at `addr` with keys `key`.
    pub(super) fn occupy(&mut self, rank: usize, addr: SocketAddr, key: MemberKeys) {
        if self.keys.len() <= rank {
            self.keys.resize(rank + 1, None);
        }
        self.addrs[rank] = Some(addr);
        self.keys[rank] = Some(key);
    }
}

/// Gives a joining worker its rank: a free one while the cluster forms, a new one after (up to
/// `max_world_size` ranks ever). Returns the rank, the world size it joins, and whether the
/// cluster is already running.
pub(super) fn claim_slot(
    shared: &Shared,
    addr: SocketAddr,
    key: MemberKeys,
    claim: &RankClaim,
) -> Result<(usize, usize, bool), String> {
    let mut slots = crate::sync::lock(&shared.slots);
    if let Some(world) = claim.world_size
        && world as usize != shared.world
    {
        let seed_side = crate::sync::lock(&shared.world_from)
            .clone()
            .unwrap_or_else(|| format!("world_size {} in its configuration (NEXAR_WORLD_SIZE)", shared.world));
        return Err(format!(
            "this worker read {}={world}, but the cluster forms with {} ranks (the seed read {seed_side}): \
             every rank must be started with the same world size",
            claim.world_var, shared.world
        ));
    }
    if let Some(wanted) = claim.rank {
        return claim_named_slot(shared, &mut slots, (addr, key), wanted as usize, claim);
    }
    if slots.formed {
        let max = shared.cfg.max_world_size;
        if slots.addrs.len() >= max {
            return Err(format!("the cluster has reached its maximum size of {max} ranks (NEXAR_MAX_WORLD_SIZE)"));
        }
        slots.addrs.push(None);
        let rank = slots.addrs.len() - 1;
        slots.occupy(rank, addr, key);
        tracing::info!(rank, "a worker joins the running cluster");
        return Ok((rank, slots.addrs.len(), true));
    }
    let Some(rank) = slots.addrs.iter().position(Option::is_none) else {
        return Err(format!("the cluster is full (world size {})", shared.world));
    };
    slots.occupy(rank, addr, key);
    publish_if_complete(shared, &mut slots);
    Ok((rank, shared.world, false))
}

/// Gives a worker the rank its launcher numbered it with, refusing a rank out of range, a
/// rank already taken (naming the variable each claimant read), and a rank after formation.
pub(super) fn claim_named_slot(
    shared: &Shared,
    slots: &mut Slots,
    (addr, key): (SocketAddr, MemberKeys),
    rank: usize,
    claim: &RankClaim,
) -> Result<(usize, usize, bool), String> {
    let var = &claim.rank_var;
    if rank >= shared.world {
        return Err(format!("this worker read {var}={rank}, outside the cluster's {} ranks", shared.world));
    }
    if let Some(holder) = slots.addrs[rank] {
        let their_var = slots.claimed_by[rank].as_deref().unwrap_or("no variable: the seed assigned it");
        return Err(format!(
            "rank {rank} is taken twice: the worker at {holder} holds it ({their_var}), and this worker read \
             {var}={rank}; two processes of the job were given the same rank"
        ));
    }
    if slots.formed {
        return Err(format!("this worker read {var}={rank}, but the cluster has formed and rank {rank} has left it"));
    }
    slots.occupy(rank, addr, key);
    slots.claimed_by[rank] = Some(var.clone());
    publish_if_complete(shared, slots);
    Ok((rank, shared.world, false))
}

/// Tells waiting workers how many have joined, and publishes the peer table once every rank
/// is present.
pub(super) fn publish_if_complete(shared: &Shared, slots: &mut Slots) {
    let joined = slots.addrs.iter().filter(|a| a.is_some()).count();
    shared.progress.send_modify(|p| p.joined = joined);
    if slots.addrs.iter().all(Option::is_some) {
        slots.formed = true;
        let table: Vec<SocketAddr> = slots.addrs.iter().flatten().copied().collect();
        tracing::info!(world = table.len(), "every worker has joined; publishing the peer table");
        shared.table.send_replace(Some(table));
    }
}

/// Frees the rank of a worker that left: before formation another worker may take it; after,
/// the number stays used and later joiners do not dial it.
pub(super) fn release_slot(shared: &Shared, rank: usize) {
    let mut slots = crate::sync::lock(&shared.slots);
    slots.addrs[rank] = None;
    if let Some(key) = slots.keys.get_mut(rank) {
        *key = None;
    }
    if !slots.formed {
        let joined = slots.addrs.iter().filter(|a| a.is_some()).count();
        shared.progress.send_modify(|p| p.joined = joined);
    }
    if let Some(by) = slots.claimed_by.get_mut(rank) {
        *by = None;
    }
}
