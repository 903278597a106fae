//! The receiving side of a same-host link: a task on the rank's runtime that copies each group
//! out of the peer's ring, checks it as any transport's groups are checked, and delivers it.
//!
//! It runs where nexar's receives run, like QUIC's endpoint driver, not on a thread of its
//! own. While the ring is empty the task keeps polling (yielding) for the link's spin window,
//! then raises the ring's sleep flag and waits for the peer's doorbell on the socket.
//!
//! A receive that spins on its mailbox does not wait for the task's turn: between its polls it
//! reads the groups that lie whole in the ring itself ([`RingReading::deliver_ready`]), with
//! the same checks, when the task is not in the middle of a group. One reader at a time holds
//! the ring ([`ReadCore`]): a receive under a short lock, the task by taking it out of its slot
//! for a group's reading (it never holds it while it waits for a group to begin).

use std::io;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::UnixStream;

use super::channel::{GOODBYE, State};
use super::ring::{Corrupt, Reader};
use crate::transport::bulk::{Awaiting, BulkInbound};
use crate::transport::framed::LentBytes;
use crate::transport::inbox::Admitted;
use crate::transport::incoming::Incoming;
use crate::transport::reading::{StopOnDrop, read_until_stopped};
use crate::transport::tcp_lane::{GroupSink, RecvPool};

/// Bytes of a group's first part read before it is admitted: its message frame must lie in
/// them.
const PEEK: usize = 4096;
/// The prefix of a group a receive reading the ring first looks for the message frame in.
const SHORT_PEEK: usize = 256;
/// The shortest group whose payload is lent out of the ring rather than copied out of it
/// (shorter ones cost less to copy twice, in cache, than to lend). A lent group is handed over
/// only once it lies whole in the ring, where a copied one is copied as it arrives; from
/// 32 KiB lending was level with copying for allreduces and 10–18 % faster for broadcasts.
const LEND_MIN: usize = 32 << 10;
/// How long a receive that spins and reads the ring itself may keep its thread from the
/// runtime's other tasks (the reading task among them). Short: 20 µs (what the TCP lane allows)
/// gave more iterations over ten times the median, in bursts of 100–800 µs, than yielding after
/// every poll; 2 µs gave the barrier and the 4 KiB allreduce 12–20 % lower medians than
/// yielding after every poll, with about as many such iterations.
const SELF_READ_HOLD: Duration = Duration::from_micros(2);
/// Bytes copied out of the ring between two yields to the runtime, so that a large group
/// does not hold a runtime thread for long.
const CHUNK: usize = 1 << 20;

/// What the reader allows the peer.
#[derive(Clone, Copy, Debug)]
pub(super) struct ReadLimits {
    /// The longest group in bytes, checked before anything is allocated for it.
    pub max_group: u64,
    /// From a group's first byte to its last.
    pub group_deadline: Duration,
}

/// The reading side of one link, shared by its task and by the receives that read the ring
/// themselves.
pub(super) struct RingReading {
    state: Arc<State>,
    inbound: BulkInbound,
    limits: ReadLimits,
    /// Empty while the task reads a group (or after its task ended mid-group).
    core: Mutex<Option<ReadCore>>,
}

/// The ring taken out of its slot by the task, put back when dropped (the task's future may be
/// dropped mid-group).
struct Taken<'a> {
    slot: &'a Mutex<Option<ReadCore>>,
    core: Option<ReadCore>,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if let Some(core) = self.core.take() {
            *crate::sync::lock(self.slot) = Some(core);
        }
    }
}

/// What reading the ring takes, held by one reader at a time.
struct ReadCore {
    reader: Reader,
    /// Receive buffers come back as nexar is done with them (no fresh pages per group).
    pool: Arc<RecvPool>,
    /// Where a group's first bytes are read to find its message (kept: not zeroed per group).
    peeked: Vec<u8>,
    /// A message a receive read off the ring but could not hand over at once: the task
    /// delivers it (waiting, as a delivery may) before anything else is read.
    undelivered: Option<Incoming>,
}

fn corrupt(e: Corrupt) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

/// Starts the reading task of a link on the current runtime; `doorbell` is the link's socket
/// (a duplicate of the state's), on which the peer's doorbells and its end arrive.
pub(super) fn spawn_reader(
    state: Arc<State>,
    reader: Reader,
    pool: Arc<RecvPool>,
    doorbell: StdUnixStream,
    limits: ReadLimits,
    inbound: BulkInbound,
) -> io::Result<Arc<RingReading>> {
    doorbell.set_nonblocking(true)?;
    let doorbell = UnixStream::from_std(doorbell)?;
    let core = ReadCore { reader, pool, peeked: Vec::new(), undelivered: None };
    let reading = Arc::new(RingReading { state, inbound, limits, core: Mutex::new(Some(core)) });
    let task = reading.clone();
    tokio::spawn(async move {
        let stop = StopOnDrop(task.state.clone());
        read_until_stopped(&*task.state, task.read_groups(&doorbell)).await;
        // Nobody reads the ring any more: unmap it now, not when the channel goes.
        drop(crate::sync::lock(&task.core).take());
        drop(stop);
    });
    Ok(reading)
}

impl RingReading {
    /// Groups until the peer says goodbye (`None`) or something fails.
    async fn read_groups(&self, doorbell: &UnixStream) -> Option<io::Error> {
        loop {
            let ready = match crate::sync::lock(&self.core).as_mut() {
                Some(core) => core.undelivered.is_some() || core.reader.ready().is_ok_and(|n| n > 0),
                None => return Some(io::Error::other("the ring was lost")),
            };
            if !ready {
                if let Err(e) = self.wait_ready(doorbell).await {
                    return Some(e);
                }
                continue;
            }
            let mut taken = Taken { slot: &self.core, core: crate::sync::lock(&self.core).take() };
            let Some(core) = taken.core.as_mut() else { return Some(io::Error::other("the ring was lost")) };
            if let Some(incoming) = core.undelivered.take() {
                self.inbound.deliver_opened(incoming).await;
            }
            match core.reader.ready() {
                Err(e) => return Some(corrupt(e)),
                // A receive read what there was meanwhile: wait for the next group without
                // holding the ring.
                Ok(0) => continue,
                Ok(_) => {}
            }
            let mut input = RingInput { state: &self.state, core, doorbell };
            match read_group(&mut input, self.limits, &self.inbound).await {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => return Some(e),
            }
        }
    }

    /// Waits, without holding the ring, until bytes are ready (or a message waits to be
    /// delivered): polling for the spin window, then asleep until a doorbell.
    async fn wait_ready(&self, doorbell: &UnixStream) -> io::Result<()> {
        let mut idle_since: Option<Instant> = None;
        loop {
            tokio::task::yield_now().await;
            let sleep = {
                let guard = crate::sync::lock(&self.core);
                let Some(core) = guard.as_ref() else { return Err(io::Error::other("the ring was lost")) };
                if core.undelivered.is_some() || core.reader.ready().map_err(corrupt)? > 0 {
                    return Ok(());
                }
                let now = Instant::now();
                let since = *idle_since.get_or_insert(now);
                now.duration_since(since) >= self.state.spin && core.reader.sleep().map_err(corrupt)?
            };
            if sleep {
                wait_doorbell(doorbell, None).await?;
                idle_since = None;
            }
        }
    }

    /// Delivers, on the calling task, the groups that lie whole in the ring and that nexar
    /// takes at once: a receive spinning on its mailbox calls this between its polls, so a
    /// message need not wait for the task's turn. Does nothing while the task reads a group;
    /// anything unusual (a group not yet whole, a wait for admission, a broken group, the
    /// goodbye) is left in the ring for the task. `Some(`[`SELF_READ_HOLD`]`)` if something
    /// was delivered or the ring was read to its end (nothing waits for the task then).
    ///
    /// A group that carries the message `awaiting` names is not delivered but handed to that
    /// receive ([`Awaiting::hand`]), still under the ring's lock so that nothing read after it
    /// reaches the rank's store first: it takes it without going through the store (no
    /// insertion, admission or removal there), and reading stops after it.
    pub(super) fn deliver_ready(&self, mut awaiting: Option<Awaiting<'_>>) -> Option<Duration> {
        let Ok(mut guard) = self.core.try_lock() else { return None };
        let core = guard.as_mut()?;
        let mut delivered = false;
        while core.undelivered.is_none() {
            match self.take_whole_group(core, awaiting.as_ref().map(Awaiting::message)) {
                WholeGroup::Delivered => delivered = true,
                WholeGroup::Awaited(incoming) => {
                    match awaiting.take() {
                        Some(awaiting) => awaiting.hand(incoming),
                        // Never so (only a named message is handed back), but never lost.
                        None => core.undelivered = self.inbound.deliver_now(incoming),
                    }
                    return Some(SELF_READ_HOLD);
                }
                WholeGroup::Left => break,
            }
        }
        (delivered || (core.undelivered.is_none() && core.reader.ready() == Ok(0))).then_some(SELF_READ_HOLD)
    }

    /// Reads, checks and delivers (or keeps as undelivered, or hands back if it carries the
    /// `awaited` message) the next group if it lies whole in the ring and its payload is
    /// admitted at once; [`WholeGroup::Left`] leaves the ring as it was. The checks are those
    /// of [`read_group`], made on copies before anything is read.
    fn take_whole_group(&self, core: &mut ReadCore, awaited: Option<crate::transport::bulk::Awaited>) -> WholeGroup {
        use WholeGroup::Left;
        let mut word = [0u8; 8];
        if !core.reader.peek(0, &mut word).unwrap_or(false) {
            return Left;
        }
        let len = u64::from_le_bytes(word);
        if len == GOODBYE || len > self.limits.max_group {
            return Left;
        }
        let len = len as usize;
        let ReadCore { reader, pool, peeked, undelivered } = core;
        // `ready` is the peer's head read again: checked, not trusted to be at least 8 still.
        if reader.ready().map_or(true, |ready| ready.checked_sub(8).is_none_or(|rest| rest < len)) {
            return Left;
        }
        // The message frame, from a short prefix where it fits (it does, but for a peer's
        // odd encoding): the group's bytes are then copied once, straight into its buffer.
        let mut found = None;
        for prefix in [SHORT_PEEK, PEEK] {
            peeked.resize(len.min(prefix), 0);
            if !reader.peek(8, peeked).unwrap_or(false) {
                return Left;
            }
            match self.inbound.peek(peeked, len) {
                Ok(Some(frame)) => {
                    found = Some(frame);
                    break;
                }
                Ok(None) if peeked.len() < len => {}
                _ => return Left,
            }
        }
        let Some((msg, payload_len)) = found else { return Left };
        // The awaited message goes to its receive, which consumes it at once: it is never
        // held, so it needs no room in the store.
        let awaited = awaited.filter(|awaited| awaited.is(&msg) && self.inbound.hands_over(&msg));
        let admitted = if awaited.is_some() {
            None
        } else {
            match self.inbound.admit_now(&msg, payload_len) {
                Some(admitted) => Some(admitted),
                None => return Left,
            }
        };
        let incoming = if peeked.len() == len {
            // The whole group is in the copy `msg` was found in (a barrier's, a small
            // message's): opened from there, without a pool buffer or a second read.
            match self.inbound.open_copied(peeked, msg) {
                Ok(incoming) => Some(incoming),
                Err(_) => return Left,
            }
        } else if lendable(len, reader) {
            match self.inbound.open_lent(peeked, len, |payload| lend(reader, 8, payload)) {
                Ok(Some(incoming)) => Some(incoming),
                Ok(None) => None,
                Err(_) => return Left,
            }
        } else {
            None
        };
        let incoming = match incoming {
            Some(incoming) => incoming,
            None => {
                // Checked again, whole, by `open` (the peer may have changed its bytes
                // meanwhile; whatever it delivers counts against its room in the mailbox at
                // delivery).
                let mut group = RecvPool::take(pool, len, len as u64 - payload_len);
                if !reader.peek(8, group.room(len)).unwrap_or(false) {
                    return Left;
                }
                let Ok(incoming) = self.inbound.open(Bytes::from_owner(group)) else { return Left };
                incoming
            }
        };
        if !reader.skip(8 + len).unwrap_or(false) {
            return Left;
        }
        reader.release();
        drop(admitted);
        // Checked again on what was opened: a group read anew from the ring may not be the
        // one peeked at (the peer can write its ring meanwhile). One that is not goes to the
        // store, which counts it against the peer's room at delivery, as any group.
        if awaited.is_some_and(|awaited| awaited.is(&incoming.msg)) {
            return WholeGroup::Awaited(self.inbound.hand_over(incoming));
        }
        if let Some(back) = self.inbound.deliver_now(incoming) {
            *undelivered = Some(back);
        }
        WholeGroup::Delivered
    }
}

/// What [`RingReading::take_whole_group`] did with the ring's next group.
enum WholeGroup {
    /// Delivered (or kept to be delivered by the task).
    Delivered,
    /// The awaited message, for the receive that reads the ring.
    Awaited(Incoming),
    /// Left in the ring for the task: not whole, not admitted at once, or something unusual.
    Left,
}

/// One group: `Ok(false)` when the peer said goodbye.
async fn read_group(input: &mut RingInput<'_>, limits: ReadLimits, inbound: &BulkInbound) -> io::Result<bool> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let mut word = [0u8; 8];
    input.read_exact(&mut word, None).await?;
    let len = u64::from_le_bytes(word);
    if len == GOODBYE {
        return Ok(false);
    }
    if len > limits.max_group {
        return Err(invalid(format!("a {len}-byte group is over the {}-byte limit", limits.max_group)));
    }
    let mut deadline = GroupDeadline { limit: limits.group_deadline, start: None };
    let len = len as usize;
    if lendable(len, &input.core.reader) {
        input.wait_for(len, &mut deadline).await?;
        if lend_group(input, len, inbound).await? {
            return Ok(true);
        }
    }
    let mut peeked = std::mem::take(&mut input.core.peeked);
    peeked.resize(len.min(PEEK), 0);
    let read = read_group_body(input, &mut peeked, len, &mut deadline, inbound).await;
    input.core.peeked = peeked;
    read
}

/// Whether a `len`-byte group's payload is lent out of the ring rather than copied: long
/// enough to be worth it, short enough that lent payloads never hold the writer back (see
/// [`super::lease`]).
fn lendable(len: usize, reader: &Reader) -> bool {
    (LEND_MIN..=reader.lend_largest()).contains(&len)
}

/// Lends the `range` of the group that starts `skip` ready bytes into the ring.
fn lend(reader: &Reader, skip: usize, range: std::ops::Range<usize>) -> Option<Arc<dyn LentBytes>> {
    let lease = reader.lend(skip + range.start, range.len()).ok()??;
    Some(lease)
}

/// Delivers the `len`-byte group that lies whole in the ring with its payload lent; `false`
/// (nothing read) when it cannot be lent, and the group is read as usual.
async fn lend_group(input: &mut RingInput<'_>, len: usize, inbound: &BulkInbound) -> io::Result<bool> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let ReadCore { reader, peeked, .. } = &mut *input.core;
    peeked.resize(len.min(PEEK), 0);
    if !reader.peek(0, peeked).map_err(corrupt)? {
        return Ok(false);
    }
    // A group that breaks the protocol is refused where it is read as usual.
    let Ok(Some((msg, payload_len))) = inbound.peek(peeked, len) else { return Ok(false) };
    let admitted = inbound.admit(&msg, payload_len).await;
    let ReadCore { reader, peeked, .. } = &mut *input.core;
    let incoming = match inbound.open_lent(peeked, len, |payload| lend(reader, 0, payload)) {
        Ok(Some(incoming)) => incoming,
        Ok(None) => return Ok(false),
        Err(e) => {
            tracing::error!(peer = input.state.peer, error = %e, "rank broke the protocol on its shared-memory link; the link stops");
            return Err(invalid(format!("protocol: {e}")));
        }
    };
    if !reader.skip(len).map_err(corrupt)? {
        return Err(io::Error::other("the ring lost bytes it had ready"));
    }
    reader.release();
    drop(admitted);
    inbound.deliver_opened(incoming).await;
    Ok(true)
}

/// The rest of a `len`-byte group, whose first bytes are read into `first` (as many as it
/// holds) to find its message before anything is allocated for it.
async fn read_group_body(
    input: &mut RingInput<'_>,
    first: &mut [u8],
    len: usize,
    deadline: &mut GroupDeadline,
    inbound: &BulkInbound,
) -> io::Result<bool> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    input.read_exact(first, Some(&mut *deadline)).await?;
    let (msg, payload_len) = inbound
        .peek(first, len)
        .map_err(|e| invalid(format!("protocol: {e}")))?
        .ok_or_else(|| invalid(format!("protocol: the group's message frame is not in its first {PEEK} bytes")))?;
    let admitted: Option<Admitted<'_>> = inbound.admit(&msg, payload_len).await;
    let mut group = RecvPool::take(&input.core.pool, len, len as u64 - payload_len);
    let bytes = group.room(len);
    bytes[..first.len()].copy_from_slice(first);
    input.read_exact(&mut bytes[first.len()..], Some(deadline)).await?;
    inbound.deliver_admitted(Bytes::from_owner(group), &[], admitted).await.map_err(|e| {
        tracing::error!(peer = input.state.peer, error = %e, "rank broke the protocol on its shared-memory link; the link stops");
        invalid(format!("protocol: {e}"))
    })?;
    Ok(true)
}

/// How long a group may take from its first byte to its last. The clock is read only once
/// the group has to wait for bytes (a small group is usually in the ring whole).
struct GroupDeadline {
    limit: Duration,
    start: Option<Instant>,
}

impl GroupDeadline {
    /// The deadline, counted from `now` if the group has not waited before.
    fn at(&mut self, now: Instant) -> Instant {
        *self.start.get_or_insert(now) + self.limit
    }
}

/// The peer's ring as a byte stream that waits (holding the ring): polling, then asleep on the
/// socket until a doorbell, the link's end, or a deadline.
struct RingInput<'a> {
    state: &'a Arc<State>,
    core: &'a mut ReadCore,
    doorbell: &'a UnixStream,
}

impl RingInput<'_> {
    /// Waits until `n` bytes are ready in the ring, which they must be by `deadline`.
    async fn wait_for(&mut self, n: usize, deadline: &mut GroupDeadline) -> io::Result<()> {
        let mut idle_since: Option<Instant> = None;
        loop {
            let reader = &self.core.reader;
            if reader.ready().map_err(corrupt)? >= n {
                return Ok(());
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) < self.state.spin {
                tokio::task::yield_now().await;
                continue;
            }
            // Checked here too: a peer that keeps ringing without ever completing the group
            // must not keep this wait going.
            if now >= deadline.at(since) {
                return Err(late());
            }
            if reader.sleep_short_of(n).map_err(corrupt)? {
                wait_doorbell(self.doorbell, Some(deadline.at(since))).await?;
            }
            idle_since = None;
        }
    }

    /// Fills `dst` from the ring; bytes must keep coming until `deadline`, if any.
    async fn read_exact(&mut self, dst: &mut [u8], mut deadline: Option<&mut GroupDeadline>) -> io::Result<()> {
        let mut at = 0;
        let mut idle_since: Option<Instant> = None;
        let reader = &mut self.core.reader;
        while at < dst.len() {
            let end = dst.len().min(at + CHUNK);
            let n = reader.read(&mut dst[at..end]).map_err(corrupt)?;
            if n > 0 {
                at += n;
                idle_since = None;
                reader.release();
                if at < dst.len() {
                    tokio::task::yield_now().await;
                }
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) < self.state.spin {
                tokio::task::yield_now().await;
                continue;
            }
            if reader.sleep().map_err(corrupt)? {
                wait_doorbell(self.doorbell, deadline.as_deref_mut().map(|d| d.at(since))).await?;
            }
        }
        Ok(())
    }
}

/// Waits on the link's socket until a doorbell arrives, the socket ends (the peer is gone), or
/// `deadline` passes.
async fn wait_doorbell(doorbell: &UnixStream, deadline: Option<Instant>) -> io::Result<()> {
    let wait = async {
        loop {
            doorbell.readable().await?;
            let mut bells = [0u8; 64];
            match doorbell.try_read(&mut bells) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the link")),
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    };
    match deadline {
        None => wait.await,
        Some(d) => tokio::time::timeout_at(d.into(), wait).await.unwrap_or_else(|_| Err(late())),
    }
}

fn late() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "a group's bytes did not all arrive within the operation timeout")
}
