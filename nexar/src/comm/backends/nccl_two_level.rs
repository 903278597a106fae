//! The two-level device collectives on NCCL (feature `nccl`): NCCL among the ranks of each
//! host, nexar's own links among the ranks of one local index across the hosts. `nccl.rs`
//! decides, per call and on every rank alike, that NCCL runs it, and makes the communicators;
//! these functions are the data movement once it does.

use nexar_types::{Element, NcclOperand, NcclSource, ReduceOp};

use crate::comm::backends::nccl::Step;
use crate::comm::backends::nccl_slot::NcclGroup;
use crate::comm::client::NexarClient;
use crate::comm::collective::Exchange;
use crate::proto::algo::Collective;
use crate::proto::algo::hierarchical::HostLayout;

impl NexarClient {
    /// The two-level allreduce: NCCL within the host, nexar across hosts.
    pub(in crate::comm) async fn nccl_all_reduce<T: Element>(
        &self,
        group: &NcclGroup,
        buf: &mut NcclOperand<'_, T>,
        op: ReduceOp,
    ) -> Result<(), Step> {
        let local = &group.local;
        let Some(across) = group.across.clone().map(|c| self.with_shared_comm(c)) else {
            return self.nccl_wait(local.all_reduce(buf, op)?).await;
        };
        let (n, per_host) = (buf.len(), local.size());
        // Across the hosts through a window of the device buffer: a large block goes in
        // segments whose copies overlap the network, as a staged allreduce's do.
        if n.is_multiple_of(per_host) {
            let block = n / per_host;
            let mine = local.rank() * block..(local.rank() + 1) * block;
            self.nccl_wait(local.reduce_scatter(buf, op)?).await?;
            let mut window = buf.window(mine)?;
            across.staged(Collective::AllReduce, Some(op), &mut window).await.map_err(Step::Across)?;
            return self.nccl_wait(local.all_gather(buf)?).await;
        }
        // Blocks of unequal length: through each host's leader.
        self.nccl_wait(local.reduce(buf, op, 0)?).await?;
        if local.rank() == 0 {
            let mut window = buf.window(0..n)?;
            across.staged(Collective::AllReduce, Some(op), &mut window).await.map_err(Step::Across)?;
        }
        self.nccl_wait(local.broadcast(buf, 0)?).await
    }

    /// The two-level broadcast: to the root's local index on every host over nexar, then NCCL
    /// within each host.
    pub(in crate::comm) async fn nccl_broadcast<T: Element>(
        &self,
        group: &NcclGroup,
        layout: &HostLayout,
        buf: &mut NcclOperand<'_, T>,
        root: usize,
    ) -> Result<(), Step> {
        let local = &group.local;
        let (root_host, root_index) = root_place(layout, root);
        if let Some(across) = group.across.clone().map(|c| self.with_shared_comm(c))
            && local.rank() == root_index
        {
            let n = buf.len();
            let mut host = vec![T::zeroed(); n];
            if self.rank() == root {
                buf.copy_out(0..n, &mut host)?;
            }
            across
                .staged(Collective::Broadcast { root: root_host }, None, &mut host[..])
                .await
                .map_err(Step::Across)?;
            if self.rank() != root {
                buf.copy_in(0..n, &host)?;
            }
        }
        self.nccl_wait(local.broadcast(buf, root_index)?).await
    }

    /// The two-level reduce: NCCL within each host to the rank of the root's local index,
    /// nexar across the hosts among those ranks to the root. A rank that gathers its host's
    /// partial without being the root does so into memory of its own: other ranks' buffers
    /// are left as they were.
    pub(in crate::comm) async fn nccl_reduce<T: Element>(
        &self,
        group: &NcclGroup,
        layout: &HostLayout,
        buf: &mut NcclOperand<'_, T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Step> {
        let local = &group.local;
        let (root_host, root_index) = root_place(layout, root);
        let across = match group.across.clone() {
            Some(across) if local.rank() == root_index => self.with_shared_comm(across),
            // One host, or a rank that only contributes: its buffer is only read.
            _ => return self.nccl_wait(local.reduce(buf, op, root_index)?).await,
        };
        let (n, up) = (buf.len(), Collective::Reduce { root: root_host });
        if self.rank() == root {
            self.nccl_wait(local.reduce(buf, op, root_index)?).await?;
            return across.staged(up, Some(op), &mut buf.window(0..n)?).await.map_err(Step::Across);
        }
        let mut scratch = buf.scratch(n)?;
        let mut partial = scratch.operand();
        self.nccl_wait(local.reduce_from(&buf.source(), &mut partial, op, root_index)?).await?;
        across.staged(up, Some(op), &mut partial.window(0..n)?).await.map_err(Step::Across)
    }

    /// The two-level all-gather: every rank's block to the ranks of its local index on every
    /// host over nexar, then NCCL within each host, then into rank order on the device.
    pub(in crate::comm) async fn nccl_all_gather<T: Element>(
        &self,
        group: &NcclGroup,
        layout: &HostLayout,
        send: &NcclSource<'_, T>,
        recv: &mut NcclOperand<'_, T>,
    ) -> Result<(), Step> {
        let local = &group.local;
        let Some(across) = group.across.clone().map(|c| self.with_shared_comm(c)) else {
            // One host: its ranks in rank order are NCCL's.
            return self.nccl_wait(local.all_gather_from(send, recv)?).await;
        };
        let order = BlockOrder::new(layout, local.size());
        let block = send.len();
        let mut mine = vec![T::zeroed(); block];
        send.copy_out(0..block, &mut mine)?;
        let mut gathered = vec![T::zeroed(); block * order.hosts];
        across.exchange_host(Exchange::AllGather, &mine[..], &mut gathered[..]).await.map_err(Step::Across)?;
        let mut scratch = recv.scratch(block * self.world_size())?;
        let mut by_index = scratch.operand();
        by_index.copy_in(order.span(local.rank(), block), &gathered)?;
        self.nccl_wait(local.all_gather(&mut by_index)?).await?;
        let from = by_index.source();
        for (at, rank) in order.ranks() {
            recv.copy_within_device(rank * block, &from, at * block..(at + 1) * block)?;
        }
        Ok(recv.synchronize()?)
    }

    /// The two-level reduce-scatter: the blocks into local-index order on the device, NCCL
    /// within each host (each rank ends with its host's sum of the blocks of its local index on
    /// every host), then nexar across the hosts among the ranks of one local index.
    pub(in crate::comm) async fn nccl_reduce_scatter<T: Element>(
        &self,
        group: &NcclGroup,
        layout: &HostLayout,
        send: &NcclSource<'_, T>,
        recv: &mut NcclOperand<'_, T>,
        op: ReduceOp,
    ) -> Result<(), Step> {
        let local = &group.local;
        let Some(across) = group.across.clone().map(|c| self.with_shared_comm(c)) else {
            return self.nccl_wait(local.reduce_scatter_from(send, recv, op)?).await;
        };
        let order = BlockOrder::new(layout, local.size());
        let block = recv.len();
        let mut scratch = recv.scratch(send.len())?;
        let mut by_index = scratch.operand();
        for (at, rank) in order.ranks() {
            by_index.copy_within_device(at * block, send, rank * block..(rank + 1) * block)?;
        }
        self.nccl_wait(local.reduce_scatter(&mut by_index, op)?).await?;
        let mut partial = vec![T::zeroed(); block * order.hosts];
        by_index.copy_out(order.span(local.rank(), block), &mut partial)?;
        let mut mine = vec![T::zeroed(); block];
        across.exchange_host(Exchange::ReduceScatter(op), &partial[..], &mut mine[..]).await.map_err(Step::Across)?;
        Ok(recv.copy_in(0..block, &mine)?)
    }
}

/// The root's host and its index among that host's ranks.
fn root_place(layout: &HostLayout, root: usize) -> (usize, usize) {
    let host = layout.host_of(root);
    (host, layout.members(host).iter().position(|r| *r == root).unwrap_or(0))
}

/// The order of the blocks of a two-level all-gather or reduce-scatter on the device: by local
/// index, then by host (`at = index * hosts + host`), so that the blocks of one local index
/// on every host lie together, as NCCL's per-rank blocks must.
struct BlockOrder {
    /// Ranks by host, then by local index.
    members: Vec<Vec<usize>>,
    hosts: usize,
    per_host: usize,
}

impl BlockOrder {
    fn new(layout: &HostLayout, per_host: usize) -> BlockOrder {
        let hosts = layout.hosts();
        BlockOrder { members: (0..hosts).map(|h| layout.members(h)).collect(), hosts, per_host }
    }

    /// Each block's place in this order, with the rank it belongs to.
    fn ranks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.per_host)
            .flat_map(move |index| (0..self.hosts).map(move |host| (index, host)))
            .map(|(index, host)| (index * self.hosts + host, self.members[host][index]))
    }

    /// The elements of local index `index`'s blocks, for blocks of `block` elements.
    fn span(&self, index: usize, block: usize) -> std::ops::Range<usize> {
        index * self.hosts * block..(index + 1) * self.hosts * block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-level all-gather and reduce-scatter, their data movement run in host memory
    /// exactly as the device steps run it (NCCL's in-place all-gather and reduce-scatter over
    /// each host's ranks, nexar's over each local index's), for hosts whose ranks are placed
    /// in blocks, round-robin and scattered.
    #[test]
    fn the_block_order_puts_every_rank_in_place() {
        let block = 3;
        for keys in [vec![1, 1, 2, 2, 3, 3], vec![1, 2, 3, 1, 2, 3], vec![5, 9, 9, 7, 5, 7], vec![4, 8]] {
            let layout = HostLayout::from_keys(&keys);
            let (world, per_host) = (layout.world(), layout.ranks_per_host().unwrap());
            let order = BlockOrder::new(&layout, per_host);
            let places: Vec<usize> = order.ranks().map(|(at, _)| at).collect();
            assert_eq!(places, (0..world).collect::<Vec<_>>(), "every place once, in order");
            let mut owners: Vec<usize> = order.ranks().map(|(_, rank)| rank).collect();
            owners.sort();
            assert_eq!(owners, (0..world).collect::<Vec<_>>(), "every rank once");
            let index_of = |r: usize| layout.members(layout.host_of(r)).iter().position(|m| *m == r).unwrap();

            // All-gather: rank r's block holds r * 100 + i.
            let send = |r: usize| (0..block).map(|i| r * 100 + i).collect::<Vec<_>>();
            for me in 0..world {
                // Across the hosts: the blocks of my local index, by host.
                let gathered: Vec<usize> =
                    (0..order.hosts).flat_map(|h| send(layout.members(h)[index_of(me)])).collect();
                // Within the host: every local index's span (what each local rank brought).
                let mut by_index = vec![0; block * world];
                for j in 0..per_host {
                    let theirs: Vec<usize> = (0..order.hosts).flat_map(|h| send(layout.members(h)[j])).collect();
                    by_index[order.span(j, block)].copy_from_slice(&theirs);
                }
                assert_eq!(by_index[order.span(index_of(me), block)], gathered[..]);
                let mut recv = vec![0; block * world];
                for (at, rank) in order.ranks() {
                    recv[rank * block..(rank + 1) * block].copy_from_slice(&by_index[at * block..(at + 1) * block]);
                }
                assert_eq!(recv, (0..world).flat_map(send).collect::<Vec<_>>(), "all-gather on rank {me} of {keys:?}");
            }

            // Reduce-scatter: rank p's block q holds p * 1000 + q * 10 + i.
            let full =
                |p: usize| (0..world).flat_map(|q| (0..block).map(move |i| p * 1000 + q * 10 + i)).collect::<Vec<_>>();
            let arranged = |p: usize| {
                let mut by_index = vec![0; block * world];
                for (at, rank) in order.ranks() {
                    by_index[at * block..(at + 1) * block].copy_from_slice(&full(p)[rank * block..(rank + 1) * block]);
                }
                by_index
            };
            for me in 0..world {
                let (host, index) = (layout.host_of(me), index_of(me));
                // Within the host: my span summed over my host's ranks.
                let partial = |h: usize| -> Vec<usize> {
                    let span = order.span(index, block);
                    layout.members(h).iter().fold(vec![0; span.len()], |mut acc, p| {
                        acc.iter_mut().zip(&arranged(*p)[span.clone()]).for_each(|(a, v)| *a += v);
                        acc
                    })
                };
                // Across the hosts: block `host` of every host's partial, summed.
                let mine: Vec<usize> =
                    (0..block).map(|i| (0..order.hosts).map(|h| partial(h)[host * block + i]).sum()).collect();
                let expect: Vec<usize> = (0..block).map(|i| (0..world).map(|p| p * 1000 + me * 10 + i).sum()).collect();
                assert_eq!(mine, expect, "reduce-scatter on rank {me} of {keys:?}");
            }
        }
    }
}
