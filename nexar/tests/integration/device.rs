//! `Buf<T, Cuda>` in collectives and send/recv (feature `cuda`). On a host with a GPU every
//! operation runs on device buffers and is checked; on a host without one, creating a device
//! buffer fails with a clear error and nothing panics or hangs.
#![cfg(feature = "cuda")]

use nexar::prelude::*;
use nexar_types::{Cuda, cuda_device_count};

use crate::common::{TEST_LIMIT, on_each};

async fn on_device(comm: NexarClient) {
    let (r, w) = (comm.rank(), comm.world_size());
    let dev = r % cuda_device_count().unwrap();
    let mut grads = Buf::<f32, Cuda>::from_host(dev, &vec![r as f32 + 1.0; 100_000]).unwrap();
    comm.all_reduce(&mut grads, Sum).await.unwrap();
    assert!(grads.to_host().unwrap().iter().all(|x| *x == (w * (w + 1) / 2) as f32));
    // 96 MiB: twelve 8 MiB segments staged through two reused pinned buffers.
    let n = 24 << 20;
    let mine: Vec<f32> = (0..n).map(|i| ((i * 7 + r * 13) % 1024) as f32).collect();
    let mut big = Buf::<f32, Cuda>::from_host(dev, &mine).unwrap();
    comm.all_reduce(&mut big, Sum).await.unwrap();
    let want = |i: usize| (0..w).map(|q| ((i * 7 + q * 13) % 1024) as f32).sum::<f32>();
    let got = big.to_host().unwrap();
    let wrong = got.iter().enumerate().filter(|(i, v)| **v != want(*i)).count();
    assert_eq!(wrong, 0, "rank {r}: {wrong} of {n} elements of a segmented device allreduce are wrong");
    let mut weights = Buf::<u32, Cuda>::from_host(dev, &vec![if r == 0 { 7 } else { 0 }; 333]).unwrap();
    comm.broadcast(&mut weights, 0).await.unwrap();
    assert_eq!(weights.to_host().unwrap(), vec![7; 333]);
    let mine = Buf::<i64, Cuda>::from_host(dev, &[r as i64; 4]).unwrap();
    let mut all = Buf::<i64, Cuda>::zeros_on(dev, 4 * w).unwrap();
    comm.all_gather(&mine, &mut all).await.unwrap();
    assert_eq!(all.to_host().unwrap(), (0..w as i64).flat_map(|q| [q; 4]).collect::<Vec<_>>());
    let next = (r + 1) % w;
    comm.send(&mine, next, 3).await.unwrap();
    let mut got = Buf::<i64, Cuda>::zeros_on(dev, 4).unwrap();
    comm.recv(&mut got, (r + w - 1) % w, 3).await.unwrap();
    assert_eq!(got.to_host().unwrap(), vec![((r + w - 1) % w) as i64; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_buffers_work_in_collectives_or_fail_clearly_without_a_gpu() {
    tokio::time::timeout(TEST_LIMIT, async {
        match cuda_device_count() {
            Ok(n) if n > 0 => {
                let ranks = NexarClient::bootstrap_local(2).await.unwrap();
                on_each(&ranks, on_device).await;
            }
            other => {
                let err = Buf::<f32, Cuda>::zeros_on(0, 16).unwrap_err();
                assert!(err.to_string().contains("CUDA") || err.to_string().contains("does not exist"), "{err}");
                println!("no GPU here ({other:?}): {err}");
            }
        }
    })
    .await
    .expect("test timed out");
}
