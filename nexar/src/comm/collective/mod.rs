//! Typed collectives: every operation is a schedule from `proto::algo`, run by the executor.
//!
//! All ranks of a communicator must call its collectives in the same order (as in MPI). Every
//! call carries a header; ranks that disagree on operation, count, type, reduction or root get
//! a clear error on every rank, and the communicator stays usable for the next call. A rooted
//! collective returns on a rank once its part is done there; a failure elsewhere that the rank
//! had not seen is reported by its next collective ([`CollectiveError::EarlierFailed`], see
//! `comm/collective/confirm.rs`).
//!
//! The blocking operations are here; `prepare` checks a call and plans and runs its schedule,
//! `handle` has the background (`_start`) forms and their handles, `cache` the schedules
//! kept for calls that repeat, and `error` the error type.

use nexar_types::{RecvBuf, Reduction, SendBuf};

use super::client::NexarClient;
use super::state::CommState;
use crate::proto::algo::Collective;

mod cache;
mod compressed;
pub(in crate::comm) mod confirm;
mod error;
mod handle;
mod prepare;
mod topk;

pub(crate) use cache::{CACHED_STEPS, ScheduleCache, ScheduleKey};
pub use compressed::Compression;
pub use error::CollectiveError;
pub(in crate::comm) use handle::Exchange;
pub use handle::{CollectiveHandle, ExchangeHandle};
pub use topk::ErrorFeedback;

impl NexarClient {
    /// Reduces `buf` across all ranks with `op`; every rank ends with the result.
    ///
    /// Algorithms: recursive doubling for small buffers, recursive halving-doubling for
    /// medium ones, a pipelined ring (`2(w-1)/w` of the buffer sent per rank) for large ones.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let mut grads = Buf::from_vec(vec![1.0f32; 1 << 20]);
    /// comm.all_reduce(&mut grads, Sum).await?;
    /// # Ok(()) }
    /// ```
    pub async fn all_reduce<B: RecvBuf + ?Sized, O: Reduction<B::Elem>>(
        &self,
        buf: &mut B,
        op: O,
    ) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::AllReduce, Some(op.op()), buf).await
    }

    /// Copies `root`'s buffer into every rank's `buf` (binomial tree; pipelined chain for
    /// large buffers).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let mut weights = vec![0f64; 1000];
    /// comm.broadcast(&mut weights, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn broadcast<B: RecvBuf + ?Sized>(&self, buf: &mut B, root: usize) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::Broadcast { root }, None, buf).await
    }

    /// Reduces every rank's `buf` into `root`'s `buf` (binomial tree, large buffers in
    /// segments that move up the tree as soon as they are reduced). Other ranks' buffers are
    /// left unchanged.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let mut loss = [0.25f32];
    /// comm.reduce(&mut loss, Sum, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn reduce<B: RecvBuf + ?Sized, O: Reduction<B::Elem>>(
        &self,
        buf: &mut B,
        op: O,
        root: usize,
    ) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::Reduce { root }, Some(op.op()), buf).await
    }

    /// Every rank's `send` block, concatenated in rank order into every rank's `recv`
    /// (`recv.len() == send.len() * world_size()`). Ring algorithm.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let mine = [comm.rank() as u32; 4];
    /// let mut all = vec![0u32; 4 * comm.world_size()];
    /// comm.all_gather(&mine, &mut all).await?;
    /// # Ok(()) }
    /// ```
    pub async fn all_gather<S, R>(&self, send: &S, recv: &mut R) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        self.exchange_staged(Exchange::AllGather, send, recv).await
    }

    /// Reduces every rank's `send` (`recv.len() * world_size()` elements) and leaves block
    /// `rank` of the result in each rank's `recv`. Ring algorithm.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let full = vec![1i64; 8 * comm.world_size()];
    /// let mut mine = vec![0i64; 8];
    /// comm.reduce_scatter(&full, &mut mine, Sum).await?;
    /// # Ok(()) }
    /// ```
    pub async fn reduce_scatter<S, R, O>(&self, send: &S, recv: &mut R, op: O) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
        O: Reduction<S::Elem>,
    {
        self.exchange_staged(Exchange::ReduceScatter(op.op()), send, recv).await
    }

    /// Block `j` of rank `i`'s `send` lands in block `i` of rank `j`'s `recv`; both hold
    /// `world_size()` equal blocks. Pairwise exchange.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let out = vec![comm.rank() as u16; 2 * comm.world_size()];
    /// let mut back = vec![0u16; out.len()];
    /// comm.all_to_all(&out, &mut back).await?;
    /// # Ok(()) }
    /// ```
    pub async fn all_to_all<S, R>(&self, send: &S, recv: &mut R) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        self.exchange_staged(Exchange::AllToAll, send, recv).await
    }

    /// Every rank's `send` block, concatenated in rank order into `root`'s `recv`
    /// (`send.len() * world_size()` elements there; other ranks' `recv` is not touched and may
    /// be empty).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let mut all = if comm.rank() == 0 { vec![0u8; comm.world_size()] } else { vec![] };
    /// comm.gather(&[comm.rank() as u8], &mut all, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn gather<S, R>(&self, send: &S, recv: &mut R, root: usize) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        self.exchange_staged(Exchange::Gather(root), send, recv).await
    }

    /// Block `i` of `root`'s `send` (`recv.len() * world_size()` elements there; other ranks'
    /// `send` is not read and may be empty) lands in rank `i`'s `recv`.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let work: Vec<u32> = if comm.rank() == 0 { (0..4 * comm.world_size() as u32).collect() } else { vec![] };
    /// let mut mine = [0u32; 4];
    /// comm.scatter(&work, &mut mine, 0).await?;
    /// # Ok(()) }
    /// ```
    pub async fn scatter<S, R>(&self, send: &S, recv: &mut R, root: usize) -> Result<(), CollectiveError>
    where
        S: SendBuf + ?Sized,
        R: RecvBuf<Elem = S::Elem> + ?Sized,
    {
        self.exchange_staged(Exchange::Scatter(root), send, recv).await
    }

    /// Inclusive prefix reduction: rank `r` ends with `buf[0] op … op buf[r]` (recursive
    /// doubling, `ceil(log2 w)` rounds).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let mut offset = [10u64];
    /// comm.scan(&mut offset, Sum).await?; // rank r: 10 * (r + 1)
    /// # Ok(()) }
    /// ```
    pub async fn scan<B: RecvBuf + ?Sized, O: Reduction<B::Elem>>(
        &self,
        buf: &mut B,
        op: O,
    ) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::Scan, Some(op.op()), buf).await
    }

    /// Exclusive prefix reduction: rank `r > 0` ends with `buf[0] op … op buf[r-1]`; rank 0's
    /// buffer is left unchanged (MPI leaves it undefined).
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run(comm: NexarClient) -> Result<(), NexarError> {
    /// let mut start = [100u64];
    /// comm.exclusive_scan(&mut start, Sum).await?; // rank r > 0: 100 * r
    /// # Ok(()) }
    /// ```
    pub async fn exclusive_scan<B: RecvBuf + ?Sized, O: Reduction<B::Elem>>(
        &self,
        buf: &mut B,
        op: O,
    ) -> Result<(), CollectiveError> {
        self.collective_staged(Collective::ExclusiveScan, Some(op.op()), buf).await
    }

    /// Returns once every rank has entered the barrier (dissemination: `ceil(log2 w)` rounds).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// comm.barrier().await?;
    /// # Ok(()) }
    /// ```
    pub async fn barrier(&self) -> Result<(), CollectiveError> {
        let call = Self::call(Collective::Barrier, None, 0);
        let done = self.collective::<u8>(call, &mut [], &[]).await;
        self.reported(call.kind.name(), done)
    }

    /// Splits this communicator: ranks that pass the same `color` form a new communicator,
    /// ordered by `key` (then by their rank here). Ranks that pass `None` get `None`. Every
    /// rank must call it. The new communicator's traffic is isolated from this one's, and both
    /// can run collectives concurrently.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let row = comm.split(Some((comm.rank() / 2) as u32), comm.rank() as u32).await?.unwrap();
    /// row.barrier().await?;
    /// # Ok(()) }
    /// ```
    pub async fn split(&self, color: Option<u32>, key: u32) -> Result<Option<NexarClient>, CollectiveError> {
        let world = self.world_size();
        let mine = [color.map_or(u64::MAX, u64::from), u64::from(key)];
        let mut all = vec![0u64; 2 * world];
        let seq = self.comm.next_seq();
        let call = Self::call(Collective::AllGather, None, 2);
        let gathered = self.run_collective(seq, call, &mut all, &mine).await;
        self.reported("split", gathered)?;
        let Some(color) = color else { return Ok(None) };
        let mut group: Vec<(u64, usize)> =
            (0..world).filter(|r| all[2 * r] == u64::from(color)).map(|r| (all[2 * r + 1], r)).collect();
        group.sort();
        let me = group.iter().position(|(_, r)| *r == self.rank()).ok_or_else(|| CollectiveError::Internal {
            rank: self.rank(),
            op: "split",
            what: "this rank is missing from its own color group".into(),
        })?;
        let members = group.iter().map(|(_, r)| self.comm.members[*r]).collect();
        let id = nexar_types::stable_id(&[&self.comm.id.to_string(), &seq.to_string(), &color.to_string()]).max(1);
        Ok(Some(self.with_comm(CommState::new(id, members, me))))
    }
}
