//! The reading side of a TCP lane: a thread that reads the incoming connection group by group
//! and hands each whole group to nexar: its frames decrypted, its payload's records still
//! sealed, to be opened by whoever reads the payload, straight into the destination.
//!
//! The reader reads a group's frames first and its payload only once the rank's mailbox admits
//! the message, as a QUIC stream's reader does ([`BulkInbound::admit`]): until then it reads
//! nothing, and TCP's flow control holds the peer. So what a peer sends over its lane costs no
//! more memory than the unmatched-message limits allow, as on QUIC.

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::channel::{State, Stop, wait_until};
use super::records::{Deferred, GOODBYE, GroupHead, GroupSink, Opener, TAG};
use crate::transport::bulk::BulkInbound;
use crate::transport::inbox::Admitted;

/// The reader's buffer for record headers (record bodies bypass it).
const READ_BUFFER: usize = 8 << 10;

/// What the reader allows a peer: the longest group, and how long one group's bytes may take
/// to arrive once it has begun.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReadLimits {
    /// The longest group in bytes, checked before anything is allocated for it.
    pub max_group: u64,
    /// From a group's first byte to its last.
    pub group_deadline: Duration,
}

/// The reader thread: whole groups, each checked against the limits and admitted before its
/// payload is read, handed to nexar one by one; between groups it waits as long as the link
/// lives.
pub(super) fn read_groups(
    state: &Arc<State>,
    sock: TcpStream,
    mut opener: Opener,
    limits: ReadLimits,
    inbound: &BulkInbound,
) {
    // The thread's own runtime for its waits (admission, delivery): they must not depend on
    // the rank's runtime, which may be shutting down while the lane still reads.
    let gate = match tokio::runtime::Builder::new_current_thread().enable_time().build() {
        Ok(waits) => Gate { inbound, waits, state },
        Err(e) => return state.stop(&format!("starting the reader: {e}"), Stop::Failed),
    };
    let mut input = io::BufReader::with_capacity(READ_BUFFER, Deadlined::new(sock, limits.group_deadline));
    let pool = Arc::new(RecvPool::default());
    let why = loop {
        let read = read_group(&mut opener, &mut input, limits.max_group, &pool, &gate);
        // Bytes of the next group already buffered mean that it has begun.
        let begun = !input.buffer().is_empty();
        if let Err(e) = input.get_mut().between_groups(begun) {
            break Some(e);
        }
        match read {
            Ok(Some(group)) => {
                if let Err(e) = gate.deliver(group) {
                    break Some(e);
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

/// Where the reader thread waits for nexar: for the mailbox to admit a group, and for a group
/// to be delivered; either wait ends when the lane stops.
struct Gate<'a> {
    inbound: &'a BulkInbound,
    waits: tokio::runtime::Runtime,
    state: &'a Arc<State>,
}

impl<'a> Gate<'a> {
    /// Runs `wait` until it ends or the lane stops (a wait that can end at once ends, even on
    /// a stopped lane: a group already read is still delivered).
    fn wait<T>(&self, what: &str, wait: impl std::future::Future<Output = T>) -> io::Result<T> {
        let stopped = wait_until(self.state.clone(), |s| &s.stopped, |s| s.failed.load(Ordering::SeqCst));
        self.waits.block_on(async {
            tokio::select! {
                biased;
                out = wait => Ok(out),
                () = stopped => Err(io::Error::other(format!("the lane stopped while {what}"))),
            }
        })
    }

    /// Waits until the mailbox admits the `len`-byte payload of `msg`.
    fn admit(&self, msg: &crate::proto::message::PeerMsg, len: u64) -> io::Result<Option<Admitted<'a>>> {
        let inbound = self.inbound;
        self.wait("a group waited to be admitted", inbound.admit(msg, len))
    }

    /// Hands a group to nexar; a group that breaks the protocol stops the lane.
    fn deliver(&self, Received { group, deferred, admitted }: Received<'a>) -> io::Result<()> {
        let delivered =
            self.wait("a group was delivered", self.inbound.deliver_admitted(group, &deferred, admitted))?;
        delivered.map_err(|e| {
            tracing::error!(peer = self.state.peer, error = %e, "rank broke the protocol on its tcp lane; the lane stops");
            io::Error::new(io::ErrorKind::InvalidData, format!("protocol: {e}"))
        })
    }
}

/// The reader's socket, with a deadline for each group: it starts at the first byte that
/// arrives after the previous group and ends `limit` later, so a peer that starts a group and
/// then trickles or stalls fails the lane instead of holding the reader and the group's buffer
/// for ever. Between groups a read waits without limit.
struct Deadlined {
    sock: TcpStream,
    limit: Duration,
    until: Option<Instant>,
}

impl Deadlined {
    fn new(sock: TcpStream, limit: Duration) -> Deadlined {
        Deadlined { sock, limit, until: None }
    }

    /// A group ended: the next one has `begun` (its first bytes are buffered already) or not.
    fn between_groups(&mut self, begun: bool) -> io::Result<()> {
        self.until = None;
        if begun { self.arm() } else { self.sock.set_read_timeout(None) }
    }

    fn arm(&mut self) -> io::Result<()> {
        self.until = Some(Instant::now() + self.limit);
        self.sock.set_read_timeout(Some(self.limit))
    }

    fn late(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("a group's bytes did not all arrive within {:?} of its first (the operation timeout)", self.limit),
        )
    }
}

impl Read for Deadlined {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.until.is_some_and(|until| Instant::now() >= until) {
            return Err(self.late());
        }
        match self.sock.read(buf) {
            Ok(n) => {
                if n > 0 && self.until.is_none() {
                    self.arm()?;
                }
                Ok(n)
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => Err(self.late()),
            Err(e) => Err(e),
        }
    }
}

/// A group as the reader hands it over: its bytes, which records of its payload are still
/// sealed (they are opened where the payload is read, straight into its destination), and its
/// admission.
struct Received<'a> {
    group: Bytes,
    deferred: Vec<Deferred>,
    admitted: Option<Admitted<'a>>,
}

/// One group; `None` when the peer said goodbye. Its first records, up to its message frame,
/// are read and opened first; the rest only once the mailbox admits the message (the group's
/// deadline starts again then). Records from the group's lead part on are left sealed.
fn read_group<'a>(
    opener: &mut Opener,
    input: &mut io::BufReader<Deadlined>,
    max_group: u64,
    pool: &Arc<RecvPool>,
    gate: &Gate<'a>,
) -> io::Result<Option<Received<'a>>> {
    let Some((len, lead)) = checked_head(opener.read_group_head(input)?, max_group)? else { return Ok(None) };
    let mut group = RecvPool::take(pool, len, lead);
    let mut deferred = Vec::new();
    let defer_from = usize::try_from(lead).unwrap_or(usize::MAX);
    let mut at = 0;
    let (msg, payload_len) = loop {
        at = opener.read_records(input, &mut group, at, at + 1, defer_from, &mut deferred)?;
        if let Some(found) = frames_found(gate.inbound, &group, at, &deferred)? {
            break found;
        }
    };
    let admitted = gate.admit(&msg, payload_len)?;
    input.get_mut().arm()?;
    opener.read_records(input, &mut group, at, len, defer_from, &mut deferred)?;
    Ok(Some(Received { group: Bytes::from_owner(group), deferred, admitted }))
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// A group's length and lead from its header record, checked against `max_group`; `None`
/// for the peer's goodbye.
pub(super) fn checked_head(head: Option<GroupHead>, max_group: u64) -> io::Result<Option<(usize, u64)>> {
    match head {
        None => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection ended without a goodbye")),
        Some(GroupHead { len: GOODBYE, .. }) => Ok(None),
        Some(GroupHead { len, .. }) if len > max_group => {
            Err(invalid(format!("a {len}-byte group is over the {max_group}-byte limit")))
        }
        Some(GroupHead { len, lead }) => Ok(Some((len as usize, lead))),
    }
}

/// The group's message and payload length once its first `at` bytes are read (`deferred`
/// holding the records left sealed), checked: `None` while the message frame has not all
/// come, an error once it cannot come from opened records or announces a payload the group's
/// length does not fit ([`BulkInbound::peek`]: the rest of the group is then never read).
pub(super) fn frames_found(
    inbound: &BulkInbound,
    group: &PooledGroup,
    at: usize,
    deferred: &[Deferred],
) -> io::Result<Option<(crate::proto::message::PeerMsg, u64)>> {
    let opened = deferred.first().map_or(at, |d| d.at);
    let len = group.group_len();
    match inbound.peek(group.first(opened), len).map_err(|e| invalid(format!("protocol: {e}")))? {
        Some(found) => Ok(Some(found)),
        None if at >= len || !deferred.is_empty() => {
            Err(invalid("protocol: the group's message frame is not in its opened first records".into()))
        }
        None => Ok(None),
    }
}

/// Receive buffers the reader reuses once nexar is done with the groups in them, so a busy
/// lane neither zeroes nor faults in fresh pages for every group. Buffers are words, so that
/// their start is [`ALIGN`]-aligned wherever the allocator puts them.
#[derive(Default)]
pub(crate) struct RecvPool {
    free: Mutex<Vec<Vec<u64>>>,
}

/// Buffers kept for reuse per lane (each way), the largest one kept, and the most bytes kept.
pub(super) const POOLED: usize = 16;
const POOLED_MAX: usize = 65 << 20;
const POOLED_BYTES: usize = 80 << 20;
/// The alignment a group's largest part gets (that of any element type).
const ALIGN: usize = 8;
/// The room a fresh buffer starts with; it doubles as the group's records arrive. A peer that
/// announces a large group and sends less makes this rank hold what it sent, not what it
/// announced.
const FIRST_ROOM: usize = 1 << 20;

impl RecvPool {
    /// A buffer for a group of `len` bytes, placed so that its byte `lead` is
    /// [`ALIGN`]-aligned: a payload that starts there can be reduced straight from the buffer.
    /// A pooled buffer comes as it is (the reader overwrites what it uses); a fresh one starts
    /// small and grows as records arrive ([`GroupSink::room`]).
    pub(crate) fn take(pool: &Arc<RecvPool>, len: usize, lead: u64) -> PooledGroup {
        let start = (ALIGN - (lead as usize) % ALIGN) % ALIGN;
        let words = (start + len + TAG).div_ceil(ALIGN);
        let buf = {
            let mut free = crate::sync::lock(&pool.free);
            // The most recently returned one large enough (its pages are the likeliest to be
            // in cache), else the largest (grown as the group arrives).
            let fits = free.iter().rposition(|b| b.len() >= words);
            let largest = free.iter().enumerate().max_by_key(|(_, b)| b.len()).map(|(i, _)| i);
            fits.or(largest).map(|i| free.swap_remove(i)).unwrap_or_default()
        };
        PooledGroup { buf, start, len, pool: Arc::downgrade(pool) }
    }
}

/// One received group in a pooled buffer; dropping it gives the buffer back.
pub(crate) struct PooledGroup {
    buf: Vec<u64>,
    /// Where the group starts in the buffer, in bytes.
    start: usize,
    len: usize,
    pool: std::sync::Weak<RecvPool>,
}

impl GroupSink for PooledGroup {
    fn group_len(&self) -> usize {
        self.len
    }

    fn room(&mut self, upto: usize) -> &mut [u8] {
        let need = (self.start + upto).div_ceil(ALIGN);
        if self.buf.len() < need {
            let whole = (self.start + self.len + TAG).div_ceil(ALIGN);
            let grown = (self.buf.len() * 2).max(FIRST_ROOM / ALIGN).min(whole).max(need);
            self.buf.resize(grown, 0);
        }
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.buf)[self.start..self.start + upto]
    }
}

impl PooledGroup {
    /// The group's first `upto` bytes, as far as they have arrived (room was made for them).
    pub(super) fn first(&self, upto: usize) -> &[u8] {
        let bytes = bytemuck::cast_slice::<u64, u8>(&self.buf);
        bytes.get(self.start..self.start + upto.min(self.len)).unwrap_or_default()
    }
}

impl AsRef<[u8]> for PooledGroup {
    fn as_ref(&self) -> &[u8] {
        let bytes = bytemuck::cast_slice::<u64, u8>(&self.buf);
        // Only a group read whole is handed over; an empty one may have no room at all.
        bytes.get(self.start..self.start + self.len).unwrap_or_default()
    }
}

impl Drop for PooledGroup {
    fn drop(&mut self) {
        let bytes = self.buf.len() * ALIGN;
        if bytes > POOLED_MAX {
            return;
        }
        if let Some(pool) = self.pool.upgrade() {
            let mut free = crate::sync::lock(&pool.free);
            let kept: usize = free.iter().map(|b| b.len() * ALIGN).sum();
            if free.len() < POOLED && kept + bytes <= POOLED_BYTES {
                free.push(std::mem::take(&mut self.buf));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn received_buffers_come_back_to_the_pool_and_place_the_lead_aligned() {
        let pool = Arc::new(RecvPool::default());
        let mut g = RecvPool::take(&pool, 90, 0);
        g.room(90 + TAG).fill(3);
        let bytes = Bytes::from_owner(g);
        assert_eq!(bytes.len(), 90);
        assert_eq!(bytes.as_ptr() as usize % ALIGN, 0);
        drop(bytes);
        assert_eq!(crate::sync::lock(&pool.free).len(), 1, "the buffer came back");
        let reused = RecvPool::take(&pool, 50, 0);
        assert!(reused.buf.len() * ALIGN >= 90 + TAG, "and is reused");
        drop(reused);
        for lead in [1u64, 74, 77, u64::MAX] {
            let mut g = RecvPool::take(&pool, 200, lead);
            g.room(200 + TAG).fill(1);
            let bytes = Bytes::from_owner(g);
            assert_eq!(bytes.len(), 200);
            assert_eq!((bytes.as_ptr() as usize).wrapping_add(lead as usize) % ALIGN, 0, "lead {lead}");
        }
    }

    #[test]
    fn a_group_that_stalls_after_its_first_bytes_fails_while_an_idle_lane_waits() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (sock, _) = listener.accept().unwrap();
        let limit = Duration::from_millis(300);
        let mut input = io::BufReader::with_capacity(READ_BUFFER, Deadlined::new(sock, limit));
        // Idle between groups for longer than the limit: nothing fails.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(3 * limit);
            peer.write_all(b"abc").unwrap();
            peer
        });
        let mut first = [0u8; 3];
        input.read_exact(&mut first).unwrap();
        assert_eq!(&first, b"abc");
        let _peer = writer.join().unwrap();
        // The group begun, its bytes stop: the read fails, naming the deadline.
        let mut rest = [0u8; 10];
        let err = input.read_exact(&mut rest).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("did not all arrive within 300ms"), "{err}");
    }

    #[test]
    fn a_group_announced_far_longer_than_its_payload_is_refused_before_the_rest_is_read() {
        use crate::proto::frame::{message_frame, raw_header};
        let lanes = crate::transport::lanes::lanes(4).0;
        let slot = Arc::new(crate::transport::bulk::BulkSlot::new(1, &lanes));
        let inbound = BulkInbound::new(1, lanes, 1 << 30, &slot);
        // The first record of a group announced at 1 GiB: a message for 8 bytes and its
        // raw header. Admission would take 8 bytes; the rest of the GiB must not be read.
        let msg = crate::transport::bulk::tests::coll(2);
        let mut first = message_frame(&crate::proto::message::encode(&msg).unwrap()).to_vec();
        first.extend_from_slice(&raw_header(8));
        let pool = Arc::new(RecvPool::default());
        let mut group = RecvPool::take(&pool, 1 << 30, first.len() as u64);
        group.room(first.len())[..first.len()].copy_from_slice(&first);
        let err = frames_found(&inbound, &group, first.len(), &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains("a 1073741824-byte group announces a 8-byte payload"), "{err}");
        // The same record in a group of its own length is found.
        let mut honest = RecvPool::take(&pool, first.len() + 8, first.len() as u64);
        honest.room(first.len())[..first.len()].copy_from_slice(&first);
        let (found, payload_len) = frames_found(&inbound, &honest, first.len(), &[]).unwrap().unwrap();
        assert_eq!((found, payload_len), (msg, 8));
    }

    #[test]
    fn an_announced_group_costs_memory_only_as_its_records_arrive() {
        let pool = Arc::new(RecvPool::default());
        let len = 4usize << 30;
        let mut g = RecvPool::take(&pool, len, 3);
        assert!(g.buf.is_empty(), "nothing is held for an announcement");
        g.room(1000)[..4].copy_from_slice(b"abcd");
        assert!(g.buf.len() * ALIGN <= FIRST_ROOM, "{} bytes for 1000", g.buf.len() * ALIGN);
        // Growing keeps what arrived and stays within twice what arrived.
        let got = 3 * FIRST_ROOM + 5;
        assert_eq!(&g.room(got)[..4], b"abcd");
        assert!(g.buf.len() * ALIGN <= 2 * (got + ALIGN), "{} bytes for {got}", g.buf.len() * ALIGN);
        // and never past the group's own length.
        let mut small = RecvPool::take(&pool, 3 * FIRST_ROOM / 2, 0);
        small.room(FIRST_ROOM + 1);
        small.room(FIRST_ROOM + 9);
        assert_eq!(small.buf.len() * ALIGN, (3 * FIRST_ROOM / 2 + TAG).next_multiple_of(ALIGN));
    }
}
