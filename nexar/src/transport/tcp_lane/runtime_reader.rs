//! The reading side of a TCP lane as a task on the rank's runtime, for hosts whose every core
//! runs a rank: there a reader thread woken per group waits for a core that a rank spins on
//! (tens of microseconds a wake-up on a virtual machine), while the rank's own thread is
//! already awake to take the group.
//!
//! It reads what the thread reader reads, in the same order and with the same checks (the
//! same record code, [`Opener::take_record`]), with the runtime's non-blocking reads. A
//! group's bytes must keep coming until its deadline, and nothing is read past a group's
//! message frame until the mailbox admits it, so the peer is held by TCP's flow control as
//! before. Where the host has cores to spare, the rest of a large group is read by a thread of
//! the lane's own ([`super::large_reads`]).

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncBufRead, AsyncRead, AsyncReadExt, BufReader};
use tokio::net::TcpStream;

use super::channel::State;
use super::landing::{LAND_MIN, LandedGroup, read_landing};
use super::large_reads::{Done, LARGE_GROUP, LargeReads, Rest};
use super::reader::{PooledGroup, ReadLimits, RecvPool, checked_head, frames_found};
use super::records::{Deferred, GroupSink, HEAD, HEADER, Opener, TAG, record_len};
use crate::proto::message::PeerMsg;
use crate::transport::bulk::BulkInbound;
use crate::transport::drivable::Drivable;
use crate::transport::eager_read::EagerRead;
use crate::transport::reading::{StopOnDrop, read_until_stopped};

/// Bytes of a group's header record.
const HEAD_RECORD: usize = HEADER + HEAD + TAG;
/// Bytes read from the socket at once when they are there: a small group, or a large one's
/// header record and first record header, comes in one read instead of one per field; a
/// record longer than this is read straight into its group.
const READ_AHEAD: usize = 16 << 10;

/// Starts the reading task of a lane on the current runtime; a receive spinning for one of
/// the lane's messages may poll it too ([`Drivable::drive`]), so a group the runtime has seen
/// arrive is read at once rather than on the task's turn. With `large_reads`, the rest of each
/// large group is read by a thread ([`super::large_reads`]).
pub(super) fn spawn(
    state: Arc<State>,
    sock: std::net::TcpStream,
    opener: Opener,
    limits: ReadLimits,
    inbound: BulkInbound,
    large_reads: bool,
) -> io::Result<Arc<Drivable>> {
    sock.set_nonblocking(true)?;
    let large = match large_reads {
        true => Some(LargeReads::start(state.clone(), sock.try_clone()?)?),
        false => None,
    };
    let sock = TcpStream::from_std(sock)?;
    Ok(Drivable::spawn(async move {
        let stop = StopOnDrop(state.clone());
        let sock = BufReader::with_capacity(READ_AHEAD, EagerRead(sock));
        let mut input = Input { sock, opener: Some(opener), pool: Arc::new(RecvPool::default()), large };
        read_until_stopped(&*state, read_groups(&mut input, limits, &inbound, &state)).await;
        drop(stop);
    }))
}

/// The incoming connection and what reading it needs.
struct Input {
    sock: BufReader<EagerRead>,
    /// The records' opener; away only while the large-group thread reads with it.
    opener: Option<Opener>,
    pool: Arc<RecvPool>,
    /// The thread that reads the rest of large groups, where the host has cores to spare.
    large: Option<LargeReads>,
}

/// Groups until the peer says goodbye (`None`) or something fails.
async fn read_groups(input: &mut Input, limits: ReadLimits, inbound: &BulkInbound, state: &State) -> Option<io::Error> {
    loop {
        match read_group(input, limits, inbound, state).await {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => return Some(e),
        }
    }
}

/// One group, delivered: `Ok(false)` when the peer said goodbye.
async fn read_group(input: &mut Input, limits: ReadLimits, inbound: &BulkInbound, state: &State) -> io::Result<bool> {
    // Between groups the lane waits as long as it lives; a group's bytes must all come
    // within the group deadline of its first.
    let (head, deadline) = read_head(&mut input.sock, limits.group_deadline).await?;
    let head = input.opener()?.read_group_head(&mut &head[..])?;
    let Some((len, lead)) = checked_head(head, limits.max_group)? else { return Ok(false) };
    let mut group = RecvPool::take(&input.pool, len, lead);
    let mut deferred = Vec::new();
    let defer_from = usize::try_from(lead).unwrap_or(usize::MAX);
    let mut at = 0;
    let (msg, payload_len) = loop {
        at = within(deadline, input.record(&mut group, at, defer_from, &mut deferred)).await?;
        if let Some(found) = frames_found(inbound, &group, at, &deferred)? {
            break found;
        }
    };
    let admitted = inbound.admit(&msg, payload_len).await;
    let deadline = Instant::now() + limits.group_deadline;
    // A group that may land is checked whole before any of its payload lands in a receive's
    // buffer.
    let checked = if input.may_land(&msg, len, at, payload_len, &deferred) {
        Some(inbound.payload_after(group.first(at), len).map_err(|e| broke_protocol(state, e))?)
    } else {
        None
    };
    if let Some((checked, payload)) = checked
        && let Some(landing) = within(deadline, input.landing(&mut group, at, &msg, &state.spun)).await?
    {
        // One loan, one message: the next of the same kind is another receive's.
        crate::transport::lent::forfeit_for(&msg);
        let rest = landing.rest(group, at).map_err(|e| broke_protocol(state, e))?;
        let delivered = inbound.deliver_landed(checked, payload.len(), landing.landed, rest, admitted).await;
        return delivered.map(|()| true).map_err(|e| broke_protocol(state, e));
    }
    if input.large.is_some() && len - at >= LARGE_GROUP {
        (group, deferred, at) = input.rest_on_thread(group, deferred, at, defer_from, deadline).await?;
    }
    while at < len {
        at = within(deadline, input.record(&mut group, at, defer_from, &mut deferred)).await?;
    }
    crate::transport::lent::forfeit_for(&msg);
    inbound
        .deliver_admitted(Bytes::from_owner(group), &deferred, admitted)
        .await
        .map_err(|e| broke_protocol(state, e))?;
    Ok(true)
}

/// A group that broke the protocol: the lane stops.
fn broke_protocol(state: &State, e: crate::proto::frame::FrameError) -> io::Error {
    tracing::error!(peer = state.peer, error = %e, "rank broke the protocol on its tcp lane; the lane stops");
    io::Error::new(io::ErrorKind::InvalidData, format!("protocol: {e}"))
}

impl Input {
    /// Whether the payload of a `len`-byte group read up to byte `at`, where its
    /// `payload_len`-byte payload starts, may go straight into a buffer its receive lends
    /// ([`super::landing`]): plaintext or sealed by an AES-GCM that opens in place
    /// ([`Opener::lands`]), a collective message, all of it still to read, long enough, and
    /// no thread of the lane's own to read it instead.
    fn may_land(&self, msg: &PeerMsg, len: usize, at: usize, payload_len: u64, deferred: &[Deferred]) -> bool {
        self.opener.as_ref().is_some_and(Opener::lands)
            && deferred.is_empty()
            && self.large.is_none()
            && matches!(msg, PeerMsg::Coll { .. })
            && payload_len >= LAND_MIN as u64
            && len.checked_sub(at) == Some(payload_len as usize)
    }

    /// Reads the rest of `group`, whose payload starts at `at`, into the buffer `msg`'s
    /// receive lends ([`read_landing`]).
    async fn landing(
        &mut self,
        group: &mut PooledGroup,
        at: usize,
        msg: &PeerMsg,
        spun: &super::landing::Spun,
    ) -> io::Result<Option<LandedGroup>> {
        let Input { sock, opener, .. } = self;
        let opener = opener.as_mut().ok_or_else(|| io::Error::other("the lane's opener is away"))?;
        read_landing(sock, opener, group, at, msg, spun).await
    }

    fn opener(&mut self) -> io::Result<&mut Opener> {
        self.opener.as_mut().ok_or_else(|| io::Error::other("the lane's opener was lost with a large group's read"))
    }

    /// Reads the rest of `group` from byte `at` on the large-group thread: the bytes this
    /// reader has buffered first, then the socket.
    async fn rest_on_thread(
        &mut self,
        group: PooledGroup,
        deferred: Vec<Deferred>,
        at: usize,
        defer_from: usize,
        until: Instant,
    ) -> io::Result<(PooledGroup, Vec<Deferred>, usize)> {
        let Some(large) = &self.large else { return Ok((group, deferred, at)) };
        // At most a read-ahead's worth, all of it this group's: more than that is left of it.
        let buffered = self.sock.buffer().to_vec();
        std::pin::Pin::new(&mut self.sock).consume(buffered.len());
        let opener = self.opener.take().ok_or_else(|| io::Error::other("the lane's opener is away"))?;
        let Done { opener, group, deferred, read } =
            large.read(Rest { opener, group, at, defer_from, deferred, buffered, until }).await?;
        self.opener = Some(opener);
        Ok((group, deferred, read?))
    }

    /// Reads the record at byte `at` of `group` where its plaintext belongs and takes it as
    /// the thread reader does ([`Opener::take_record`]); returns where the next one starts.
    async fn record(
        &mut self,
        group: &mut PooledGroup,
        at: usize,
        defer_from: usize,
        deferred: &mut Vec<Deferred>,
    ) -> io::Result<usize> {
        let mut header = [0u8; HEADER];
        self.sock.read_exact(&mut header).await?;
        let n = record_len(header, group.group_len(), at)?;
        let record = &mut group.room(at + n + TAG)[at..];
        self.sock.read_exact(record).await?;
        self.opener()?.take_record(header, record, at, defer_from, deferred)?;
        Ok(at + n)
    }
}

/// A group's header record: its first byte whenever it comes, the rest within `limit` of it.
/// Returns the record and the group's deadline.
async fn read_head(sock: &mut (impl AsyncRead + Unpin), limit: Duration) -> io::Result<([u8; HEAD_RECORD], Instant)> {
    let mut head = [0u8; HEAD_RECORD];
    sock.read_exact(&mut head[..1]).await.map_err(ended)?;
    let deadline = Instant::now() + limit;
    within(deadline, sock.read_exact(&mut head[1..])).await?;
    Ok((head, deadline))
}

/// The end of the connection between groups, without a goodbye.
fn ended(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => {
            io::Error::new(io::ErrorKind::UnexpectedEof, "the connection ended without a goodbye")
        }
        _ => e,
    }
}

/// `read` unless `deadline` passes first.
async fn within<T>(deadline: Instant, read: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout_at(deadline.into(), read).await.unwrap_or_else(|_| Err(group_late()))
}

/// A group whose bytes did not all come by its deadline.
pub(super) fn group_late() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "a group's bytes did not all arrive within the operation timeout of its first",
    )
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    #[tokio::test]
    async fn a_group_that_stalls_after_its_first_bytes_fails_while_an_idle_lane_waits() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (mut sock, _) = listener.accept().await.unwrap();
        let limit = Duration::from_millis(300);
        // Idle between groups for longer than the limit: nothing fails; a whole header
        // record that then comes is read.
        let whole = async {
            tokio::time::sleep(3 * limit).await;
            peer.write_all(&[7u8; HEAD_RECORD]).await.unwrap();
        };
        let (read, ()) = tokio::join!(read_head(&mut sock, limit), whole);
        assert_eq!(read.unwrap().0, [7u8; HEAD_RECORD]);
        // The next group begun, its bytes stop: the read fails, naming the deadline.
        peer.write_all(b"abc").await.unwrap();
        let started = Instant::now();
        let err = read_head(&mut sock, limit).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("did not all arrive"), "{err}");
        assert!(started.elapsed() >= limit);
        // A connection that ends between groups ends without a goodbye.
        drop(peer);
        let (mut sock, _) = {
            let peer = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
            let accepted = listener.accept().await.unwrap();
            drop(peer);
            accepted
        };
        let err = read_head(&mut sock, limit).await.unwrap_err();
        assert!(err.to_string().contains("without a goodbye"), "{err}");
    }
}
