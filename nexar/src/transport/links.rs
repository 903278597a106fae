//! The table of a rank's peer links, indexed by world rank. Slots are filled once: at mesh
//! formation, or later when a new worker joins the running cluster; a link is never replaced,
//! so references into the table stay valid for the life of the rank.

use std::sync::OnceLock;

use super::link::PeerLink;

/// Every peer link of one rank, with room for ranks that join later.
#[derive(Debug, Default)]
pub(crate) struct Links {
    slots: Box<[OnceLock<PeerLink>]>,
}

impl Links {
    /// A table for world ranks `0..capacity`, filled from `initial` (indexed by rank).
    pub fn new(capacity: usize, initial: Vec<Option<PeerLink>>) -> Self {
        let slots: Box<[OnceLock<PeerLink>]> = (0..capacity.max(initial.len())).map(|_| OnceLock::new()).collect();
        for (peer, link) in initial.into_iter().enumerate() {
            if let Some(link) = link {
                let _ = slots[peer].set(link);
            }
        }
        Links { slots }
    }

    /// The link to world rank `peer`, if there is one.
    pub fn get(&self, peer: usize) -> Option<&PeerLink> {
        self.slots.get(peer).and_then(OnceLock::get)
    }

    /// Every link, in rank order.
    pub fn iter(&self) -> impl Iterator<Item = &PeerLink> {
        self.slots.iter().filter_map(OnceLock::get)
    }

    /// Adds the link to a rank that joined later. Fails (giving the link back) when the rank
    /// is outside the table or already has a link.
    pub fn install(&self, peer: usize, link: PeerLink) -> Result<&PeerLink, PeerLink> {
        let Some(slot) = self.slots.get(peer) else { return Err(link) };
        slot.set(link)?;
        slot.get().ok_or_else(|| unreachable!("just set"))
    }

    /// How many world ranks the table has room for.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }
}
