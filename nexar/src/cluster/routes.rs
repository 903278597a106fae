//! Relay routes on sparse topologies: for each rank without a direct link, the neighbour that
//! starts a shortest path to it over live ranks. Recomputed whenever a rank is declared dead,
//! so traffic flows around a dead relay. No I/O: `comm` hands in the links this rank has and
//! the ranks declared dead, and sends through the hop it gets back.

use std::sync::Mutex;

use crate::proto::topology::Topology;

/// Next hops by destination, valid while the number of dead ranks stays the same.
#[derive(Default)]
struct HopCache {
    dead_seen: Option<usize>,
    hops: Vec<Option<usize>>,
}

/// One rank's relay routes over the topology the cluster formed with.
pub(crate) struct Routes {
    me: usize,
    /// The world size the cluster formed with (the topology is laid over it).
    world: usize,
    /// Every rank this rank may ever hold a link to (late joiners included).
    capacity: usize,
    topology: Topology,
    cache: Mutex<HopCache>,
}

impl Routes {
    /// The routes of rank `me` in a cluster that formed with `world` ranks on `topology`, with
    /// room for `capacity` ranks.
    pub fn new(me: usize, world: usize, capacity: usize, topology: Topology) -> Self {
        Routes { me, world, capacity, topology, cache: Mutex::new(HopCache::default()) }
    }

    /// The neighbour that starts a shortest path to `peer` over live ranks. `linked` lists
    /// the peers this rank has a direct link to (asked only when the routes are recomputed);
    /// `dead` holds the ranks declared dead, sorted.
    pub fn next_hop(&self, peer: usize, linked: impl FnOnce() -> Vec<usize>, dead: &[usize]) -> Option<usize> {
        let mut cache = crate::sync::lock(&self.cache);
        if cache.dead_seen != Some(dead.len()) {
            cache.hops = self.first_hops(&linked(), |x| dead.binary_search(&x).is_ok());
            cache.dead_seen = Some(dead.len());
        }
        cache.hops.get(peer).copied().flatten()
    }

    /// Like [`next_hop`](Self::next_hop), over paths that also avoid `avoid` (a neighbour that
    /// handed an envelope back: it knows of a failure this rank has not heard of yet).
    pub fn next_hop_avoiding(&self, peer: usize, avoid: usize, linked: &[usize], dead: &[usize]) -> Option<usize> {
        self.first_hops(linked, |x| x == avoid || dead.binary_search(&x).is_ok()).get(peer).copied().flatten()
    }

    /// For every rank, the neighbour that starts a shortest path to it over the ranks for
    /// which `avoid` is false.
    fn first_hops(&self, linked: &[usize], avoid: impl Fn(usize) -> bool) -> Vec<Option<usize>> {
        let (me, world, topology) = (self.me, self.world, self.topology);
        let adjacent = |x: usize| -> Vec<usize> {
            if x == me {
                linked.to_vec()
            } else if x < world {
                topology.neighbors(x, world)
            } else {
                Vec::new()
            }
        };
        Topology::next_hops(me, self.capacity, adjacent, avoid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 0 of a ring of 6 (each rank linked to the one before and after it).
    fn ring_of_six() -> (Routes, Vec<usize>) {
        let ring = Topology::KRegular(2);
        (Routes::new(0, 6, 6, ring), ring.neighbors(0, 6))
    }

    #[test]
    fn a_far_rank_is_reached_through_a_neighbour_and_around_a_dead_one() {
        let (routes, linked) = ring_of_six();
        assert_eq!(linked, vec![1, 5]);
        let hop = routes.next_hop(2, || linked.clone(), &[]).unwrap();
        assert_eq!(hop, 1, "rank 2 is two hops away through rank 1");
        assert_eq!(routes.next_hop(2, || linked.clone(), &[1]), Some(5), "around the dead rank 1");
        assert_eq!(routes.next_hop(3, || linked.clone(), &[1, 5]), None, "cut off on both sides");
    }

    #[test]
    fn routes_are_recomputed_only_when_another_rank_dies() {
        let (routes, linked) = ring_of_six();
        let mut asked = 0;
        for _ in 0..3 {
            routes.next_hop(
                2,
                || {
                    asked += 1;
                    linked.clone()
                },
                &[],
            );
        }
        assert_eq!(asked, 1, "computed once while nobody died");
        routes.next_hop(
            2,
            || {
                asked += 1;
                linked.clone()
            },
            &[4],
        );
        assert_eq!(asked, 2);
    }

    #[test]
    fn an_envelope_handed_back_takes_a_path_that_avoids_the_sender() {
        let (routes, linked) = ring_of_six();
        assert_eq!(routes.next_hop(2, || linked.clone(), &[]), Some(1));
        assert_eq!(routes.next_hop_avoiding(2, 1, &linked, &[]), Some(5));
        assert_eq!(routes.next_hop_avoiding(2, 1, &linked, &[4]), None, "no path avoids both");
    }

    #[test]
    fn late_joiners_relay_for_nobody() {
        // Ranks that joined the running cluster (6 and 7 here) are beyond the topology's
        // world: a late joiner is reached over its direct link, never through another one.
        let routes = Routes::new(0, 6, 8, Topology::KRegular(2));
        assert_eq!(routes.next_hop(6, || vec![1, 5], &[]), None);
        let linked_to_six = Routes::new(0, 6, 8, Topology::KRegular(2));
        assert_eq!(linked_to_six.next_hop(7, || vec![1, 5, 6], &[]), None);
        assert_eq!(linked_to_six.next_hop(2, || vec![1, 5, 6], &[]), Some(1));
    }
}
