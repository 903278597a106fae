//! NCCL within a host for `Buf<T, Cuda>` collectives (feature `nccl`).
//!
//! On a host without a GPU or libnccl (CI): the absence is named clearly, device buffers fail
//! to be made with a clear error, and nothing panics or hangs. With one GPU and libnccl:
//! - a communicator of one runs every NCCL operation on the device through nexar's bindings;
//! - two ranks on the one GPU (which NCCL refuses: "Duplicate GPU detected") fall back to host
//!   staging, logged once, with correct results;
//! - two and three ranks on as many fake hosts with the two-level allreduce pinned run the
//!   two-level allreduce, broadcast, reduce, all-gather and reduce-scatter for real: an NCCL
//!   communicator of one per host, nexar across the hosts.
//!
//! With two GPUs or more, the two ranks of one host run on NCCL.
#![cfg(feature = "nccl")]

use nexar::prelude::*;
use nexar::{Algorithm, NcclComm, NcclId, NcclState, RecvBuf, SendBuf, nccl_version};
use nexar_types::{Cuda, cuda_device_count};

use crate::common;
use crate::common::{TEST_LIMIT, on_each};

fn gpus() -> usize {
    cuda_device_count().unwrap_or(0)
}

#[test]
fn nccl_is_found_or_its_absence_is_named() {
    match nccl_version() {
        Ok((major, minor, patch)) => {
            assert!(major >= 2, "NCCL {major}.{minor}.{patch}");
            println!("NCCL {major}.{minor}.{patch} with {} GPUs", gpus());
        }
        Err(e) => {
            let text = e.to_string();
            assert!(text.contains("CUDA driver") || text.contains("libnccl"), "{text}");
            println!("no NCCL here: {text}");
        }
    }
}

/// A communicator of one on device 0, through the bindings alone: the call is enqueued,
/// polled to its end, and leaves the data as a sum over one rank does.
#[test]
fn a_communicator_of_one_runs_on_the_device() {
    if gpus() == 0 || nccl_version().is_err() {
        let err = NcclId::new().unwrap_err();
        println!("no GPU or no NCCL here: {err}");
        return;
    }
    let id = NcclId::new().unwrap();
    let comm = NcclComm::join(0, 0, 1, &id).unwrap();
    let wait = |mut flight: nexar::NcclInFlight<'_>| {
        while !flight.poll().unwrap() {
            std::thread::yield_now();
        }
    };
    let data: Vec<f32> = (0..1_000_003).map(|i| i as f32).collect();
    let mut buf = Buf::<f32, Cuda>::from_host(0, &data).unwrap();
    {
        let mut operand = buf.nccl_operand().unwrap();
        wait(comm.all_reduce(&mut operand, nexar::ReduceOp::Max).unwrap());
        wait(comm.reduce(&mut operand, nexar::ReduceOp::Sum, 0).unwrap());
        wait(comm.broadcast(&mut operand, 0).unwrap());
        wait(comm.reduce_scatter(&mut operand, nexar::ReduceOp::Sum).unwrap());
        wait(comm.all_gather(&mut operand).unwrap());
        // Ranges to and from host memory, checked.
        let mut part = vec![0f32; 5];
        operand.copy_out(10..15, &mut part).unwrap();
        assert_eq!(part, data[10..15]);
        operand.copy_in(10..15, &[-1.0; 5]).unwrap();
        assert!(operand.copy_out(10..16, &mut part).is_err(), "a host side of another length");
        assert!(operand.copy_in(1_000_000..1_000_004, &[0.0; 4]).is_err(), "past the end");
        assert!(comm.broadcast(&mut operand, 1).is_err(), "a root outside the communicator");
        // Ranges past 64 KiB go through pinned buffers in chunks, from any offset.
        let mut big = vec![0f32; 600_001];
        operand.copy_out(300_001..900_002, &mut big).unwrap();
        assert!(big == data[300_001..900_002], "a large range out at an offset");
        let twice: Vec<f32> = big.iter().map(|x| x * 2.0).collect();
        operand.copy_in(300_001..900_002, &twice).unwrap();
    }
    let mut expect = data.clone();
    expect[300_001..900_002].iter_mut().for_each(|x| *x *= 2.0);
    expect[10..15].fill(-1.0);
    assert_eq!(buf.to_host().unwrap(), expect);
    // The out-of-place forms read one buffer and write another; copies within the device.
    let send = Buf::<f32, Cuda>::from_host(0, &data[..1000]).unwrap();
    let mut recv = Buf::<f32, Cuda>::zeros_on(0, 1000).unwrap();
    {
        let source = send.nccl_source().unwrap();
        let mut into = recv.nccl_operand().unwrap();
        wait(comm.reduce_from(&source, &mut into, nexar::ReduceOp::Sum, 0).unwrap());
        wait(comm.all_gather_from(&source, &mut into).unwrap());
        wait(comm.reduce_scatter_from(&source, &mut into, nexar::ReduceOp::Max).unwrap());
        let mut scratch = into.scratch(10).unwrap();
        let mut room = scratch.operand();
        room.copy_within_device(2, &source, 5..10).unwrap();
        room.synchronize().unwrap();
        let mut back = vec![0f32; 10];
        room.copy_out(0..10, &mut back).unwrap();
        assert_eq!(back, [0.0, 0.0, 5.0, 6.0, 7.0, 8.0, 9.0, 0.0, 0.0, 0.0]);
        assert!(room.copy_within_device(6, &source, 0..5).is_err(), "past the end of the target");
        assert!(room.copy_within_device(0, &source, 999..1001).is_err(), "past the end of the source");
        let mut longer = Buf::<f32, Cuda>::zeros_on(0, 1001).unwrap();
        let mut longer = longer.nccl_operand().unwrap();
        assert!(comm.all_gather_from(&source, &mut longer).is_err(), "lengths that do not fit one rank");
    }
    assert_eq!(recv.to_host().unwrap(), data[..1000], "each form copies the one rank's data");
    assert_eq!(send.to_host().unwrap(), data[..1000], "the send side is only read");
    let mut halves = Buf::<u16, Cuda>::zeros_on(0, 4).unwrap();
    assert!(halves.nccl_operand().is_none(), "NCCL has no 16-bit integers");
}

async fn device_collectives(comm: NexarClient) -> NcclState {
    let (r, w) = (comm.rank(), comm.world_size());
    let dev = r % gpus();
    let n = 300_001;
    let mut grads = Buf::<f32, Cuda>::from_host(dev, &vec![r as f32 + 1.0; n]).unwrap();
    comm.all_reduce(&mut grads, Sum).await.unwrap();
    assert!(grads.to_host().unwrap().iter().all(|x| *x == (w * (w + 1) / 2) as f32));
    let mut weights = Buf::<u32, Cuda>::from_host(dev, &vec![if r == 1 { 7 } else { r as u32 }; 333]).unwrap();
    comm.broadcast(&mut weights, 1).await.unwrap();
    assert_eq!(weights.to_host().unwrap(), vec![7; 333]);
    // Reduce: the root's buffer ends with the sum, every other rank's is as it was.
    let mut partial = Buf::<f32, Cuda>::from_host(dev, &vec![r as f32 + 1.0; 1001]).unwrap();
    comm.reduce(&mut partial, Sum, w - 1).await.unwrap();
    let expect = if r == w - 1 { (w * (w + 1) / 2) as f32 } else { r as f32 + 1.0 };
    assert_eq!(partial.to_host().unwrap(), vec![expect; 1001], "reduce on rank {r}");
    // All-gather: every rank's block in rank order.
    let block = 257;
    let mine: Vec<i64> = (0..block).map(|i| (r * 1000 + i) as i64).collect();
    let send = Buf::<i64, Cuda>::from_host(dev, &mine).unwrap();
    let mut all = Buf::<i64, Cuda>::zeros_on(dev, block * w).unwrap();
    comm.all_gather(&send, &mut all).await.unwrap();
    let expect: Vec<i64> = (0..w).flat_map(|q| (0..block).map(move |i| (q * 1000 + i) as i64)).collect();
    assert_eq!(all.to_host().unwrap(), expect, "all-gather on rank {r}");
    assert_eq!(send.to_host().unwrap(), mine, "all-gather leaves send as it was");
    // Reduce-scatter: block q of rank p holds (p + 1) * (q + 1) * 1000 + i.
    let full: Vec<f64> = (0..w).flat_map(|q| (0..block).map(move |i| ((r + 1) * (q + 1) * 1000 + i) as f64)).collect();
    let send = Buf::<f64, Cuda>::from_host(dev, &full).unwrap();
    let mut part = Buf::<f64, Cuda>::zeros_on(dev, block).unwrap();
    comm.reduce_scatter(&send, &mut part, Sum).await.unwrap();
    let expect: Vec<f64> = (0..block).map(|i| ((w * (w + 1) / 2) * (r + 1) * 1000 + w * i) as f64).collect();
    assert_eq!(part.to_host().unwrap(), expect, "reduce-scatter on rank {r}");
    // Lengths that do not fit: the staged path's error, on every rank.
    let mut short = Buf::<f64, Cuda>::zeros_on(dev, block - 1).unwrap();
    let err = comm.reduce_scatter(&send, &mut short, Sum).await.unwrap_err();
    assert!(err.to_string().contains("elements"), "{err}");
    // Empty buffers: nothing to move, on every rank alike.
    let mut none = Buf::<f32, Cuda>::zeros_on(dev, 0).unwrap();
    comm.all_reduce(&mut none, Sum).await.unwrap();
    let mut gathered = Buf::<f32, Cuda>::zeros_on(dev, 0).unwrap();
    comm.all_gather(&none, &mut gathered).await.unwrap();
    // A window of a device buffer as a buffer of its own (segment by segment where the
    // configuration's segments are smaller); the elements around it stay as they were.
    let mut big = Buf::<f32, Cuda>::from_host(dev, &vec![1.0; 400_000]).unwrap();
    {
        let mut operand = big.nccl_operand().unwrap();
        assert!(operand.window(399_999..400_001).is_err(), "a window past the end");
        let mut window = operand.window(100_001..350_001).unwrap();
        comm.all_reduce(&mut window, Sum).await.unwrap();
    }
    let big = big.to_host().unwrap();
    assert!(big[100_001..350_001].iter().all(|x| *x == w as f32), "the window reduced on rank {r}");
    assert!(big[..100_001].iter().chain(&big[350_001..]).all(|x| *x == 1.0), "outside the window on rank {r}");
    // Reductions and types NCCL lacks are staged, on every rank alike.
    let mut bits = Buf::<u32, Cuda>::from_host(dev, &[1 << r; 5]).unwrap();
    comm.all_reduce(&mut bits, BitOr).await.unwrap();
    assert_eq!(bits.to_host().unwrap(), vec![(1 << w) - 1; 5]);
    let mut shorts = Buf::<i16, Cuda>::from_host(dev, &[r as i16; 9]).unwrap();
    comm.all_reduce(&mut shorts, Max).await.unwrap();
    assert_eq!(shorts.to_host().unwrap(), vec![w as i16 - 1; 9]);
    // Again after whatever the first call decided.
    let mut again = Buf::<f64, Cuda>::from_host(dev, &[r as f64; 17]).unwrap();
    comm.all_reduce(&mut again, Sum).await.unwrap();
    assert_eq!(again.to_host().unwrap(), vec![(w * (w - 1) / 2) as f64; 17]);
    comm.nccl_state()
}

/// Rank 0 passes device memory and the others host memory to one allreduce; then every rank
/// runs one more. The first call's outcome (its error, in words) and the second's result.
async fn mixed_memory(comm: NexarClient) -> (Result<(), String>, u32) {
    let first = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        if comm.rank() == 0 {
            let mut grads = Buf::<f32, Cuda>::from_host(0, &[1.0; 64]).unwrap();
            comm.all_reduce(&mut grads, Sum).await
        } else {
            comm.all_reduce(&mut [1.0f32; 64][..], Sum).await
        }
    })
    .await
    .expect("a call of mixed memory hung");
    let mut next = [1u32];
    comm.all_reduce(&mut next[..], Sum).await.unwrap();
    (first.map_err(|e| e.to_string()), next[0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_collectives_run_on_nccl_or_are_staged_with_a_reason() {
    common::logs();
    tokio::time::timeout(TEST_LIMIT, async {
        if gpus() == 0 {
            let err = Buf::<f32, Cuda>::zeros_on(0, 16).unwrap_err();
            assert!(err.to_string().contains("CUDA"), "{err}");
            println!("no GPU here: {err}");
            return;
        }
        let ranks = NexarClient::bootstrap_local(2).await.unwrap();
        let states = on_each(&ranks, device_collectives).await;
        println!("NCCL with {} GPUs: {states:?}", gpus());
        // Device memory on one rank and host memory on the other in one call: the device rank
        // asks the others about NCCL first, so the two calls do not match. Both are refused
        // with an error naming the mismatch (not a hang), and the next call runs.
        let mixed = on_each(&ranks, mixed_memory).await;
        println!("device and host memory in one call: {mixed:?}");
        for (rank, (outcome, next)) in mixed.iter().enumerate() {
            let err = outcome.as_ref().expect_err("a mixed call is refused");
            assert!(
                err.contains("rank 0 passed device memory") && err.contains("rank 1 passed host memory"),
                "rank {rank}: {err}"
            );
            assert_eq!(*next, 2, "the call after it runs on rank {rank}");
        }
        match (gpus(), nccl_version()) {
            (2.., Ok(_)) => {
                assert!(states.iter().all(|s| matches!(s, NcclState::Ready { ranks: 2, .. })), "{states:?}")
            }
            // NCCL refuses two ranks on one GPU.
            (_, Ok(_)) => assert!(states.iter().all(|s| matches!(s, NcclState::Unusable { .. })), "{states:?}"),
            // Without libnccl the ranks agree to stage before trying.
            (_, Err(_)) => assert!(states.iter().all(|s| *s == NcclState::NotTried), "{states:?}"),
        }
        // Two and three fake hosts of one rank each, the two-level allreduce pinned: an NCCL
        // communicator of one per host (no duplicate GPU within one), nexar between the hosts;
        // three hosts exercise the two-level block orders with more than two.
        for hosts in [&["a", "b"][..], &["a", "b", "c"]] {
            let configs = hosts
                .iter()
                .map(|h| {
                    NexarConfig::builder()
                        .host_id(*h)
                        .allreduce_algorithm(Algorithm::Hierarchical { segment_bytes: 1 << 20 })
                        // Segments of 256 KiB: the large allreduces cross hosts in segments.
                        .segment_bytes(256 << 10)
                        .build()
                        .unwrap()
                })
                .collect();
            let ranks = NexarClient::bootstrap_local_each(configs).await.unwrap();
            let states = on_each(&ranks, device_collectives).await;
            println!("{} hosts of one rank: {states:?}", hosts.len());
            match nccl_version() {
                Ok(_) => assert!(states.iter().all(|s| matches!(s, NcclState::Ready { ranks: 1, .. })), "{states:?}"),
                Err(_) => assert!(states.iter().all(|s| matches!(s, NcclState::NotTried)), "{states:?}"),
            }
        }
        let off = NexarConfig::builder().nccl(false).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(2, off).await.unwrap();
        let states = on_each(&ranks, device_collectives).await;
        assert!(states.iter().all(|s| *s == NcclState::NotTried), "NEXAR_NCCL=off never tries: {states:?}");
    })
    .await
    .expect("test timed out");
}
