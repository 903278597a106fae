//! Two-level algorithms for ranks spread over several hosts, several per host: the ranks of a
//! host work among themselves (through shared memory) and only one share of the data per rank
//! crosses between hosts.
//!
//! The allreduce: a reduce-scatter ring within each host (local rank `j` ends with block `j`
//! reduced over its host), an allreduce ring of block `j` across the hosts among the ranks of
//! local index `j` (one per host), then an all-gather ring within each host. Every host must
//! hold the same number of ranks ([`HostLayout::ranks_per_host`]).
//!
//! The all-to-all: blocks go first to the rank of the host whose local index is their
//! destination's, then across the hosts among ranks of one local index, in one message per
//! host.
//!
//! The broadcast: from the root to one leader per host (the root on its own host, the lowest
//! rank on the others), then from each leader to the ranks of its host; each level with the
//! tree or the chain, as the flat size table would pick for that many ranks.

use crate::proto::schedule::{Schedule, Slot, Span, Step};

/// Which host each rank of a communicator is on.
///
/// ```
/// use nexar::HostLayout;
/// // Ranks 0 and 2 on one host, 1 and 3 on another (round-robin placement).
/// let layout = HostLayout::from_keys(&[7, 9, 7, 9]);
/// assert_eq!(layout.hosts(), 2);
/// assert_eq!(layout.members(0), vec![0, 2]);
/// assert_eq!(layout.ranks_per_host(), Some(2));
/// assert!(layout.is_two_level());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostLayout {
    /// The host index of each rank; hosts are numbered in the order of their lowest rank.
    host_of: Vec<usize>,
    hosts: usize,
}

impl HostLayout {
    /// The layout of ranks whose hosts are told apart by `keys` (one per rank, equal on one
    /// host). Every rank that is given the same keys builds the same layout.
    pub fn from_keys(keys: &[u64]) -> HostLayout {
        let mut seen: Vec<u64> = Vec::new();
        let host_of = keys
            .iter()
            .map(|k| {
                seen.iter().position(|s| s == k).unwrap_or_else(|| {
                    seen.push(*k);
                    seen.len() - 1
                })
            })
            .collect();
        HostLayout { host_of, hosts: seen.len() }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.host_of.len()
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// The host of `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// The ranks on `host`, in rank order.
    pub fn members(&self, host: usize) -> Vec<usize> {
        (0..self.host_of.len()).filter(|r| self.host_of[*r] == host).collect()
    }

    /// The number of ranks on each host, when every host holds the same number.
    pub fn ranks_per_host(&self) -> Option<usize> {
        let first = self.members(0).len();
        (0..self.hosts).all(|h| self.members(h).len() == first).then_some(first)
    }

    /// Whether the two-level allreduce applies and pays: several hosts, the same number of
    /// ranks on each, and more than one there.
    pub fn is_two_level(&self) -> bool {
        self.hosts > 1 && self.ranks_per_host().is_some_and(|l| l > 1)
    }

    /// Whether the ranks span several hosts and some host holds more than one (the two-level
    /// broadcast pays).
    pub fn shares_hosts(&self) -> bool {
        self.hosts > 1 && self.hosts < self.host_of.len()
    }
}

/// The two-level broadcast of `count` elements of `elem_size` bytes from `root`.
pub fn broadcast(rank: usize, layout: &HostLayout, count: usize, root: usize, elem_size: usize) -> Schedule {
    let mut s = Schedule::new();
    let my_host = layout.host_of(rank);
    let leader_of = |h: usize| if h == layout.host_of(root) { root } else { layout.members(h)[0] };
    let leaders: Vec<usize> = (0..layout.hosts()).map(leader_of).collect();
    if rank == leaders[my_host] {
        let across = level_broadcast(my_host, leaders.len(), count, layout.host_of(root), elem_size);
        s.steps.extend(across.steps.into_iter().map(|step| moved(step, &leaders, 0)));
    }
    let local = layout.members(my_host);
    let me = local.iter().position(|r| *r == rank).unwrap_or(0);
    let from = local.iter().position(|r| *r == leaders[my_host]).unwrap_or(0);
    let within = level_broadcast(me, local.len(), count, from, elem_size);
    s.steps.extend(within.steps.into_iter().map(|step| moved(step, &local, 0)));
    s
}

/// The two-level reduce of `count` elements to `root`, in segments of at most `segment`
/// elements: a binomial reduce within each host to its leader (`root` on its own host, the
/// host's first rank elsewhere), then among the leaders to `root`. As in the flat reduce, no
/// rank but the root changes its buffer: a leader other than the root accumulates its host's
/// partial sum in scratch space and sends it from there.
pub fn reduce(rank: usize, layout: &HostLayout, count: usize, root: usize, segment: usize) -> Schedule {
    let mut s = Schedule::new();
    let my_host = layout.host_of(rank);
    let leader_of = |h: usize| if h == layout.host_of(root) { root } else { layout.members(h)[0] };
    let leaders: Vec<usize> = (0..layout.hosts()).map(leader_of).collect();
    let leads = rank == leaders[my_host];
    // A leader other than the root works in scratch from the start: its buffer stays as it was.
    let in_scratch = leads && rank != root;
    let place = |step: Step| if in_scratch { into_scratch(step) } else { step };
    if in_scratch {
        s.need_scratch(count);
        s.copy(Span::new(Slot::Data, 0, count), Span::new(Slot::Scratch, 0, count));
    }
    let local = layout.members(my_host);
    let me = local.iter().position(|r| *r == rank).unwrap_or(0);
    let to = local.iter().position(|r| *r == leaders[my_host]).unwrap_or(0);
    let within = super::rooted::reduce_binomial(me, local.len(), count, to, segment);
    s.need_scratch(within.scratch_len);
    s.steps.extend(within.steps.into_iter().map(|step| place(moved(step, &local, 0))));
    if leads {
        let across = super::rooted::reduce_binomial(my_host, leaders.len(), count, layout.host_of(root), segment);
        s.need_scratch(across.scratch_len);
        for step in across.steps.into_iter().map(|step| place(moved(step, &leaders, 0))) {
            // The across level's own copy into scratch would overwrite the host's partial sum.
            if !matches!(step, Step::Copy { src, dst } if src.slot == dst.slot) {
                s.steps.push(step);
            }
        }
    }
    s
}

/// The two-level all-gather of `count` elements per rank, in segments of at most `segment`
/// elements: first a ring among the ranks of each local index across the hosts (rank `(h, j)`
/// gathers the blocks of every host's rank `j`), then a ring within each host that passes
/// those columns around, so that each block crosses between hosts once per host rather than
/// once per hop of a flat ring laid over the hosts. `None` when the hosts hold different
/// numbers of ranks.
pub fn all_gather(rank: usize, layout: &HostLayout, count: usize, segment: usize) -> Option<Schedule> {
    layout.ranks_per_host()?;
    let mut s = Schedule::new();
    let block = |r: usize| Span::new(Slot::Data, r * count, count);
    s.copy(Span::new(Slot::Input, 0, count), block(rank));
    let (my_host, hosts) = (layout.host_of(rank), layout.hosts());
    let local = layout.members(my_host);
    let j = local.iter().position(|r| *r == rank)?;
    let column = |i: usize| -> Vec<usize> { (0..hosts).map(|h| layout.members(h)[i]).collect() };
    let peers = column(j);
    ring_pass(&mut s, &peers, my_host, |i| vec![block(peers[i])], segment, Pass::Gather);
    ring_pass(&mut s, &local, j, |i| column(i).into_iter().map(block).collect(), segment, Pass::Gather);
    Some(s)
}

/// The two-level reduce-scatter of `count` elements per rank (an input of `count · w`), in
/// segments of at most `segment` elements, in scratch space holding a copy of the input: a ring
/// within each host in which local rank `i` ends with the host's sum of the blocks of every
/// host's rank `i`, then a ring among each local index across the hosts that leaves each rank
/// its own block summed over every host. Each block crosses to each other host once. `None`
/// when the hosts hold different numbers of ranks.
pub fn reduce_scatter(rank: usize, layout: &HostLayout, count: usize, segment: usize) -> Option<Schedule> {
    layout.ranks_per_host()?;
    let w = layout.world();
    let mut s = Schedule::new();
    let block = |r: usize| Span::new(Slot::Scratch, r * count, count);
    s.need_scratch(count * w);
    s.copy(Span::new(Slot::Input, 0, count * w), Span::new(Slot::Scratch, 0, count * w));
    let (my_host, hosts) = (layout.host_of(rank), layout.hosts());
    let local = layout.members(my_host);
    let j = local.iter().position(|r| *r == rank)?;
    let column = |i: usize| -> Vec<usize> { (0..hosts).map(|h| layout.members(h)[i]).collect() };
    ring_pass(&mut s, &local, j, |i| column(i).into_iter().map(block).collect(), segment, Pass::Reduce);
    let peers = column(j);
    ring_pass(&mut s, &peers, my_host, |i| vec![block(peers[i])], segment, Pass::Reduce);
    s.copy(block(rank), Span::new(Slot::Data, 0, count));
    Some(s)
}

/// The two-level all-to-all of blocks of `count` elements, in segments of at most `segment`
/// elements, for ranks `(h, j)` (local index `j` on host `h`), `L` per host on `H` hosts: each
/// rank first sends each rank `i` of its host, in one message, its blocks for the ranks of
/// local index `i` on every host; then, among the ranks of its own local index across the
/// hosts, sends each host the blocks that every rank of its host has for that host's rank
/// `j`, again in one message. Between hosts a rank sends `H - 1` messages of `L` blocks
/// instead of `L(H - 1)` of one block: fewer, larger messages where each costs a network
/// round trip. Within a host each block crosses once more, and the blocks are rearranged
/// locally three times, in scratch space of four times the receive buffer; so the table
/// picks it for small blocks only ([`super::ALL_TO_ALL_TWO_LEVEL_BYTES`]). `None` when the
/// hosts hold different numbers of ranks.
pub fn all_to_all(rank: usize, layout: &HostLayout, count: usize, segment: usize) -> Option<Schedule> {
    let (per_host, hosts) = (layout.ranks_per_host()?, layout.hosts());
    let my_host = layout.host_of(rank);
    let j = layout.members(my_host).iter().position(|r| *r == rank)?;
    let at: Vec<Vec<usize>> = (0..hosts).map(|h| layout.members(h)).collect();
    let total = layout.world() * count;
    let mut s = Schedule::new();
    s.need_scratch(4 * total);
    // Four regions of scratch, each `L · H` blocks: what goes to each local rank (column by
    // column, host by host), what came from each, the same rearranged by destination host,
    // and what came from each host.
    let region =
        |r: usize, first: usize, blocks: usize| Span::new(Slot::Scratch, r * total + first * count, blocks * count);
    let (to_local, from_local, to_host, from_host) = (0, 1, 2, 3);
    let input = |r: usize| Span::new(Slot::Input, r * count, count);
    let data = |r: usize| Span::new(Slot::Data, r * count, count);
    for i in 0..per_host {
        for (h, members) in at.iter().enumerate() {
            let place = if i == j { region(from_local, i * hosts + h, 1) } else { region(to_local, i * hosts + h, 1) };
            s.copy(input(members[i]), place);
        }
    }
    // Within the host, pairwise: H blocks to each local rank.
    let local = |i: usize| (at[my_host][i], region(to_local, i * hosts, hosts), region(from_local, i * hosts, hosts));
    pairwise(&mut s, per_host, j, segment, local, |_, _| {});
    // From local rank i's column for host h, to host h's message (or, for this host, home).
    for (i, source) in at[my_host].iter().enumerate() {
        for h in 0..hosts {
            let place = if h == my_host { data(*source) } else { region(to_host, h * per_host + i, 1) };
            s.copy(region(from_local, i * hosts + h, 1), place);
        }
    }
    // Across the hosts, pairwise among local index j: L blocks to each host, each block
    // put in place as soon as its host's message is in.
    let host =
        |h: usize| (at[h][j], region(to_host, h * per_host, per_host), region(from_host, h * per_host, per_host));
    pairwise(&mut s, hosts, my_host, segment, host, |s, from| {
        for (i, source) in at[from].iter().enumerate() {
            s.copy(region(from_host, from * per_host + i, 1), data(*source));
        }
    });
    Some(s)
}

/// A pairwise exchange among `n` members (this rank is member `me`): in step `k` it sends
/// member `me + k` its span and receives member `me - k`'s, in segments of at most `segment`
/// elements, then calls `received` for that member. `member(i)` is member `i`'s rank, the span
/// sent to it and the span its message fills.
fn pairwise(
    s: &mut Schedule,
    n: usize,
    me: usize,
    segment: usize,
    member: impl Fn(usize) -> (usize, Span, Span),
    mut received: impl FnMut(&mut Schedule, usize),
) {
    for k in 1..n {
        let (to, from) = ((me + k) % n, (me + n - k) % n);
        let ((to_rank, out, _), (from_rank, _, into)) = (member(to), member(from));
        for seg in out.segments(segment) {
            s.send(to_rank, seg);
        }
        for seg in into.segments(segment) {
            s.recv(from_rank, seg);
        }
        received(s, from);
    }
}

/// What a ring pass does with what it receives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Reduce-scatter: reduce it in, so member `i`'s bundle ends reduced over the ring at `i`.
    Reduce,
    /// All-gather: keep it, so every member ends with every bundle.
    Gather,
}

/// A ring among `ring` (this rank is `ring[me]`), in place, where member `i`'s share is the
/// spans `bundle(i)`, in segments of at most `segment` elements, each passed on as soon as it
/// is in. Reduce: step k sends bundle me-k-1 and reduces in bundle me-k-2, which goes on at
/// step k+1; the last one in, bundle me, stays. Gather: the same one bundle later, starting
/// with this rank's own.
fn ring_pass(
    s: &mut Schedule,
    ring: &[usize],
    me: usize,
    bundle: impl Fn(usize) -> Vec<Span>,
    segment: usize,
    pass: Pass,
) {
    let n = ring.len();
    if n == 1 {
        return;
    }
    let (next, prev) = (ring[(me + 1) % n], ring[(me + n - 1) % n]);
    let lag = usize::from(pass == Pass::Reduce);
    for span in bundle((me + n - lag) % n) {
        for seg in span.segments(segment) {
            s.send(next, seg);
        }
    }
    for k in 0..n - 1 {
        for span in bundle((me + 2 * n - k - 1 - lag) % n) {
            for seg in span.segments(segment) {
                match pass {
                    Pass::Reduce => s.recv_reduce(prev, seg),
                    Pass::Gather => s.recv(prev, seg),
                }
                if k < n - 2 {
                    s.send(next, seg);
                }
            }
        }
    }
}

/// A step of a rank that keeps its running result in scratch space instead of its buffer.
fn into_scratch(step: Step) -> Step {
    let at = |span: Span| if span.slot == Slot::Data { Span::new(Slot::Scratch, span.offset, span.len) } else { span };
    match step {
        Step::Send { to, src } => Step::Send { to, src: at(src) },
        Step::Recv { from, dst, reduce } => Step::Recv { from, dst: at(dst), reduce },
        Step::Copy { src, dst } => Step::Copy { src: at(src), dst: at(dst) },
        Step::Reduce { src, dst } => Step::Reduce { src: at(src), dst: at(dst) },
    }
}

/// One level of the broadcast: the flat table's choice for `world` ranks.
fn level_broadcast(rank: usize, world: usize, count: usize, root: usize, elem_size: usize) -> Schedule {
    let bytes = count.saturating_mul(elem_size);
    match super::select(super::Collective::Broadcast { root }, bytes, world) {
        super::Algorithm::PipelinedChain { segment_bytes } => {
            super::rooted::broadcast_chain(rank, world, count, root, (segment_bytes / elem_size.max(1)).max(1))
        }
        _ => super::rooted::broadcast_binomial(rank, world, count, root),
    }
}

/// The two-level allreduce of `rank` on `count` elements, forwarding segments of at most
/// `segment` elements as soon as they are reduced. `None` when the hosts hold different
/// numbers of ranks.
///
/// Cost per rank: `2(L-1)` messages of `count/L` elements within the host and `2(H-1)`
/// messages of `count/(L·H)` between hosts, for `H` hosts of `L` ranks.
pub fn allreduce(rank: usize, layout: &HostLayout, count: usize, segment: usize) -> Option<Schedule> {
    let per_host = layout.ranks_per_host()?;
    let mut s = Schedule::new();
    let local = layout.members(layout.host_of(rank));
    let j = local.iter().position(|r| *r == rank)?;
    let all = Span::new(Slot::Data, 0, count);
    let block = all.part(per_host, j);
    ring_pass(&mut s, &local, j, |i| vec![all.part(per_host, i)], segment, Pass::Reduce);
    // Block j across the hosts, among the ranks of local index j.
    let peers: Vec<usize> = (0..layout.hosts()).map(|h| layout.members(h)[j]).collect();
    let me = layout.host_of(rank);
    let across = super::allreduce::ring(me, peers.len(), block.len, segment);
    s.steps.extend(across.steps.into_iter().map(|step| moved(step, &peers, block.offset)));
    ring_pass(&mut s, &local, j, |i| vec![all.part(per_host, i)], segment, Pass::Gather);
    Some(s)
}

/// A step of a schedule made for ranks `0..peers.len()` on a buffer of its own, as the step
/// of rank `peers[i]` on the span of the real buffer that starts at `offset`.
fn moved(step: Step, peers: &[usize], offset: usize) -> Step {
    let at = |span: Span| Span::new(span.slot, span.offset + offset, span.len);
    match step {
        Step::Send { to, src } => Step::Send { to: peers[to], src: at(src) },
        Step::Recv { from, dst, reduce } => Step::Recv { from: peers[from], dst: at(dst), reduce },
        Step::Copy { src, dst } => Step::Copy { src: at(src), dst: at(dst) },
        Step::Reduce { src, dst } => Step::Reduce { src: at(src), dst: at(dst) },
    }
}
