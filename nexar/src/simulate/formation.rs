//! The formation model: every worker joins the seed at once; the seed handles each join (TLS
//! handshake, certificate) on its cores, then sends every worker the peer table through its
//! link; each rank then dials the lower-numbered ranks among its topology's neighbours, and
//! each connection costs CPU at both ends, on the cores of the host each end runs on (ranks of
//! one host share its cores, first come first served). The table's size per entry is that of
//! the real encoding.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use super::events::{Queue, duration, micros};
use crate::proto::message::{SeedResponse, encode};
use crate::proto::topology::Topology;

/// What [`simulate_formation`] runs.
///
/// ```
/// use nexar::simulate::FormationScenario;
/// let s = FormationScenario::new(4096, 64);
/// assert_eq!(s.cores_per_host, 64);
/// ```
#[derive(Clone, Debug)]
pub struct FormationScenario {
    /// Rank processes.
    pub ranks: usize,
    /// Ranks on each host (the last host may hold fewer).
    pub ranks_per_host: usize,
    /// Cores of each host, shared by its ranks.
    pub cores_per_host: usize,
    /// Which ranks connect directly (`NEXAR_TOPOLOGY`).
    pub topology: Topology,
    /// The seed's CPU time per join.
    pub join_cost: Duration,
    /// Cores the seed handles joins on.
    pub seed_cores: usize,
    /// CPU time of one end of one peer connection (QUIC and TLS handshakes, the lanes).
    pub link_cost: Duration,
    /// What the seed's link sends, bytes per second.
    pub seed_bandwidth: f64,
    /// One-way network delay.
    pub latency: Duration,
}

impl FormationScenario {
    /// `ranks` ranks, `per_host` to a host with a core each, a full mesh, and costs measured
    /// on a 2-core machine: 2 ms per join at the seed (on 4 cores) and 3.8 ms per end of a
    /// connection (64 rank processes formed their 2,016 connections in 7.6 s on 2 cores), a
    /// 10 Gb/s seed link and 50 µs of latency.
    pub fn new(ranks: usize, per_host: usize) -> Self {
        FormationScenario {
            ranks,
            ranks_per_host: per_host.max(1),
            cores_per_host: per_host.max(1),
            topology: Topology::FullMesh,
            join_cost: Duration::from_millis(2),
            seed_cores: 4,
            link_cost: Duration::from_micros(3800),
            seed_bandwidth: 1.25e9,
            latency: Duration::from_micros(50),
        }
    }
}

/// What [`simulate_formation`] found.
///
/// ```
/// use nexar::simulate::{FormationScenario, simulate_formation};
/// let out = simulate_formation(&FormationScenario::new(8, 8));
/// assert_eq!(out.links, 28);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct FormationOutcome {
    /// Until the last worker had the peer table.
    pub seed_done: Duration,
    /// Until the last rank had all its links.
    pub formed: Duration,
    /// Connections in the mesh.
    pub links: u64,
    /// The most connections one rank holds.
    pub most_links_per_rank: usize,
    /// Bytes of peer tables the seed sent.
    pub seed_bytes: u64,
    /// Bytes of one peer-table entry, as encoded.
    pub entry_bytes: u64,
}

/// The encoded size of a peer table of `n` entries with IPv4 addresses and both keys.
fn table_bytes(n: usize) -> u64 {
    let table = SeedResponse::PeerTable {
        cluster_id: u64::MAX,
        addrs: vec!["10.200.100.200:40000".to_string(); n],
        keys: vec![vec![0xa5; 32]; n],
        relay_keys: vec![vec![0x5a; 32]; n],
    };
    encode(&table).map_or(0, |b| b.len() as u64)
}

/// One connection's half on a host: `(ready at, connection, which end)`.
#[derive(Clone, Copy)]
struct Half {
    link: usize,
    dialer: bool,
}

/// Runs `s`.
///
/// ```
/// use nexar::simulate::{FormationScenario, simulate_formation};
/// let mut s = FormationScenario::new(1024, 64);
/// s.topology = nexar::Topology::Hypercube;
/// let out = simulate_formation(&s);
/// assert_eq!(out.most_links_per_rank, 10);
/// ```
pub fn simulate_formation(s: &FormationScenario) -> FormationOutcome {
    let n = s.ranks;
    let host = |r: usize| r / s.ranks_per_host;
    let hosts = n.div_ceil(s.ranks_per_host.max(1));
    let latency = micros(s.latency);
    // The seed: joins on its cores, then one table after another through its link.
    let seed_cores = s.seed_cores.max(1) as u64;
    let joined = (n as u64).div_ceil(seed_cores) * micros(s.join_cost);
    let table = table_bytes(n);
    let entry_bytes = table_bytes(2).saturating_sub(table_bytes(1));
    let per_table = (table as f64 / s.seed_bandwidth * 1e6) as u64;
    let has_table: Vec<u64> = (0..n as u64).map(|i| joined + (i + 1) * per_table + latency).collect();
    let seed_done = has_table.iter().copied().max().unwrap_or(0);

    // Every connection: the dialer (the higher rank) does its half once it has the table, the
    // other end then does its half.
    let mut ends = Vec::new();
    let mut most_links = 0;
    for a in 0..n {
        let neighbors = s.topology.neighbors(a, n);
        most_links = most_links.max(neighbors.len());
        ends.extend(neighbors.into_iter().filter(|&b| b < a).map(|b| (a, b)));
    }
    let mut queue = Queue::new();
    for (link, &(a, _)) in ends.iter().enumerate() {
        queue.push(has_table[a], Half { link, dialer: true });
    }
    let mut cores: Vec<BinaryHeap<Reverse<u64>>> =
        (0..hosts).map(|_| (0..s.cores_per_host.max(1)).map(|_| Reverse(0)).collect()).collect();
    let mut formed = vec![0u64; n];
    let cost = micros(s.link_cost);
    while let Some((ready, half)) = queue.pop() {
        let (a, b) = ends[half.link];
        let on = if half.dialer { a } else { b };
        let pool = &mut cores[host(on)];
        let Reverse(free) = pool.pop().unwrap_or(Reverse(0));
        let done = ready.max(free) + cost;
        pool.push(Reverse(done));
        if half.dialer {
            queue.push(done + latency, Half { link: half.link, dialer: false });
        } else {
            let up = done + latency;
            formed[a] = formed[a].max(up);
            formed[b] = formed[b].max(up);
        }
    }
    let formed = formed.iter().copied().max().unwrap_or(0).max(seed_done);
    FormationOutcome {
        seed_done: duration(seed_done),
        formed: duration(formed),
        links: ends.len() as u64,
        most_links_per_rank: most_links,
        seed_bytes: table * n as u64,
        entry_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_measured_full_mesh_of_64_ranks_on_two_cores_is_reproduced() {
        let mut s = FormationScenario::new(64, 64);
        s.cores_per_host = 2;
        let out = simulate_formation(&s);
        assert_eq!(out.links, 64 * 63 / 2);
        let formed = out.formed.as_secs_f64();
        assert!((7.0..8.5).contains(&formed), "{out:?}");
        assert!((60..160).contains(&out.entry_bytes), "{out:?}");
    }

    #[test]
    fn a_hypercube_grows_as_n_log_n_and_a_full_mesh_does_not() {
        let run = |n: usize, topology: Topology| {
            let mut s = FormationScenario::new(n, 64);
            s.topology = topology;
            simulate_formation(&s)
        };
        let (cube_small, cube_large) = (run(256, Topology::Hypercube), run(1024, Topology::Hypercube));
        assert_eq!(cube_large.most_links_per_rank, 10);
        let (full_small, full_large) = (run(256, Topology::FullMesh), run(1024, Topology::FullMesh));
        let cube = cube_large.formed.as_secs_f64() / cube_small.formed.as_secs_f64();
        let full = full_large.formed.as_secs_f64() / full_small.formed.as_secs_f64();
        assert!(full > cube, "full mesh ×{full:.1}, hypercube ×{cube:.1}");
    }
}
