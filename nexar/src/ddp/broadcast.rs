//! Broadcasts of parameters and state from one rank: the initial weights from rank 0, and
//! what a rank that joins a running job needs (parameters, optimizer state, step counter).

use nexar_types::Element;

use super::DdpError;
use crate::comm::NexarClient;

/// Flattens `parts` into one buffer, broadcasts it from `root` and writes it back. The lengths
/// of the parts travel first (one small allreduce of their digest), so that ranks whose parts
/// differ get an error naming the first differing part instead of mixed-up tensors.
pub(super) async fn broadcast_parts<T: Element>(
    comm: &NexarClient,
    root: usize,
    parts: &mut [&mut [T]],
) -> Result<(), DdpError> {
    let rank = comm.rank();
    let collective = |source| DdpError::Collective { rank, op: "broadcast", source: Box::new(source) };
    check_root(comm, root)?;
    // The largest and the smallest of every length, and of the count, in one allreduce.
    let mut count = [parts.len() as u64, !(parts.len() as u64)];
    comm.all_reduce(&mut count[..], nexar_types::Max).await.map_err(collective)?;
    if count[0] != !count[1] {
        return Err(DdpError::InvalidArgument {
            rank,
            reason: format!(
                "broadcast: the ranks pass between {} and {} parts (this rank {})",
                !count[1],
                count[0],
                parts.len()
            ),
        });
    }
    let mut lens: Vec<u64> = Vec::with_capacity(2 * parts.len());
    for p in parts.iter() {
        lens.push(p.len() as u64);
        lens.push(!(p.len() as u64));
    }
    comm.all_reduce(&mut lens[..], nexar_types::Max).await.map_err(collective)?;
    if let Some(i) = lens.chunks(2).position(|l| l[0] != !l[1]) {
        return Err(DdpError::InvalidArgument {
            rank,
            reason: format!(
                "broadcast: part {i} has between {} and {} elements across the ranks (this rank {})",
                !lens[2 * i + 1],
                lens[2 * i],
                parts[i].len()
            ),
        });
    }
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut flat: Vec<T> = Vec::with_capacity(total);
    if rank == root {
        for p in parts.iter() {
            flat.extend_from_slice(p);
        }
    } else {
        flat.resize(total, T::zeroed());
    }
    comm.broadcast(&mut flat[..], root).await.map_err(collective)?;
    if rank != root {
        let mut at = 0;
        for p in parts.iter_mut() {
            p.copy_from_slice(&flat[at..at + p.len()]);
            at += p.len();
        }
    }
    Ok(())
}

/// Broadcasts `bytes` from `root`; the other ranks' `bytes` are replaced by the root's.
pub(super) async fn broadcast_bytes(comm: &NexarClient, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, DdpError> {
    let rank = comm.rank();
    let collective = |source| DdpError::Collective { rank, op: "broadcast_bytes", source: Box::new(source) };
    check_root(comm, root)?;
    let mut len = [bytes.len() as u64];
    comm.broadcast(&mut len[..], root).await.map_err(collective)?;
    // Every rank, the root too, checks the length before the bytes travel, so that all of them
    // skip the second collective alike.
    let limit = comm.config().max_message_bytes;
    if len[0] > limit {
        return Err(DdpError::InvalidArgument {
            rank,
            reason: format!("broadcast_bytes: rank {root} sends {} bytes, over max_message_bytes ({limit})", len[0]),
        });
    }
    if rank == root {
        let mut bytes = bytes;
        comm.broadcast(&mut bytes[..], root).await.map_err(collective)?;
        return Ok(bytes);
    }
    let mut got = vec![0u8; len[0] as usize];
    comm.broadcast(&mut got[..], root).await.map_err(collective)?;
    Ok(got)
}

fn check_root(comm: &NexarClient, root: usize) -> Result<(), DdpError> {
    if root >= comm.world_size() {
        return Err(DdpError::InvalidArgument {
            rank: comm.rank(),
            reason: format!("broadcast root {root} is not a rank of {} ranks", comm.world_size()),
        });
    }
    Ok(())
}
