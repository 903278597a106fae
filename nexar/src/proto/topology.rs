//! Which ranks hold a direct connection. A full mesh costs every rank `world - 1` connections;
//! sparse topologies bound that, and messages to other ranks are relayed along shortest paths.

use std::collections::VecDeque;
use std::str::FromStr;

/// The shape of the peer mesh (`NEXAR_TOPOLOGY`).
///
/// ```
/// use nexar::Topology;
/// assert_eq!(Topology::Hypercube.neighbors(5, 8), vec![1, 4, 7]);
/// assert_eq!("k_regular:4".parse::<Topology>().unwrap(), Topology::KRegular(4));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Topology {
    /// Every rank connects to every other rank (`full_mesh`, the default).
    #[default]
    FullMesh,
    /// Ranks sit on a ring and each connects to the `k / 2` nearest ranks on either side
    /// (`k_regular:K`; an odd `k` is rounded up).
    KRegular(usize),
    /// Each rank connects to the ranks whose number differs from its own in one bit
    /// (`hypercube`); with a world size that is not a power of two, the missing corners are
    /// simply absent (every rank still reaches rank 0 by clearing bits).
    Hypercube,
}

impl Topology {
    /// The ranks `rank` connects to directly in a world of `world`, ascending.
    pub fn neighbors(&self, rank: usize, world: usize) -> Vec<usize> {
        let mut out: Vec<usize> = match *self {
            Topology::FullMesh => (0..world).collect(),
            Topology::KRegular(k) => {
                let half = k.div_ceil(2);
                (1..=half).flat_map(|d| [(rank + d) % world, (rank + world - d % world) % world]).collect()
            }
            Topology::Hypercube => (0..usize::BITS).map(|b| rank ^ (1usize << b)).filter(|p| *p < world).collect(),
        };
        out.retain(|p| *p != rank && *p < world);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// For every destination, the neighbour of `me` that starts a shortest path to it over
    /// live ranks (`None`: unreachable, or `me`). `adjacent(x)` lists the ranks `x` links to.
    ///
    /// ```
    /// use nexar::Topology;
    /// let ring = Topology::KRegular(2);
    /// let hops = Topology::next_hops(0, 6, |x| ring.neighbors(x, 6), |x| x == 1);
    /// assert_eq!(hops[2], Some(5)); // around the dead rank 1
    /// ```
    pub fn next_hops(
        me: usize,
        nodes: usize,
        adjacent: impl Fn(usize) -> Vec<usize>,
        dead: impl Fn(usize) -> bool,
    ) -> Vec<Option<usize>> {
        let mut first = vec![None; nodes];
        let mut seen = vec![false; nodes];
        let mut queue = VecDeque::new();
        if me < nodes {
            seen[me] = true;
            for n in adjacent(me) {
                if n < nodes && !seen[n] && !dead(n) {
                    seen[n] = true;
                    first[n] = Some(n);
                    queue.push_back(n);
                }
            }
        }
        while let Some(x) = queue.pop_front() {
            for n in adjacent(x) {
                if n < nodes && !seen[n] && !dead(n) {
                    seen[n] = true;
                    first[n] = first[x];
                    queue.push_back(n);
                }
            }
        }
        first
    }
}

impl FromStr for Topology {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "full_mesh" | "full" => Ok(Topology::FullMesh),
            "hypercube" => Ok(Topology::Hypercube),
            _ => match s.strip_prefix("k_regular:") {
                Some(k) => match k.parse::<usize>() {
                    Ok(k) if k >= 2 => Ok(Topology::KRegular(k)),
                    _ => Err("k_regular needs a degree of at least 2, as in k_regular:4".into()),
                },
                None => Err("expected full_mesh, hypercube or k_regular:K".into()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connected(t: Topology, world: usize) -> bool {
        let hops = Topology::next_hops(0, world, |x| t.neighbors(x, world), |_| false);
        hops.iter().skip(1).all(Option::is_some)
    }

    #[test]
    fn every_topology_is_symmetric_and_connected() {
        for world in 1..=33 {
            for t in [
                Topology::FullMesh,
                Topology::KRegular(2),
                Topology::KRegular(3),
                Topology::KRegular(4),
                Topology::Hypercube,
            ] {
                for r in 0..world {
                    for n in t.neighbors(r, world) {
                        assert!(t.neighbors(n, world).contains(&r), "{t:?} world {world}: {r}-{n} one-way");
                    }
                }
                assert!(connected(t, world), "{t:?} world {world} is not connected");
            }
        }
        assert_eq!(Topology::KRegular(4).neighbors(0, 8), vec![1, 2, 6, 7]);
        assert_eq!(Topology::Hypercube.neighbors(3, 6), vec![1, 2]);
    }

    #[test]
    fn routes_go_around_dead_ranks() {
        let t = Topology::KRegular(2); // a ring
        let hops = Topology::next_hops(0, 6, |x| t.neighbors(x, 6), |_| false);
        assert_eq!(hops[2], Some(1));
        assert_eq!(hops[4], Some(5));
        let hops = Topology::next_hops(0, 6, |x| t.neighbors(x, 6), |x| x == 1);
        assert_eq!(hops[2], Some(5), "with rank 1 dead, rank 2 is reached the other way round");
        assert_eq!(hops[1], None);
        // Rank 5 has not yet heard that rank 1 died: its shortest path to rank 2 is tied, and
        // it would hand rank 0's rerouted envelope straight back to rank 0. The relay avoids
        // the neighbour an envelope came from, which leaves the live way round.
        let stale = Topology::next_hops(5, 6, |x| t.neighbors(x, 6), |_| false);
        assert_eq!(stale[2], Some(0));
        let avoiding_sender = Topology::next_hops(5, 6, |x| t.neighbors(x, 6), |x| x == 0);
        assert_eq!(avoiding_sender[2], Some(4));
    }

    #[test]
    fn names_parse() {
        assert_eq!("full_mesh".parse::<Topology>(), Ok(Topology::FullMesh));
        assert_eq!("Hypercube".parse::<Topology>(), Ok(Topology::Hypercube));
        assert!("k_regular:1".parse::<Topology>().is_err());
        assert!("star".parse::<Topology>().is_err());
    }
}
