//! NCCL within a host for `Buf<T, Cuda>` collectives (feature `nccl`).
//!
//! On a host without a GPU or libnccl (CI): the absence is named clearly, device buffers fail
//! to be made with a clear error, and nothing panics or hangs. With one GPU and libnccl:
//! - a communicator of one runs every NCCL operation on the device through nexar's bindings;
//! - two ranks on the one GPU (which NCCL refuses: "Duplicate GPU detected") fall back to host
//!   staging, logged once, with correct results;
//! - two ranks on two fake hosts with the two-level allreduce pinned run it for real: an NCCL
//!   communicator of one per host, nexar across the hosts.
//!
//! With two GPUs or more, the two ranks of one host run on NCCL.
#![cfg(feature = "nccl")]

mod common;

use common::{TEST_LIMIT, on_each};
use nexar::prelude::*;
use nexar::{Algorithm, NcclComm, NcclId, NcclState, RecvBuf, nccl_version};
use nexar_types::{Cuda, cuda_device_count};

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
    }
    let mut expect = data.clone();
    expect[10..15].fill(-1.0);
    assert_eq!(buf.to_host().unwrap(), expect);
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
        match (gpus(), nccl_version()) {
            (2.., Ok(_)) => {
                assert!(states.iter().all(|s| matches!(s, NcclState::Ready { ranks: 2, .. })), "{states:?}")
            }
            // NCCL refuses two ranks on one GPU.
            (_, Ok(_)) => assert!(states.iter().all(|s| matches!(s, NcclState::Unusable { .. })), "{states:?}"),
            // Without libnccl the ranks agree to stage before trying.
            (_, Err(_)) => assert!(states.iter().all(|s| *s == NcclState::NotTried), "{states:?}"),
        }
        // Two fake hosts of one rank each, the two-level allreduce pinned: an NCCL communicator
        // of one per host (no duplicate GPU within one), nexar between the hosts.
        let configs = ["a", "b"]
            .map(|h| {
                NexarConfig::builder()
                    .host_id(h)
                    .allreduce_algorithm(Algorithm::Hierarchical { segment_bytes: 1 << 20 })
                    .build()
                    .unwrap()
            })
            .to_vec();
        let ranks = NexarClient::bootstrap_local_each(configs).await.unwrap();
        let states = on_each(&ranks, device_collectives).await;
        println!("two hosts of one rank: {states:?}");
        match nccl_version() {
            Ok(_) => assert!(states.iter().all(|s| matches!(s, NcclState::Ready { ranks: 1, .. })), "{states:?}"),
            Err(_) => assert!(states.iter().all(|s| matches!(s, NcclState::NotTried)), "{states:?}"),
        }
        let off = NexarConfig::builder().nccl(false).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(2, off).await.unwrap();
        let states = on_each(&ranks, device_collectives).await;
        assert!(states.iter().all(|s| *s == NcclState::NotTried), "NEXAR_NCCL=off never tries: {states:?}");
    })
    .await
    .expect("test timed out");
}
