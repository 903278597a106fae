//! One link's TCP lane once connected: a writer thread that encrypts message groups onto the
//! outgoing connection and a reader thread that decrypts the incoming one and hands each whole
//! group to nexar. Encryption runs on these threads, beside the runtime thread that reduces.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc as std_mpsc};

use bytes::Bytes;
use rustls::{ClientConnection, ServerConnection, StreamOwned};
use tokio::sync::{Notify, mpsc, oneshot};

use crate::transport::TransportError;
use crate::transport::bulk::{BulkChannel, BulkClosed, BulkInbound, BulkSend};

/// The name links report for this transport.
pub const TCP_LANE_NAME: &str = "tcp-tls";

/// Whole groups the reader may hand over before it stops reading (and TCP holds the sender).
const DELIVERY_QUEUE: usize = 4;

/// How long the writer tries to say goodbye when the lane is dropped.
const GOODBYE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Bytes of a group's length prefix.
const PREFIX: usize = 8;

/// The outgoing connection (this rank dialled, TLS client) and the incoming one (the peer
/// dialled, TLS server) of one link.
pub(crate) struct Connected {
    pub outgoing: StreamOwned<ClientConnection, TcpStream>,
    pub incoming: StreamOwned<ServerConnection, TcpStream>,
}

/// What both threads and the channel share.
struct State {
    peer: usize,
    failed: AtomicBool,
    stopped: Notify,
    /// Clones of both sockets, to wake blocked threads on close.
    sockets: [TcpStream; 2],
}

/// How a lane stopped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The peer said goodbye between groups: nothing was lost, nobody needs waking.
    Goodbye,
    /// nexar gave the lane up.
    GivenUp,
    /// It broke.
    Failed,
}

impl State {
    /// Marks the channel unusable (once), closes its sockets and, unless the peer just said
    /// goodbye, wakes whoever waits for it to stop.
    fn stop(&self, why: &str, how: Stop) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            if how == Stop::Failed {
                tracing::warn!(peer = self.peer, why, "tcp lane failed");
            } else {
                tracing::debug!(peer = self.peer, why, "tcp lane closed");
            }
            for s in &self.sockets {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        if how != Stop::Goodbye {
            self.stopped.notify_waiters();
        }
    }

    fn lost(&self, why: impl std::fmt::Display) -> TransportError {
        TransportError::ConnectionLost { peer: format!("rank {}", self.peer), reason: format!("tcp lane: {why}") }
    }
}

/// A group waiting for the writer thread, and who hears when it is written.
type Job = (Vec<Bytes>, oneshot::Sender<Result<(), TransportError>>);

/// The [`BulkChannel`] of one link's TCP lane.
pub(crate) struct TcpLane {
    state: Arc<State>,
    jobs: std_mpsc::Sender<Job>,
    min_bytes: usize,
}

impl TcpLane {
    /// Starts the threads of a connected link. Groups from the peer (at most `max_group`
    /// bytes each) go to `inbound`; groups under `min_bytes` stay on QUIC.
    pub fn start(
        peer: usize,
        conns: Connected,
        inbound: BulkInbound,
        max_group: u64,
        min_bytes: usize,
    ) -> io::Result<TcpLane> {
        let sockets = [conns.outgoing.sock.try_clone()?, conns.incoming.sock.try_clone()?];
        let state = Arc::new(State { peer, failed: AtomicBool::new(false), stopped: Notify::new(), sockets });
        let (jobs, queue) = std_mpsc::channel::<Job>();
        let (delivered, groups) = mpsc::channel(DELIVERY_QUEUE);
        let writer = state.clone();
        std::thread::Builder::new()
            .name(format!("nexar-tcp-tx-{peer}"))
            .spawn(move || write_groups(&writer, conns.outgoing, queue))?;
        let reader = state.clone();
        std::thread::Builder::new()
            .name(format!("nexar-tcp-rx-{peer}"))
            .spawn(move || read_groups(&reader, conns.incoming, max_group, delivered))?;
        tokio::spawn(deliver(state.clone(), inbound, groups));
        Ok(TcpLane { state, jobs, min_bytes })
    }
}

impl BulkChannel for TcpLane {
    fn name(&self) -> &'static str {
        TCP_LANE_NAME
    }

    fn send(&self, frames: Vec<Bytes>) -> BulkSend {
        let (done, written) = oneshot::channel();
        let queued = self.jobs.send((frames, done)).is_ok();
        let state = self.state.clone();
        Box::pin(async move {
            if !queued {
                return Err(state.lost("the writer stopped"));
            }
            written.await.unwrap_or_else(|_| Err(state.lost("the writer stopped")))
        })
    }

    fn usable(&self) -> bool {
        !self.state.failed.load(Ordering::SeqCst)
    }

    fn closed(&self) -> BulkClosed {
        let state = self.state.clone();
        Box::pin(async move {
            loop {
                let stopped = state.stopped.notified();
                tokio::pin!(stopped);
                stopped.as_mut().enable();
                if state.failed.load(Ordering::SeqCst) {
                    return;
                }
                stopped.await;
            }
        })
    }

    fn close(&self) {
        self.state.stop("nexar gave the lane up", Stop::GivenUp);
    }

    fn min_bytes(&self) -> usize {
        self.min_bytes
    }
}

impl Drop for TcpLane {
    fn drop(&mut self) {
        // The reader stops now; the writer, once its queue ends, says goodbye so that the
        // peer's reader does not report a failure.
        self.state.failed.store(true, Ordering::SeqCst);
        let _ = self.state.sockets[1].shutdown(Shutdown::Both);
        self.state.stopped.notify_waiters();
    }
}

/// The writer thread: each group as a length prefix and its frames, in order.
fn write_groups(state: &State, mut out: StreamOwned<ClientConnection, TcpStream>, queue: std_mpsc::Receiver<Job>) {
    while let Ok((frames, done)) = queue.recv() {
        if state.failed.load(Ordering::SeqCst) {
            let _ = done.send(Err(state.lost("the lane failed")));
            continue;
        }
        match write_group(&mut out, &frames) {
            Ok(()) => {
                let _ = done.send(Ok(()));
            }
            Err(e) => {
                state.stop(&format!("writing: {e}"), Stop::Failed);
                let _ = done.send(Err(state.lost(e)));
            }
        }
    }
    // The channel is gone: a clean goodbye (bounded, should the peer not read), so that the
    // peer's reader does not report a failure.
    let _ = out.sock.set_write_timeout(Some(GOODBYE_TIMEOUT));
    out.conn.send_close_notify();
    let _ = out.flush();
}

fn write_group(out: &mut impl Write, frames: &[Bytes]) -> io::Result<()> {
    let len: usize = frames.iter().map(Bytes::len).sum();
    out.write_all(&(len as u64).to_le_bytes())?;
    for frame in frames {
        out.write_all(frame)?;
    }
    out.flush()
}

/// The reader thread: whole groups, each checked against `max_group` before it is allocated.
fn read_groups(
    state: &State,
    mut input: StreamOwned<ServerConnection, TcpStream>,
    max_group: u64,
    delivered: mpsc::Sender<Bytes>,
) {
    let pool = Arc::new(RecvPool::default());
    let why = loop {
        match read_group(&mut input, max_group, &pool) {
            Ok(Some(group)) => {
                if delivered.blocking_send(group).is_err() {
                    break None;
                }
            }
            Ok(None) => break None,
            Err(e) => break Some(e),
        }
    };
    match why {
        None => state.stop("the peer said goodbye", Stop::Goodbye),
        Some(e) if !state.failed.load(Ordering::SeqCst) => state.stop(&format!("reading: {e}"), Stop::Failed),
        Some(_) => {}
    }
}

/// One group; `None` when the peer closed the lane cleanly between groups.
fn read_group(input: &mut impl Read, max_group: u64, pool: &Arc<RecvPool>) -> io::Result<Option<Bytes>> {
    let mut prefix = [0u8; PREFIX];
    let mut got = 0;
    while got < PREFIX {
        match input.read(&mut prefix[got..])? {
            0 if got == 0 => return Ok(None),
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    let len = u64::from_le_bytes(prefix);
    if len > max_group {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {len}-byte group is over the {max_group}-byte limit"),
        ));
    }
    let mut group = RecvPool::take(pool, len as usize);
    input.read_exact(group.bytes_mut())?;
    Ok(Some(Bytes::from_owner(group)))
}

/// Receive buffers the reader reuses once nexar is done with the groups in them, so a busy
/// lane neither zeroes nor faults in fresh pages for every group.
#[derive(Default)]
struct RecvPool {
    free: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// Buffers kept for reuse per lane, and the largest one kept.
const POOLED: usize = 8;
const POOLED_MAX: usize = 16 << 20;

impl RecvPool {
    /// A buffer of `len` bytes (contents unspecified: the caller overwrites them all).
    fn take(pool: &Arc<RecvPool>, len: usize) -> PooledGroup {
        let mut buf = crate::sync::lock(&pool.free).pop().unwrap_or_default();
        if buf.len() < len {
            buf.resize(len, 0);
        }
        PooledGroup { buf, len, pool: Arc::downgrade(pool) }
    }
}

/// One received group in a pooled buffer; dropping it gives the buffer back.
struct PooledGroup {
    buf: Vec<u8>,
    len: usize,
    pool: std::sync::Weak<RecvPool>,
}

impl PooledGroup {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl AsRef<[u8]> for PooledGroup {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for PooledGroup {
    fn drop(&mut self) {
        if self.buf.len() > POOLED_MAX {
            return;
        }
        if let Some(pool) = self.pool.upgrade() {
            let mut free = crate::sync::lock(&pool.free);
            if free.len() < POOLED {
                free.push(std::mem::take(&mut self.buf));
            }
        }
    }
}

/// Hands received groups to nexar; a group that breaks the protocol stops the lane.
async fn deliver(state: Arc<State>, inbound: BulkInbound, mut groups: mpsc::Receiver<Bytes>) {
    while let Some(group) = groups.recv().await {
        if let Err(e) = inbound.deliver(group).await {
            tracing::error!(peer = state.peer, error = %e, "rank broke the protocol on its tcp lane; the lane stops");
            state.stop(&format!("protocol: {e}"), Stop::Failed);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_round_trip_and_oversize_ones_are_refused_before_allocating() {
        let mut wire = Vec::new();
        write_group(&mut wire, &[Bytes::from_static(b"head"), Bytes::from(vec![9u8; 1000])]).unwrap();
        write_group(&mut wire, &[]).unwrap();
        let pool = Arc::new(RecvPool::default());
        let mut r = &wire[..];
        let first = read_group(&mut r, 4096, &pool).unwrap().unwrap();
        assert_eq!((&first[..4], first.len(), first[1003]), (&b"head"[..], 1004, 9));
        drop(first);
        assert_eq!(crate::sync::lock(&pool.free).len(), 1, "the buffer came back");
        assert_eq!(read_group(&mut r, 4096, &pool).unwrap().unwrap().len(), 0);
        assert!(read_group(&mut r, 4096, &pool).unwrap().is_none(), "a clean end between groups");
        let huge = u64::MAX.to_le_bytes();
        let err = read_group(&mut &huge[..], 4096, &pool).unwrap_err();
        assert!(err.to_string().contains("over the 4096-byte limit"), "{err}");
        let cut = &wire[..20];
        assert_eq!(read_group(&mut &cut[..], 4096, &pool).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
