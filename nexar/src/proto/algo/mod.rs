//! Algorithm generators: pure functions from `(rank, world, count, params)` to a [`Schedule`],
//! and the one table that picks an algorithm by operation, size and world size.

pub mod allreduce;
pub mod barrier;
pub mod blocks;
pub mod hierarchical;
pub mod rooted;
pub mod scan;

use std::fmt;
use std::str::FromStr;

use super::schedule::Schedule;
use hierarchical::HostLayout;

/// A collective operation, as far as scheduling is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's buffer.
    AllReduce,
    /// The root's buffer is copied to every rank.
    Broadcast {
        /// The root.
        root: usize,
    },
    /// The root ends with the reduction of every rank's buffer.
    Reduce {
        /// The root.
        root: usize,
    },
    /// Every rank ends with every rank's block, in rank order.
    AllGather,
    /// Every rank ends with its block of the reduction.
    ReduceScatter,
    /// Rank `j`'s block `i` goes to rank `i`'s block `j`.
    AllToAll,
    /// The root ends with every rank's block, in rank order.
    Gather {
        /// The root.
        root: usize,
    },
    /// The root's block `i` goes to rank `i`.
    Scatter {
        /// The root.
        root: usize,
    },
    /// Inclusive prefix reduction.
    Scan,
    /// Exclusive prefix reduction.
    ExclusiveScan,
    /// Synchronisation only.
    Barrier,
}

impl Collective {
    /// Wire code of the operation kind.
    pub fn code(self) -> u8 {
        match self {
            Collective::AllReduce => 1,
            Collective::Broadcast { .. } => 2,
            Collective::Reduce { .. } => 3,
            Collective::AllGather => 4,
            Collective::ReduceScatter => 5,
            Collective::AllToAll => 6,
            Collective::Gather { .. } => 7,
            Collective::Scatter { .. } => 8,
            Collective::Scan => 9,
            Collective::ExclusiveScan => 10,
            Collective::Barrier => 11,
        }
    }

    /// The root, for rooted operations.
    pub fn root(self) -> Option<usize> {
        match self {
            Collective::Broadcast { root }
            | Collective::Reduce { root }
            | Collective::Gather { root }
            | Collective::Scatter { root } => Some(root),
            _ => None,
        }
    }

    /// Lower-case name, as in error messages.
    pub fn name(self) -> &'static str {
        name_of_code(self.code())
    }

    /// Whether some rank can finish this operation without hearing (even indirectly) from
    /// every other rank. Such operations are confirmed by a dissemination round
    /// ([`barrier::append_dissemination`]), so that a rank which detects a disagreement stops
    /// every rank, not only those downstream of it; the executor runs that round behind the
    /// call (`comm/collective/confirm.rs`), not in its schedule.
    pub fn needs_confirmation(self) -> bool {
        !matches!(
            self,
            Collective::AllReduce
                | Collective::AllGather
                | Collective::ReduceScatter
                | Collective::AllToAll
                | Collective::Barrier
        )
    }
}

/// The name of an operation kind from its wire code.
pub fn name_of_code(code: u8) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "broadcast",
        3 => "reduce",
        4 => "all_gather",
        5 => "reduce_scatter",
        6 => "all_to_all",
        7 => "gather",
        8 => "scatter",
        9 => "scan",
        10 => "exclusive_scan",
        11 => "barrier",
        _ => "unknown collective",
    }
}

/// An algorithm a collective can run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring (allreduce, all-gather, reduce-scatter).
    Ring,
    /// Ring with segments of this many bytes forwarded as soon as they are reduced.
    PipelinedRing {
        /// Segment size in bytes.
        segment_bytes: usize,
    },
    /// Recursive halving-doubling (allreduce).
    HalvingDoubling,
    /// Recursive doubling (allreduce).
    RecursiveDoubling,
    /// Binomial tree (broadcast, reduce).
    BinomialTree,
    /// Pipelined chain (broadcast).
    PipelinedChain {
        /// Segment size in bytes.
        segment_bytes: usize,
    },
    /// Root talks to every rank directly (gather, scatter).
    Linear,
    /// Pairwise exchange (all-to-all).
    Pairwise,
    /// Pairwise exchange in segments of this many bytes (all-to-all).
    PipelinedPairwise {
        /// Segment size in bytes.
        segment_bytes: usize,
    },
    /// Recursive doubling prefix (scan, exclusive scan).
    PrefixDoubling,
    /// Dissemination (barrier).
    Dissemination,
    /// Gather to rank 0, then release (barrier).
    TwoPhase,
    /// Two levels for ranks on several hosts: allreduce within each host, then between hosts,
    /// then within each host again, in segments of this many bytes; broadcast to one leader
    /// per host, then within each host; reduce within each host to its leader, then among
    /// the leaders; all-gather among each local index across the hosts, then within each
    /// host; reduce-scatter within each host, then among each local index across the hosts;
    /// all-to-all within each host to the rank of the destination's local index, then among
    /// each local index across the hosts.
    Hierarchical {
        /// Segment size in bytes.
        segment_bytes: usize,
    },
}

impl Algorithm {
    /// Lower-case name (also what [`FromStr`] accepts).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::PipelinedRing { .. } => "pipelined_ring",
            Algorithm::HalvingDoubling => "halving_doubling",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::BinomialTree => "binomial_tree",
            Algorithm::PipelinedChain { .. } => "pipelined_chain",
            Algorithm::Linear => "linear",
            Algorithm::Pairwise => "pairwise",
            Algorithm::PipelinedPairwise { .. } => "pipelined_pairwise",
            Algorithm::PrefixDoubling => "prefix_doubling",
            Algorithm::Dissemination => "dissemination",
            Algorithm::TwoPhase => "two_phase",
            Algorithm::Hierarchical { .. } => "hierarchical",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "ring" => Algorithm::Ring,
            "pipelined_ring" => Algorithm::PipelinedRing { segment_bytes: DEFAULT_SEGMENT_BYTES },
            "halving_doubling" => Algorithm::HalvingDoubling,
            "recursive_doubling" => Algorithm::RecursiveDoubling,
            "binomial_tree" => Algorithm::BinomialTree,
            "pipelined_chain" => Algorithm::PipelinedChain { segment_bytes: DEFAULT_SEGMENT_BYTES },
            "linear" => Algorithm::Linear,
            "pairwise" => Algorithm::Pairwise,
            "pipelined_pairwise" => Algorithm::PipelinedPairwise { segment_bytes: DEFAULT_SEGMENT_BYTES },
            "prefix_doubling" => Algorithm::PrefixDoubling,
            "dissemination" => Algorithm::Dissemination,
            "two_phase" => Algorithm::TwoPhase,
            "hierarchical" => Algorithm::Hierarchical { segment_bytes: DEFAULT_SEGMENT_BYTES },
            other => return Err(format!("unknown algorithm {other:?}")),
        })
    }
}

/// Segment size of the pipelined algorithms.
pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;
/// Allreduce messages up to this size use recursive doubling (fewest rounds).
pub const ALLREDUCE_SMALL_BYTES: usize = 64 << 10;
/// Allreduce messages up to this size use halving-doubling; larger ones the pipelined ring.
pub const ALLREDUCE_MEDIUM_BYTES: usize = 512 << 10;
/// Broadcasts up to this size use the binomial tree; larger ones the pipelined chain.
pub const BROADCAST_TREE_BYTES: usize = 256 << 10;
/// Between two ranks, broadcasts up to this size use the tree (one message); larger ones the
/// chain, whose 1 MiB segments let the receiver take one while the next is on its way. It was
/// 8 MiB, when one message was as fast as the chain at 4 MiB over the TCP lane. Measured again
/// on the 2-core benchmark machine (2026-11-27, three alternated rounds), the chain was level
/// at 1 MiB and ahead from 2 MiB: 4 MiB in 1.32–1.38 ms against 1.70–1.98 over the TCP lane,
/// and in 155–200 µs against 1.1–1.4 ms over shared memory, where a segment is read from the
/// peer's ring in place and one message that long is copied twice.
pub const BROADCAST_PAIR_TREE_BYTES: usize = DEFAULT_SEGMENT_BYTES;

/// All-to-all blocks up to this size go two-level across hosts with several ranks each (one
/// message of `L` blocks per host instead of `L` messages). Per rank, with `H` hosts of `L`
/// ranks and blocks of `b` bytes, it saves `(L-1)(H-1)` network latencies (tens of µs each
/// over TLS) and costs `L-1` more shared-memory messages of `H·b` bytes and three local
/// passes over the `L·H·b` bytes: for 8 ranks on each of 4 hosts the saving (~0.4 ms at
/// 20 µs) and the cost (~0.4 ms at 10 GB/s) meet near 32 KiB blocks, and smaller blocks gain.
pub const ALL_TO_ALL_TWO_LEVEL_BYTES: usize = 32 << 10;

/// The algorithm table: which algorithm runs `op` on `bytes` bytes per rank across `world`
/// ranks. The one place where this choice is made; [`crate::NexarConfig`] can override it.
pub fn select(op: Collective, bytes: usize, world: usize) -> Algorithm {
    match op {
        Collective::AllReduce if bytes <= ALLREDUCE_SMALL_BYTES || world == 2 && bytes <= ALLREDUCE_MEDIUM_BYTES => {
            Algorithm::RecursiveDoubling
        }
        Collective::AllReduce if bytes <= ALLREDUCE_MEDIUM_BYTES => Algorithm::HalvingDoubling,
        Collective::AllReduce => Algorithm::PipelinedRing { segment_bytes: DEFAULT_SEGMENT_BYTES },
        Collective::Broadcast { .. }
            if bytes <= BROADCAST_TREE_BYTES || world <= 2 && bytes <= BROADCAST_PAIR_TREE_BYTES =>
        {
            Algorithm::BinomialTree
        }
        Collective::Broadcast { .. } => Algorithm::PipelinedChain { segment_bytes: DEFAULT_SEGMENT_BYTES },
        Collective::Reduce { .. } => Algorithm::BinomialTree,
        Collective::AllGather | Collective::ReduceScatter if bytes <= DEFAULT_SEGMENT_BYTES => Algorithm::Ring,
        Collective::AllGather | Collective::ReduceScatter => {
            Algorithm::PipelinedRing { segment_bytes: DEFAULT_SEGMENT_BYTES }
        }
        Collective::AllToAll if bytes <= DEFAULT_SEGMENT_BYTES => Algorithm::Pairwise,
        Collective::AllToAll => Algorithm::PipelinedPairwise { segment_bytes: DEFAULT_SEGMENT_BYTES },
        Collective::Gather { .. } | Collective::Scatter { .. } => Algorithm::Linear,
        Collective::Scan | Collective::ExclusiveScan => Algorithm::PrefixDoubling,
        Collective::Barrier => Algorithm::Dissemination,
    }
}

/// The algorithm table for a communicator whose ranks lie on hosts as `layout` says: the
/// two-level allreduce where the ranks span several hosts with several ranks on each and the
/// flat table would run the ring, the two-level all-gather and reduce-scatter across hosts
/// with several ranks each (and the all-to-all there for blocks up to
/// [`ALL_TO_ALL_TWO_LEVEL_BYTES`]), the two-level broadcast and reduce wherever the ranks span several hosts and some
/// host holds more than one, else [`select`].
pub fn select_on(op: Collective, bytes: usize, world: usize, layout: Option<&HostLayout>) -> Algorithm {
    match select(op, bytes, world) {
        Algorithm::PipelinedRing { segment_bytes }
            if op == Collective::AllReduce && layout.is_some_and(HostLayout::is_two_level) =>
        {
            Algorithm::Hierarchical { segment_bytes }
        }
        _ if matches!(op, Collective::Broadcast { .. } | Collective::Reduce { .. })
            && layout.is_some_and(HostLayout::shares_hosts) =>
        {
            Algorithm::Hierarchical { segment_bytes: DEFAULT_SEGMENT_BYTES }
        }
        Algorithm::Ring | Algorithm::PipelinedRing { .. }
            if matches!(op, Collective::AllGather | Collective::ReduceScatter)
                && layout.is_some_and(HostLayout::is_two_level) =>
        {
            Algorithm::Hierarchical { segment_bytes: DEFAULT_SEGMENT_BYTES }
        }
        Algorithm::Pairwise
            if op == Collective::AllToAll
                && bytes <= ALL_TO_ALL_TWO_LEVEL_BYTES
                && layout.is_some_and(HostLayout::is_two_level) =>
        {
            Algorithm::Hierarchical { segment_bytes: DEFAULT_SEGMENT_BYTES }
        }
        flat => flat,
    }
}

/// An algorithm asked of an operation it does not implement.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("algorithm {algorithm} does not implement {op}")]
pub struct Unsupported {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The operation's name.
    pub op: &'static str,
}

/// The schedule of `rank` of `world` for `op` on `count` elements (per-rank block size for
/// block operations) of `elem_size` bytes, with `algorithm`. The confirmation round of the
/// rooted operations is not part of it (see [`Collective::needs_confirmation`]).
#[cfg_attr(not(any(test, feature = "unstable-internals")), allow(dead_code))]
pub fn generate(
    op: Collective,
    algorithm: Algorithm,
    rank: usize,
    world: usize,
    count: usize,
    elem_size: usize,
) -> Result<Schedule, Unsupported> {
    generate_on(op, algorithm, rank, world, count, elem_size, None)
}

/// [`generate`] for ranks that lie on hosts as `layout` says, which the two-level algorithms
/// need (they are unsupported without one, or when it does not describe `world` ranks with
/// the same number on each host).
pub fn generate_on(
    op: Collective,
    algorithm: Algorithm,
    rank: usize,
    world: usize,
    count: usize,
    elem_size: usize,
    layout: Option<&HostLayout>,
) -> Result<Schedule, Unsupported> {
    let seg = |bytes: usize| (bytes / elem_size.max(1)).max(1);
    let unsupported = || Unsupported { algorithm, op: op.name() };
    let s = match (op, algorithm) {
        (Collective::AllReduce, Algorithm::Ring) => allreduce::ring(rank, world, count, usize::MAX),
        (Collective::AllReduce, Algorithm::PipelinedRing { segment_bytes }) => {
            allreduce::ring(rank, world, count, seg(segment_bytes))
        }
        (Collective::AllReduce, Algorithm::HalvingDoubling) => allreduce::halving_doubling(rank, world, count),
        (Collective::AllReduce, Algorithm::RecursiveDoubling) => allreduce::recursive_doubling(rank, world, count),
        (Collective::Broadcast { root }, Algorithm::BinomialTree) => {
            rooted::broadcast_binomial(rank, world, count, root)
        }
        (Collective::Broadcast { root }, Algorithm::PipelinedChain { segment_bytes }) => {
            rooted::broadcast_chain(rank, world, count, root, seg(segment_bytes))
        }
        (Collective::Reduce { root }, Algorithm::BinomialTree) => {
            rooted::reduce_binomial(rank, world, count, root, seg(DEFAULT_SEGMENT_BYTES))
        }
        (Collective::Gather { root }, Algorithm::Linear) => {
            rooted::gather_linear(rank, world, count, root, seg(DEFAULT_SEGMENT_BYTES))
        }
        (Collective::Scatter { root }, Algorithm::Linear) => {
            rooted::scatter_linear(rank, world, count, root, seg(DEFAULT_SEGMENT_BYTES))
        }
        (Collective::AllGather, Algorithm::Ring) => blocks::all_gather_ring(rank, world, count, usize::MAX),
        (Collective::AllGather, Algorithm::PipelinedRing { segment_bytes }) => {
            blocks::all_gather_ring(rank, world, count, seg(segment_bytes))
        }
        (Collective::ReduceScatter, Algorithm::Ring) => blocks::reduce_scatter_ring(rank, world, count, usize::MAX),
        (Collective::ReduceScatter, Algorithm::PipelinedRing { segment_bytes }) => {
            blocks::reduce_scatter_ring(rank, world, count, seg(segment_bytes))
        }
        (Collective::AllToAll, Algorithm::Pairwise) => blocks::all_to_all_pairwise(rank, world, count, usize::MAX),
        (Collective::AllToAll, Algorithm::PipelinedPairwise { segment_bytes }) => {
            blocks::all_to_all_pairwise(rank, world, count, seg(segment_bytes))
        }
        (Collective::Scan, Algorithm::PrefixDoubling) => scan::inclusive(rank, world, count),
        (Collective::ExclusiveScan, Algorithm::PrefixDoubling) => scan::exclusive(rank, world, count),
        (Collective::Barrier, Algorithm::Dissemination) => barrier::dissemination(rank, world),
        (Collective::Barrier, Algorithm::TwoPhase) => barrier::two_phase(rank, world),
        (Collective::AllReduce, Algorithm::Hierarchical { segment_bytes }) => layout
            .filter(|l| l.world() == world)
            .and_then(|l| hierarchical::allreduce(rank, l, count, seg(segment_bytes)))
            .ok_or_else(unsupported)?,
        (Collective::Broadcast { root }, Algorithm::Hierarchical { .. }) => layout
            .filter(|l| l.world() == world && root < world)
            .map(|l| hierarchical::broadcast(rank, l, count, root, elem_size))
            .ok_or_else(unsupported)?,
        (Collective::ReduceScatter, Algorithm::Hierarchical { segment_bytes }) => layout
            .filter(|l| l.world() == world)
            .and_then(|l| hierarchical::reduce_scatter(rank, l, count, seg(segment_bytes)))
            .ok_or_else(unsupported)?,
        (Collective::AllGather, Algorithm::Hierarchical { segment_bytes }) => layout
            .filter(|l| l.world() == world)
            .and_then(|l| hierarchical::all_gather(rank, l, count, seg(segment_bytes)))
            .ok_or_else(unsupported)?,
        (Collective::AllToAll, Algorithm::Hierarchical { segment_bytes }) => layout
            .filter(|l| l.world() == world)
            .and_then(|l| hierarchical::all_to_all(rank, l, count, seg(segment_bytes)))
            .ok_or_else(unsupported)?,
        (Collective::Reduce { root }, Algorithm::Hierarchical { .. }) => layout
            .filter(|l| l.world() == world && root < world)
            .map(|l| hierarchical::reduce(rank, l, count, root, seg(DEFAULT_SEGMENT_BYTES)))
            .ok_or_else(unsupported)?,
        _ => return Err(unsupported()),
    };
    Ok(s)
}
