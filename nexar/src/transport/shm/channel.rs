//! One same-host link's [`BulkChannel`]: a ring each way in shared memory, and the Unix socket
//! the link was set up over, kept as the doorbell and as the sign of life.
//!
//! A group goes into this side's ring as an 8-byte length and its bytes. A small group is
//! written by the sender itself, straight from the caller's buffer, when nothing is queued
//! ahead of it and the ring has room; anything else goes to the writer thread, which waits for
//! room as the peer reads. The reader thread copies each group out of the peer's ring, checks
//! it as any transport's groups are checked, and delivers it.
//!
//! Either side spins briefly when the ring it waits on is empty (or full), then raises its
//! sleep flag and sleeps: a reader on the socket, until the writer sends it a [`DATA`] byte; a
//! writer on a futex on its flag, until the reader wakes it. The socket ending means the peer
//! process is gone or gave the link up.

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc as std_mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Notify, oneshot};

use super::mapping::SharedMap;
use super::ring::{Corrupt, Reader, Writer};
use crate::transport::TransportError;
use crate::transport::bulk::{BulkChannel, BulkClosed, BulkInbound, BulkSend};
use crate::transport::mailbox::Admitted;
use crate::transport::tcp_lane::{GroupSink, RecvPool};

/// The name links report for this transport.
pub const SHM_NAME: &str = "shm";

/// The doorbell byte that tells a sleeping reader that bytes are ready.
const DATA: u8 = 1;
/// The length word that says goodbye instead of announcing a group.
const GOODBYE: u64 = u64::MAX;
/// Bytes of a group's first part read before it is admitted: its message frame must lie in
/// them.
const PEEK: usize = 4096;
/// How much longer than its payload a group may be (its frames).
const FRAMES_MAX: u64 = 64 << 10;
/// How long a writer waiting for room sleeps at most before it looks again (its wake can be
/// lost only to a peer that scribbles on the flag, or the link may have stopped).
const WRITER_NAP: Duration = Duration::from_millis(1);
/// How long the goodbye may take.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(1);

/// What the reader allows the peer, and how long each side spins before it sleeps.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ShmLimits {
    /// The longest group in bytes, checked before anything is allocated for it.
    pub max_group: u64,
    /// From a group's first byte to its last.
    pub group_deadline: Duration,
    /// How long a side spins on an empty (or full) ring before it sleeps.
    pub spin: Duration,
    /// The smallest group worth the ring: smaller ones stay on QUIC, whose receiver spins on
    /// its own thread instead of waiting for this link's reader thread to wake it.
    pub min_bytes: usize,
}

/// How a channel stopped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stop {
    Goodbye,
    GivenUp,
    Failed,
}

/// What both threads and the channel share.
struct State {
    peer: usize,
    failed: AtomicBool,
    stopped: Notify,
    /// The link's socket: doorbells both ways, and its end means the peer is gone.
    sock: UnixStream,
    spin: Duration,
}

impl State {
    fn stop(&self, why: &str, how: Stop) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            if how == Stop::Failed {
                tracing::warn!(peer = self.peer, why, "shared-memory link failed");
            } else {
                tracing::debug!(peer = self.peer, why, "shared-memory link closed");
            }
            let _ = self.sock.shutdown(std::net::Shutdown::Both);
        }
        if how != Stop::Goodbye {
            self.stopped.notify_waiters();
        }
    }

    fn stopped(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn lost(&self, why: impl std::fmt::Display) -> TransportError {
        TransportError::ConnectionLost { peer: format!("rank {}", self.peer), reason: format!("shared memory: {why}") }
    }

    /// Rings the peer's doorbell. Never blocks: a full socket already holds doorbells the peer
    /// has yet to read.
    fn ring(&self, byte: u8) {
        let _ =
            rustix::net::send(&self.sock, &[byte], rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL);
    }
}

/// A group queued for the writer thread, and who hears when it is in the ring.
enum Job {
    Group(Vec<Bytes>, oneshot::Sender<Result<(), TransportError>>),
    Goodbye(oneshot::Sender<()>),
}

/// The writing side: the ring, and how many queued jobs the writer thread has yet to finish
/// (a sender writes a group itself only when none is).
struct Sending {
    writer: Writer,
    queued: usize,
}

/// The [`BulkChannel`] of one same-host link.
pub(crate) struct ShmChannel {
    state: Arc<State>,
    sending: Arc<Mutex<Sending>>,
    jobs: Mutex<Option<std_mpsc::Sender<Job>>>,
    min_bytes: usize,
}

impl ShmChannel {
    /// Starts the threads of a link whose rings are mapped: `ours` is written here, `theirs`
    /// is read; groups from the peer (within `limits`) go to `inbound`.
    pub fn start(
        peer: usize,
        sock: UnixStream,
        ours: SharedMap,
        theirs: SharedMap,
        inbound: BulkInbound,
        limits: ShmLimits,
    ) -> io::Result<ShmChannel> {
        sock.set_read_timeout(None)?;
        sock.set_write_timeout(Some(GOODBYE_TIMEOUT))?;
        let state =
            Arc::new(State { peer, failed: AtomicBool::new(false), stopped: Notify::new(), sock, spin: limits.spin });
        let sending = Arc::new(Mutex::new(Sending { writer: Writer::new(Arc::new(ours)), queued: 0 }));
        let (jobs, queue) = std_mpsc::channel::<Job>();
        let (writer_state, writer_sending) = (state.clone(), sending.clone());
        std::thread::Builder::new()
            .name(format!("nexar-shm-tx-{peer}"))
            .spawn(move || write_jobs(&writer_state, &writer_sending, queue))?;
        let reader_state = state.clone();
        let reader = Reader::new(Arc::new(theirs));
        std::thread::Builder::new()
            .name(format!("nexar-shm-rx-{peer}"))
            .spawn(move || read_groups(&reader_state, reader, limits, &inbound))?;
        Ok(ShmChannel { state, sending, jobs: Mutex::new(Some(jobs)), min_bytes: limits.min_bytes })
    }

    fn queue(&self, job: Job) -> bool {
        let jobs = crate::sync::lock(&self.jobs);
        let Some(jobs) = jobs.as_ref() else { return false };
        // Counted before it is queued, so no sender writes ahead of it.
        crate::sync::lock(&self.sending).queued += 1;
        if jobs.send(job).is_err() {
            crate::sync::lock(&self.sending).queued -= 1;
            return false;
        }
        true
    }
}

/// The length word of a group of `parts`.
fn length_word(parts: &[&[u8]]) -> [u8; 8] {
    (parts.iter().map(|p| p.len() as u64).sum::<u64>()).to_le_bytes()
}

impl BulkChannel for ShmChannel {
    fn name(&self) -> &'static str {
        SHM_NAME
    }

    fn send(&self, frames: Vec<Bytes>) -> BulkSend {
        let (done, written) = oneshot::channel();
        let queued = !self.state.stopped() && self.queue(Job::Group(frames, done));
        let state = self.state.clone();
        Box::pin(async move {
            if !queued {
                return Err(state.lost("the link stopped"));
            }
            written.await.unwrap_or_else(|_| Err(state.lost("the writer stopped")))
        })
    }

    fn send_borrowed(&self, frames: &[Bytes], payload: &[&[u8]]) -> Option<BulkSend> {
        let parts: Vec<&[u8]> = frames.iter().map(|f| &f[..]).chain(payload.iter().copied()).collect();
        let len = parts.iter().map(|p| p.len()).sum::<usize>() + 8;
        {
            let mut sending = crate::sync::lock(&self.sending);
            if !self.state.stopped() && sending.queued == 0 && sending.writer.room() >= len {
                let word = length_word(&parts);
                for part in std::iter::once(&word[..]).chain(parts) {
                    sending.writer.write(part);
                }
                if sending.writer.publish() {
                    self.state.ring(DATA);
                }
                return Some(Box::pin(std::future::ready(Ok(()))));
            }
        }
        // No room now: a copy goes behind what is queued (never back to the caller, whose
        // copy would go through the link's writer and could be overtaken by a later group).
        let mut owned = frames.to_vec();
        owned.push(Bytes::from(payload.concat()));
        Some(self.send(owned))
    }

    fn min_bytes(&self) -> usize {
        self.min_bytes
    }

    fn usable(&self) -> bool {
        !self.state.stopped()
    }

    fn closed(&self) -> BulkClosed {
        let state = self.state.clone();
        Box::pin(async move {
            loop {
                let notified = state.stopped.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if state.stopped() {
                    return;
                }
                notified.await;
            }
        })
    }

    fn close(&self) {
        self.state.stop("nexar gave the link up", Stop::GivenUp);
        drop(crate::sync::lock(&self.jobs).take());
    }

    fn goodbye(&self) -> BulkClosed {
        self.say_goodbye()
    }
}

impl ShmChannel {
    /// Queues the goodbye behind what is queued (once) and stops taking groups; the future
    /// resolves once it is in the ring or [`GOODBYE_TIMEOUT`] passed.
    fn say_goodbye(&self) -> BulkClosed {
        let (done, told) = oneshot::channel();
        let queued = !self.state.stopped() && self.queue(Job::Goodbye(done));
        drop(crate::sync::lock(&self.jobs).take());
        Box::pin(async move {
            if queued {
                let _ = tokio::time::timeout(GOODBYE_TIMEOUT, told).await;
            }
        })
    }
}

impl Drop for ShmChannel {
    fn drop(&mut self) {
        drop(self.say_goodbye());
    }
}

/// The writer thread: queued groups, in order, each whole into the ring as room appears.
fn write_jobs(state: &State, sending: &Mutex<Sending>, queue: std_mpsc::Receiver<Job>) {
    while let Ok(job) = queue.recv() {
        match job {
            Job::Group(frames, done) => {
                let parts: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
                let word = length_word(&parts);
                let written = write_all(state, sending, std::iter::once(&word[..]).chain(parts));
                crate::sync::lock(sending).queued -= 1;
                match written {
                    Ok(()) => {
                        let _ = done.send(Ok(()));
                    }
                    Err(e) => {
                        let _ = done.send(Err(state.lost(&e)));
                        state.stop(&e, Stop::Failed);
                        break;
                    }
                }
            }
            Job::Goodbye(done) => {
                let deadline = Instant::now() + GOODBYE_TIMEOUT;
                let _ = write_until(state, sending, [&GOODBYE.to_le_bytes()[..]].into_iter(), Some(deadline));
                crate::sync::lock(sending).queued -= 1;
                let _ = done.send(());
                state.stop("this rank said goodbye", Stop::GivenUp);
                break;
            }
        }
    }
    // Whatever is still queued fails (the channel said so when it stopped).
    while let Ok(job) = queue.try_recv() {
        if let Job::Group(_, done) = job {
            let _ = done.send(Err(state.lost("the link stopped")));
        }
    }
}

fn write_all<'p>(state: &State, sending: &Mutex<Sending>, parts: impl Iterator<Item = &'p [u8]>) -> Result<(), String> {
    write_until(state, sending, parts, None)
}

/// Writes `parts` into the ring in order, waiting for room (spinning, then asleep with a
/// doorbell asked for), until `deadline` if any.
fn write_until<'p>(
    state: &State,
    sending: &Mutex<Sending>,
    parts: impl Iterator<Item = &'p [u8]>,
    deadline: Option<Instant>,
) -> Result<(), String> {
    for part in parts {
        let mut at = 0;
        let mut idle_since: Option<Instant> = None;
        while at < part.len() {
            if state.stopped() {
                return Err("the link stopped".into());
            }
            let (wrote, capacity, wait) = {
                let mut s = crate::sync::lock(sending);
                let wrote = s.writer.write(&part[at..]);
                if wrote > 0 && s.writer.publish() {
                    state.ring(DATA);
                }
                (wrote, s.writer.capacity(), wrote == 0)
            };
            at += wrote;
            if !wait {
                idle_since = None;
                continue;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err("no room in the ring before the deadline".into());
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() < state.spin {
                std::hint::spin_loop();
                continue;
            }
            let want = (part.len() - at).min(capacity / 2);
            let waiter = crate::sync::lock(sending).writer.waiter();
            waiter.wait(want, WRITER_NAP);
        }
    }
    Ok(())
}

/// The reader thread: whole groups, each checked and admitted before its payload is read,
/// handed to nexar one by one.
fn read_groups(state: &Arc<State>, mut reader: Reader, limits: ShmLimits, inbound: &BulkInbound) {
    // The thread's own runtime for its waits (admission, delivery): they must not depend on
    // the rank's runtime, which may be shutting down while the link still reads.
    let waits = match tokio::runtime::Builder::new_current_thread().enable_time().build() {
        Ok(waits) => waits,
        Err(e) => return state.stop(&format!("starting the reader: {e}"), Stop::Failed),
    };
    let mut input = RingInput { state, reader: &mut reader, spin: limits.spin };
    // Receive buffers come back as nexar is done with them (no fresh pages per group).
    let pool = Arc::new(RecvPool::default());
    let why = loop {
        match read_group(&mut input, &pool, limits, inbound, &waits) {
            Ok(true) => {}
            Ok(false) => break None,
            Err(e) => break Some(e),
        }
    };
    match why {
        None => state.stop("the peer said goodbye", Stop::Goodbye),
        Some(e) if !state.stopped() => state.stop(&format!("reading: {e}"), Stop::Failed),
        Some(_) => {}
    }
}

/// Runs `wait` on the reader's runtime until it ends or the link stops.
fn wait_for<T>(
    state: &Arc<State>,
    waits: &tokio::runtime::Runtime,
    what: &str,
    wait: impl std::future::Future<Output = T>,
) -> io::Result<T> {
    let stopped = {
        let state = state.clone();
        async move {
            loop {
                let notified = state.stopped.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if state.stopped() {
                    return;
                }
                notified.await;
            }
        }
    };
    waits.block_on(async {
        tokio::select! {
            biased;
            out = wait => Ok(out),
            () = stopped => Err(io::Error::other(format!("the link stopped while {what}"))),
        }
    })
}

/// One group: `Ok(false)` when the peer said goodbye.
fn read_group(
    input: &mut RingInput<'_>,
    pool: &Arc<RecvPool>,
    limits: ShmLimits,
    inbound: &BulkInbound,
    waits: &tokio::runtime::Runtime,
) -> io::Result<bool> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let mut word = [0u8; 8];
    input.read_exact(&mut word, None)?;
    let len = u64::from_le_bytes(word);
    if len == GOODBYE {
        return Ok(false);
    }
    if len > limits.max_group {
        return Err(invalid(format!("a {len}-byte group is over the {}-byte limit", limits.max_group)));
    }
    let deadline = Some(Instant::now() + limits.group_deadline);
    let len = len as usize;
    let mut first = vec![0u8; len.min(PEEK)];
    input.read_exact(&mut first, deadline)?;
    let (msg, payload_len) = inbound
        .peek(&first)
        .map_err(|e| invalid(format!("protocol: {e}")))?
        .ok_or_else(|| invalid(format!("protocol: the group's message frame is not in its first {PEEK} bytes")))?;
    if payload_len > len as u64 || len as u64 - payload_len > FRAMES_MAX {
        return Err(invalid(format!("protocol: a {len}-byte group announces a {payload_len}-byte payload")));
    }
    let admitted: Option<Admitted<'_>> =
        wait_for(input.state, waits, "a group waited to be admitted", inbound.admit(&msg, payload_len))?;
    let mut group = RecvPool::take(pool, len, len as u64 - payload_len);
    let bytes = group.room(len);
    bytes[..first.len()].copy_from_slice(&first);
    input.read_exact(&mut bytes[first.len()..], Some(Instant::now() + limits.group_deadline))?;
    let delivered = wait_for(
        input.state,
        waits,
        "a group was delivered",
        inbound.deliver_admitted(Bytes::from_owner(group), &[], admitted),
    )?;
    delivered.map_err(|e| {
        tracing::error!(peer = input.state.peer, error = %e, "rank broke the protocol on its shared-memory link; the link stops");
        invalid(format!("protocol: {e}"))
    })?;
    Ok(true)
}

/// The peer's ring as a byte stream that waits: spinning, then asleep on the socket until a
/// doorbell, the link's end, or a deadline.
struct RingInput<'a> {
    state: &'a Arc<State>,
    reader: &'a mut Reader,
    spin: Duration,
}

impl RingInput<'_> {
    fn corrupt(e: Corrupt) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e.to_string())
    }

    /// Fills `dst` from the ring; bytes must keep coming until `deadline`, if any.
    fn read_exact(&mut self, dst: &mut [u8], deadline: Option<Instant>) -> io::Result<()> {
        let mut at = 0;
        let mut idle_since: Option<Instant> = None;
        while at < dst.len() {
            let n = self.reader.read(&mut dst[at..]).map_err(Self::corrupt)?;
            if n > 0 {
                at += n;
                idle_since = None;
                self.reader.release();
                continue;
            }
            if self.state.stopped() {
                return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "the link stopped"));
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if self.reader.sleep().map_err(Self::corrupt)? {
                self.wait_doorbell(deadline)?;
            }
        }
        Ok(())
    }

    /// Sleeps on the socket until a doorbell arrives, the socket ends (the peer is gone), or `deadline` passes.
    fn wait_doorbell(&self, deadline: Option<Instant>) -> io::Result<()> {
        let timeout = match deadline {
            Some(d) => Some(d.checked_duration_since(Instant::now()).filter(|t| !t.is_zero()).ok_or_else(late)?),
            None => None,
        };
        self.state.sock.set_read_timeout(timeout)?;
        let mut bells = [0u8; 64];
        match rustix::net::recv(&self.state.sock, &mut bells, rustix::net::RecvFlags::empty()) {
            Ok((0, _)) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the link")),
            Ok(_) => Ok(()),
            Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INTR => {
                if deadline.is_some_and(|d| Instant::now() >= d) { Err(late()) } else { Ok(()) }
            }
            Err(e) => Err(e.into()),
        }
    }
}

fn late() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "a group's bytes did not all arrive within the operation timeout")
}
