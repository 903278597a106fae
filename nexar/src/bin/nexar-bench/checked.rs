//! One size of one collective: checked once with known data (`#wrong`), then timed over
//! `-n` iterations after `-w` warm-ups, every element type through the same path.

use std::time::Instant;

use nexar::prelude::*;
use nexar::{CollectiveError, bf16, f16};

use super::spread::Spread;
use super::{Args, Op, Row};

/// Small integers are exact in every element type, so results compare exactly.
fn val<T: Element + FromSmall>(rank: usize, i: usize) -> T {
    T::from_small(((rank * 7 + i * 3) % 5) as u8)
}

pub(super) trait FromSmall {
    fn from_small(v: u8) -> Self;
}
macro_rules! from_small {
    ($($t:ty => $e:expr),*) => {$(impl FromSmall for $t { fn from_small(v: u8) -> Self { let f: fn(u8) -> $t = $e; f(v) } })*};
}
from_small!(f32 => |v| v as f32, f64 => |v| v as f64, f16 => |v| f16::from_f32(v as f32), bf16 => |v| bf16::from_f32(v as f32),
    i32 => |v| v as i32, i64 => |v| v as i64, u8 => |v| v);

pub(super) trait Summable: Element + FromSmall {
    fn add(self, other: Self) -> Self;
}
macro_rules! summable {
    ($($t:ty),*) => {$(impl Summable for $t { fn add(self, o: Self) -> Self { self + o } })*};
}
summable!(f32, f64, f16, bf16, i32, i64);
impl Summable for u8 {
    fn add(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
}

async fn one<T: Summable>(
    comm: &NexarClient,
    op: Op,
    send: &[T],
    recv: &mut [T],
    feedback: &mut nexar::ErrorFeedback,
) -> Result<(), CollectiveError> {
    let (r, w) = (comm.rank(), comm.world_size());
    match op {
        Op::Allreduce => comm.all_reduce(recv, ReduceOp::Sum).await,
        Op::AllreduceBf16 => compressed(comm, recv, nexar::Compression::Bf16).await,
        Op::AllreduceF16 => compressed(comm, recv, nexar::Compression::F16).await,
        Op::AllreduceTopk => comm.all_reduce_topk(f32s(comm, recv)?, Sum, feedback).await,
        Op::Broadcast => comm.broadcast(recv, 0).await,
        Op::Allgather => comm.all_gather(send, recv).await,
        Op::ReduceScatter => comm.reduce_scatter(send, recv, ReduceOp::Sum).await,
        Op::Alltoall => comm.all_to_all(send, recv).await,
        Op::Reduce => comm.reduce(recv, ReduceOp::Sum, 0).await,
        Op::Gather => comm.gather(send, recv, 0).await,
        Op::Scatter => comm.scatter(send, recv, 0).await,
        Op::Barrier | Op::Rpc | Op::Plan | Op::Soak | Op::Simulate => comm.barrier().await,
        Op::Sendrecv => {
            let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
            let (s, v) = tokio::join!(comm.send(send, next, 0), comm.recv(recv, prev, 0));
            s.and(v).map_err(|e| CollectiveError::Internal { rank: r, op: "sendrecv", what: e.to_string() })
        }
        Op::Pingpong => {
            let failed =
                |e: nexar::P2pError| CollectiveError::Internal { rank: r, op: "pingpong", what: e.to_string() };
            match r {
                0 => {
                    comm.send(send, 1, 0).await.map_err(failed)?;
                    comm.recv(recv, 1, 0).await.map_err(failed)
                }
                1 => {
                    comm.recv(recv, 0, 0).await.map_err(failed)?;
                    comm.send(&*recv, 0, 0).await.map_err(failed)
                }
                _ => Ok(()),
            }
        }
    }
}

/// The compressed allreduce, which takes f32 elements only.
async fn compressed<T: Summable>(
    comm: &NexarClient,
    recv: &mut [T],
    compression: nexar::Compression,
) -> Result<(), CollectiveError> {
    comm.all_reduce_compressed(f32s(comm, recv)?, Sum, compression).await
}

/// `recv` as the f32 elements the compressed allreduces take.
fn f32s<'a, T: Summable>(comm: &NexarClient, recv: &'a mut [T]) -> Result<&'a mut [f32], CollectiveError> {
    if T::DTYPE != nexar::DType::F32 {
        return Err(CollectiveError::InvalidArgument {
            rank: comm.rank(),
            op: "nexar-bench",
            reason: "the compressed allreduces take f32 elements: run them with -d f32".into(),
        });
    }
    Ok(bytemuck::cast_slice_mut::<T, f32>(recv))
}

/// Buffer lengths `(send, recv)` for a message of `count` elements.
fn lengths(op: Op, count: usize, w: usize) -> (usize, usize) {
    match op {
        Op::Allgather | Op::Gather => (count / w, count / w * w),
        Op::ReduceScatter | Op::Scatter => (count / w * w, count / w),
        Op::Alltoall => (count / w * w, count / w * w),
        Op::Allreduce | Op::AllreduceBf16 | Op::AllreduceF16 | Op::AllreduceTopk | Op::Broadcast | Op::Reduce => {
            (0, count)
        }
        Op::Sendrecv | Op::Pingpong => (count, count),
        Op::Barrier | Op::Rpc | Op::Plan | Op::Soak | Op::Simulate => (0, 0),
    }
}

/// Elements that differ from what `op` must produce, given inputs from `val`.
fn wrong<T: Summable>(op: Op, r: usize, w: usize, send_len: usize, recv: &[T]) -> u64 {
    let expect = |i: usize| -> T {
        match op {
            // Small integers: exact in 16 bits too.
            Op::Allreduce | Op::AllreduceBf16 | Op::AllreduceF16 | Op::AllreduceTopk => {
                (1..w).fold(val::<T>(0, i), |a, q| a.add(val(q, i)))
            }
            Op::Reduce if r == 0 => (1..w).fold(val::<T>(0, i), |a, q| a.add(val(q, i))),
            Op::Gather if r == 0 => val(i / send_len.max(1), i % send_len.max(1)),
            // Other ranks' buffers are left as they were.
            Op::Reduce | Op::Gather => val(r, i),
            Op::Scatter => val(0, r * recv.len() + i),
            Op::Broadcast => val(0, i),
            Op::Allgather => val(i / send_len.max(1), i % send_len.max(1)),
            Op::ReduceScatter => (1..w).fold(val::<T>(0, r * recv.len() + i), |a, q| a.add(val(q, r * recv.len() + i))),
            Op::Alltoall => {
                let block = recv.len() / w;
                val(i / block.max(1), r * block + i % block.max(1))
            }
            Op::Sendrecv => val((r + w - 1) % w, i),
            // Rank 0's message, there and back; other ranks' buffers are left as they were.
            Op::Pingpong if r < 2 => val(0, i),
            Op::Pingpong => val(r, i),
            Op::Barrier | Op::Rpc | Op::Plan | Op::Soak | Op::Simulate => T::zeroed(),
        }
    };
    recv.iter().enumerate().filter(|(i, v)| bytemuck::bytes_of(*v) != bytemuck::bytes_of(&expect(*i))).count() as u64
}

pub(super) async fn run_size<T: Summable>(
    comm: &NexarClient,
    args: &Args,
    bytes: usize,
) -> Result<Row, CollectiveError> {
    let (r, w) = (comm.rank(), comm.world_size());
    let count = bytes / size_of::<T>();
    let (send_len, recv_len) = lengths(args.op, count, w);
    // Check once with known data.
    let send: Vec<T> = (0..send_len).map(|i| val(r, i)).collect();
    let mut recv: Vec<T> =
        (0..recv_len).map(|i| if args.op == Op::Broadcast && r != 0 { T::zeroed() } else { val(r, i) }).collect();
    // The check sends everything (ratio 1: the exact sum); the timing, the asked-for share.
    one(comm, args.op, &send, &mut recv, &mut nexar::ErrorFeedback::new(1.0)).await?;
    let mut feedback = nexar::ErrorFeedback::new(args.topk_ratio);
    let mut wrong_here = [wrong(args.op, r, w, send_len, &recv)];
    comm.all_reduce(&mut wrong_here, Sum).await?;
    // Time with zeros (no growth, no denormals), in the same buffers.
    let mut send = send;
    send.fill(T::zeroed());
    recv.fill(T::zeroed());
    for _ in 0..args.warmup {
        one(comm, args.op, &send, &mut recv, &mut feedback).await?;
    }
    comm.barrier().await?;
    let mut times = Vec::with_capacity(args.iters);
    for _ in 0..args.iters.max(1) {
        let start = Instant::now();
        one(comm, args.op, &send, &mut recv, &mut feedback).await?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    if args.op == Op::Pingpong {
        // One way: half the round trip.
        times.iter_mut().for_each(|t| *t /= 2.0);
    }
    let moved = recv_len.max(send_len) * size_of::<T>();
    row(comm, args, times, moved, recv_len.max(send_len), wrong_here[0]).await
}

/// A size's row from its per-iteration times: the slowest rank's time per iteration, its
/// median, and the spread of the ranks' own medians.
async fn row(
    comm: &NexarClient,
    args: &Args,
    mut times: Vec<f64>,
    moved: usize,
    count: usize,
    wrong: u64,
) -> Result<Row, CollectiveError> {
    let w = comm.world_size();
    // Each rank's own median, summarised across ranks (for -a).
    let own = Spread::of(&times).p50;
    let (mut low, mut high, mut sum) = ([own], [own], [own]);
    comm.all_reduce(&mut low, Min).await?;
    comm.all_reduce(&mut high, Max).await?;
    comm.all_reduce(&mut sum, Sum).await?;
    let across = Some([low[0], sum[0] / w as f64, high[0]]);
    // The slowest rank's time for each iteration, then the median over iterations.
    comm.all_reduce(&mut times, Max).await?;
    let time_us = Spread::of(&times).p50;
    let algbw = if time_us > 0.0 { moved as f64 / time_us / 1e3 } else { 0.0 };
    let factor = match args.op {
        Op::Allreduce | Op::AllreduceBf16 | Op::AllreduceF16 | Op::AllreduceTopk => 2.0 * (w as f64 - 1.0) / w as f64,
        Op::Allgather | Op::ReduceScatter | Op::Alltoall | Op::Gather | Op::Scatter => (w as f64 - 1.0) / w as f64,
        _ => 1.0,
    };
    Ok(Row {
        bytes: moved,
        count,
        time_us,
        algbw,
        busbw: algbw * factor,
        wrong,
        iters: times,
        across,
        algorithm: match args.op {
            Op::Allreduce => comm.allreduce_algorithm(moved),
            Op::Broadcast => comm.broadcast_algorithm(moved),
            Op::Reduce => comm.reduce_algorithm(moved),
            // `moved` is the gathered (scattered) buffer: world blocks.
            Op::Allgather => comm.all_gather_algorithm(moved / w),
            Op::ReduceScatter => comm.reduce_scatter_algorithm(moved / w),
            Op::Alltoall => comm.all_to_all_algorithm(moved / w),
            _ => "",
        },
    })
}

/// One size of an allreduce, broadcast, reduce, all-gather or reduce-scatter of f32
/// `Buf<f32, Cuda>` on GPU `rank % GPUs`: checked once, then timed (each call returns once the
/// device holds the result, on NCCL or staged).
#[cfg(feature = "cuda")]
pub(super) async fn run_size_on_device(comm: &NexarClient, args: &Args, bytes: usize) -> Result<Row, CollectiveError> {
    use nexar::{Cuda, cuda_device_count};
    let (r, w) = (comm.rank(), comm.world_size());
    let device_error = |source| CollectiveError::Device { rank: r, op: "nexar-bench", source };
    let gpus = cuda_device_count().map_err(device_error)?.max(1);
    let count = bytes / size_of::<f32>();
    let (send_len, recv_len) = lengths(args.op, count, w);
    let dev = r % gpus;
    let send = Buf::<f32, Cuda>::from_host(dev, &(0..send_len).map(|i| val(r, i)).collect::<Vec<f32>>())
        .map_err(device_error)?;
    let start: Vec<f32> =
        (0..recv_len).map(|i| if args.op == Op::Broadcast && r != 0 { 0.0 } else { val(r, i) }).collect();
    let mut buf = Buf::<f32, Cuda>::from_host(dev, &start).map_err(device_error)?;
    let call = async |buf: &mut Buf<f32, Cuda>| match args.op {
        Op::Allreduce => comm.all_reduce(buf, Sum).await,
        Op::Broadcast => comm.broadcast(buf, 0).await,
        Op::Reduce => comm.reduce(buf, Sum, 0).await,
        Op::Allgather => comm.all_gather(&send, buf).await,
        Op::ReduceScatter => comm.reduce_scatter(&send, buf, Sum).await,
        _ => Err(CollectiveError::InvalidArgument {
            rank: r,
            op: "nexar-bench",
            reason: "--memory cuda runs allreduce, broadcast, reduce, allgather and reduce_scatter".into(),
        }),
    };
    call(&mut buf).await?;
    let mut wrong_here = [wrong(args.op, r, w, send_len, &buf.to_host().map_err(device_error)?)];
    comm.all_reduce(&mut wrong_here, Sum).await?;
    for _ in 0..args.warmup {
        call(&mut buf).await?;
    }
    comm.barrier().await?;
    let mut times = Vec::with_capacity(args.iters);
    for _ in 0..args.iters.max(1) {
        let start = Instant::now();
        call(&mut buf).await?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    let longer = recv_len.max(send_len);
    let measured = row(comm, args, times, longer * size_of::<f32>(), longer, wrong_here[0]).await?;
    // Where NCCL ran the calls, the host algorithm named by the size table did not.
    Ok(super::Row { algorithm: ran_on_nccl(comm).unwrap_or(measured.algorithm), ..measured })
}

/// What ran a device collective where NCCL did.
#[cfg(feature = "nccl")]
fn ran_on_nccl(comm: &NexarClient) -> Option<&'static str> {
    let ready = matches!(comm.nccl_state(), nexar::NcclState::Ready { .. });
    let hosts = comm.host_layout().map_or(1, |h| h.hosts());
    ready.then_some(if hosts > 1 { "nccl_within_hosts+nexar_across" } else { "nccl" })
}

#[cfg(all(feature = "cuda", not(feature = "nccl")))]
fn ran_on_nccl(_: &NexarClient) -> Option<&'static str> {
    None
}

/// Without the feature `cuda` there is no device memory to measure.
#[cfg(not(feature = "cuda"))]
pub(super) async fn run_size_on_device(comm: &NexarClient, _: &Args, _: usize) -> Result<Row, CollectiveError> {
    Err(CollectiveError::InvalidArgument {
        rank: comm.rank(),
        op: "nexar-bench",
        reason: "--memory cuda needs a build with the feature `cuda` (or `nccl`)".into(),
    })
}
