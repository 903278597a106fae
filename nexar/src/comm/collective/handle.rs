//! Collectives in the background: the `_start` forms, which own their buffers, and the
//! handles that give them back.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use nexar_types::{Buf, Element, ReduceOp, Reduction};
use tokio::task::JoinHandle;

use super::CollectiveError;
use crate::comm::client::NexarClient;
use crate::comm::exec::CollCall;
use crate::proto::algo::Collective;

/// A collective running in the background; `.await` it to get the buffer back.
///
/// The running collective owns the buffer, so forgetting or dropping the handle is sound:
/// the operation still completes with the other ranks (nobody is left waiting), and the buffer
/// is freed when it does.
#[must_use = "a collective handle does nothing unless awaited (the operation still runs)"]
pub struct CollectiveHandle<T: Element, Out = Buf<T>> {
    task: JoinHandle<Result<Out, CollectiveError>>,
    rank: usize,
    op: &'static str,
    _elem: std::marker::PhantomData<fn() -> T>,
}

/// A two-buffer collective running in the background; `.await` it to get `(send, recv)` back.
///
/// ```no_run
/// use nexar::prelude::*;
/// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
/// let w = comm.world_size();
/// let pending: nexar::ExchangeHandle<f32> = comm.all_gather_start(Buf::zeros(8), Buf::zeros(8 * w));
/// let (_send, gathered) = pending.await?;
/// # Ok(()) }
/// ```
pub type ExchangeHandle<T> = CollectiveHandle<T, (Buf<T>, Buf<T>)>;

/// The collectives with a send and a receive buffer.
#[derive(Clone, Copy)]
pub(in crate::comm) enum Exchange {
    AllGather,
    ReduceScatter(ReduceOp),
    AllToAll,
    Gather(usize),
    Scatter(usize),
}

impl<T: Element, Out> Future for CollectiveHandle<T, Out> {
    type Output = Result<Out, CollectiveError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (rank, op) = (self.rank, self.op);
        Pin::new(&mut self.task).poll(cx).map(|r| {
            r.unwrap_or_else(|e| {
                Err(CollectiveError::Internal { rank, op, what: format!("collective task failed: {e}") })
            })
        })
    }
}

impl NexarClient {
    /// Starts an allreduce in the background. The handle owns the buffer and gives it back
    /// when awaited; dropping or forgetting it is sound and leaves no peer waiting.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let pending = comm.all_reduce_start(Buf::from_vec(vec![1.0f32; 1024]), Sum);
    /// // ... compute something else ...
    /// let grads = pending.await?;
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_start<T: Element, O: Reduction<T>>(&self, buf: Buf<T>, op: O) -> CollectiveHandle<T> {
        let call = Self::call(Collective::AllReduce, Some(op.op()), buf.len());
        self.start(call, buf)
    }

    /// Starts a broadcast in the background; see [`all_reduce_start`](Self::all_reduce_start).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let weights = comm.broadcast_start(nexar::Buf::<f32>::zeros(256), 0).await?;
    /// # Ok(()) }
    /// ```
    pub fn broadcast_start<T: Element>(&self, buf: Buf<T>, root: usize) -> CollectiveHandle<T> {
        let call = Self::call(Collective::Broadcast { root }, None, buf.len());
        self.start(call, buf)
    }

    /// Starts a reduce in the background; see [`all_reduce_start`](Self::all_reduce_start).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let total = comm.reduce_start(Buf::from_vec(vec![1u64; 8]), Sum, 0).await?;
    /// # Ok(()) }
    /// ```
    pub fn reduce_start<T: Element, O: Reduction<T>>(&self, buf: Buf<T>, op: O, root: usize) -> CollectiveHandle<T> {
        let call = Self::call(Collective::Reduce { root }, Some(op.op()), buf.len());
        self.start(call, buf)
    }

    /// Starts an inclusive scan in the background; see [`scan`](Self::scan).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let prefix = comm.scan_start(Buf::from_vec(vec![1u32]), Sum).await?;
    /// # Ok(()) }
    /// ```
    pub fn scan_start<T: Element, O: Reduction<T>>(&self, buf: Buf<T>, op: O) -> CollectiveHandle<T> {
        let call = Self::call(Collective::Scan, Some(op.op()), buf.len());
        self.start(call, buf)
    }

    /// Starts an exclusive scan in the background; see [`exclusive_scan`](Self::exclusive_scan).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let offset = comm.exclusive_scan_start(Buf::from_vec(vec![100u64]), Sum).await?;
    /// # Ok(()) }
    /// ```
    pub fn exclusive_scan_start<T: Element, O: Reduction<T>>(&self, buf: Buf<T>, op: O) -> CollectiveHandle<T> {
        let call = Self::call(Collective::ExclusiveScan, Some(op.op()), buf.len());
        self.start(call, buf)
    }

    /// Starts an all-gather in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let w = comm.world_size();
    /// let (_, all) = comm.all_gather_start(Buf::from_vec(vec![1u32; 4]), Buf::zeros(4 * w)).await?;
    /// # Ok(()) }
    /// ```
    pub fn all_gather_start<T: Element>(&self, send: Buf<T>, recv: Buf<T>) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::AllGather, send, recv)
    }

    /// Starts a reduce-scatter in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let w = comm.world_size();
    /// let (_, mine) = comm.reduce_scatter_start(Buf::from_vec(vec![1i64; 2 * w]), Buf::zeros(2), Sum).await?;
    /// # Ok(()) }
    /// ```
    pub fn reduce_scatter_start<T: Element, O: Reduction<T>>(
        &self,
        send: Buf<T>,
        recv: Buf<T>,
        op: O,
    ) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::ReduceScatter(op.op()), send, recv)
    }

    /// Starts an all-to-all in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let n = 2 * comm.world_size();
    /// let (_, back) = comm.all_to_all_start(Buf::from_vec(vec![7u16; n]), Buf::zeros(n)).await?;
    /// # Ok(()) }
    /// ```
    pub fn all_to_all_start<T: Element>(&self, send: Buf<T>, recv: Buf<T>) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::AllToAll, send, recv)
    }

    /// Starts a gather to `root` in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let recv = if comm.rank() == 0 { Buf::zeros(comm.world_size()) } else { Buf::zeros(0) };
    /// let (_, all) = comm.gather_start(Buf::from_vec(vec![comm.rank() as u8]), recv, 0).await?;
    /// # Ok(()) }
    /// ```
    pub fn gather_start<T: Element>(&self, send: Buf<T>, recv: Buf<T>, root: usize) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::Gather(root), send, recv)
    }

    /// Starts a scatter from `root` in the background; the handle gives back `(send, recv)`.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let send = if comm.rank() == 0 { Buf::from_vec(vec![5u32; comm.world_size()]) } else { Buf::zeros(0) };
    /// let (_, mine) = comm.scatter_start(send, Buf::zeros(1), 0).await?;
    /// # Ok(()) }
    /// ```
    pub fn scatter_start<T: Element>(&self, send: Buf<T>, recv: Buf<T>, root: usize) -> ExchangeHandle<T> {
        self.start_exchange(Exchange::Scatter(root), send, recv)
    }

    /// Takes the sequence number now (so the call order is the order of `start` calls) and
    /// runs the collective in a task that owns the buffer.
    fn start<T: Element>(&self, call: CollCall, mut buf: Buf<T>) -> CollectiveHandle<T> {
        let client = self.clone();
        let seq = self.comm.next_seq();
        let (rank, op) = (self.rank(), call.kind.name());
        let segment = self.segment_len::<T>(call.kind, buf.len());
        let task = tokio::spawn(async move {
            let done = if let Some(segment) = segment {
                client.run_segmented(seq, call.kind, call.op, &mut buf, segment).await
            } else if let Some(reason) = client.bad_call::<T>(&call) {
                Err(client.fail_seq(seq, call, reason).await)
            } else {
                client.run_collective(seq, call, buf.as_mut_slice(), &[]).await
            };
            client.reported(op, done).map(|()| buf)
        });
        CollectiveHandle { task, rank, op, _elem: std::marker::PhantomData }
    }

    /// [`start`](Self::start) for collectives with a send and a receive buffer.
    fn start_exchange<T: Element>(&self, x: Exchange, send: Buf<T>, mut recv: Buf<T>) -> ExchangeHandle<T> {
        let client = self.clone();
        let seq = self.comm.next_seq();
        let (call, bad) = self.plan_exchange(x, send.len(), recv.len());
        let (rank, op) = (self.rank(), call.kind.name());
        let task = tokio::spawn(async move {
            if let Some(reason) = bad.or_else(|| client.bad_call::<T>(&call)) {
                return Err(client.fail_seq(seq, call, reason).await);
            }
            let done = client.run_collective(seq, call, recv.as_mut_slice(), send.as_slice()).await;
            client.reported(op, done).map(|()| (send, recv))
        });
        CollectiveHandle { task, rank, op, _elem: std::marker::PhantomData }
    }
}
