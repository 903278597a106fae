//! One same-host link's [`BulkChannel`]: a ring each way in shared memory, and the Unix socket
//! the link was set up over, kept as the doorbell and as the sign of life.
//!
//! A group goes into this side's ring as an 8-byte length and its bytes. A small group is
//! written by the sender itself, straight from the caller's buffer, when nothing is queued
//! ahead of it and the ring has room; anything else goes to the writer thread, which waits for
//! room as the peer reads. A task on the rank's runtime reads the peer's ring
//! ([`super::receive`]).
//!
//! Either side polls briefly when the ring it waits on is empty (or full), then raises its
//! sleep flag and sleeps: the reader on the socket, until the writer sends it a [`DATA`] byte;
//! the writer on a futex on its flag, until the reader wakes it. The socket ending means the
//! peer process is gone or gave the link up.

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc as std_mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Notify, oneshot};

use super::mapping::SharedMap;
use super::receive::{ReadLimits, RingReading, spawn_reader};
use super::ring::{Reader, Writer};
use crate::transport::TransportError;
use crate::transport::bulk::{Awaiting, BulkChannel, BulkClosed, BulkInbound, BulkSend, Sent};
use crate::transport::tcp_lane::RecvPool;

/// The name links report for this transport.
pub const SHM_NAME: &str = "shm";

/// The doorbell byte that tells a sleeping reader that bytes are ready.
const DATA: u8 = 1;
/// The length word that says goodbye instead of announcing a group.
pub(super) const GOODBYE: u64 = u64::MAX;
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
}

pub(super) use crate::transport::reading::Stop;
use crate::transport::reading::Stoppable;

impl Stoppable for State {
    fn has_stopped(&self) -> bool {
        self.stopped()
    }

    fn stop_as(&self, why: &str, how: Stop) {
        self.stop(why, how);
    }

    /// Resolves once the link stops (for a reason other than the peer's goodbye).
    fn wait_stopped(&self) -> impl std::future::Future<Output = ()> + Send + '_ {
        crate::transport::reading::wait_notified(&self.stopped, || self.stopped())
    }
}

/// What the writer thread, the reading task and the channel share.
pub(super) struct State {
    pub peer: usize,
    failed: AtomicBool,
    /// The peer said goodbye: nothing more comes, but this side still says its own (the peer
    /// reads this side's ring until it does).
    peer_said_goodbye: AtomicBool,
    stopped: Notify,
    /// Woken when the link stops for any reason, the peer's goodbye included.
    ended: Notify,
    /// The link's socket: doorbells both ways, and its end means the peer is gone.
    sock: UnixStream,
    /// How long a side polls an empty (or full) ring before it sleeps.
    pub spin: Duration,
}

impl State {
    pub fn stop(&self, why: &str, how: Stop) {
        if how == Stop::Goodbye {
            self.peer_said_goodbye.store(true, Ordering::SeqCst);
        }
        if !self.failed.swap(true, Ordering::SeqCst) {
            if how == Stop::Failed {
                tracing::warn!(peer = self.peer, why, "shared-memory link failed");
            } else {
                tracing::debug!(peer = self.peer, why, "shared-memory link closed");
            }
        }
        // After the peer's goodbye the socket stays open: this side's goodbye still goes into
        // its ring, and the peer may sleep on the socket for its doorbell. (Shut down at once,
        // the peer's reader met the socket's end before the goodbye and took the link for
        // failed.)
        if how != Stop::Goodbye {
            let _ = self.sock.shutdown(std::net::Shutdown::Both);
            self.stopped.notify_waiters();
        }
        self.ended.notify_waiters();
    }

    /// Whether this side may still write its goodbye: the link has not stopped, or only the
    /// peer's goodbye stopped it.
    fn may_say_goodbye(&self) -> bool {
        !self.stopped() || self.peer_said_goodbye.load(Ordering::SeqCst)
    }

    pub fn stopped(&self) -> bool {
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
    /// The peer's ring, which a spinning receive may read itself.
    reading: Arc<RingReading>,
}

impl ShmChannel {
    /// Starts the writer thread and the reading task (on the current runtime) of a link whose rings are mapped: `ours` is written here, `theirs`
    /// is read; groups from the peer (within `limits`) go to `inbound`.
    pub fn start(
        peer: usize,
        sock: UnixStream,
        ours: SharedMap,
        theirs: SharedMap,
        inbound: BulkInbound,
        limits: ShmLimits,
    ) -> io::Result<ShmChannel> {
        let doorbell = sock.try_clone()?;
        let state = Arc::new(State {
            peer,
            failed: AtomicBool::new(false),
            peer_said_goodbye: AtomicBool::new(false),
            stopped: Notify::new(),
            ended: Notify::new(),
            sock,
            spin: limits.spin,
        });
        let sending = Arc::new(Mutex::new(Sending { writer: Writer::new(Arc::new(ours)), queued: 0 }));
        let (jobs, queue) = std_mpsc::channel::<Job>();
        let (writer_state, writer_sending) = (state.clone(), sending.clone());
        std::thread::Builder::new().name(format!("nexar-shm-tx-{peer}")).spawn(move || {
            crate::affinity::free_helper_thread();
            write_jobs(&writer_state, &writer_sending, queue)
        })?;
        let read_limits = ReadLimits { max_group: limits.max_group, group_deadline: limits.group_deadline };
        let pool = Arc::new(RecvPool::default());
        let reader = Reader::with_pool(Arc::new(theirs), pool.clone());
        let reading = match spawn_reader(state.clone(), reader, pool, doorbell, read_limits, inbound) {
            Ok(reading) => reading,
            Err(e) => {
                state.stop(&format!("starting the reader: {e}"), Stop::Failed);
                return Err(e);
            }
        };
        Ok(ShmChannel { state, sending, jobs: Mutex::new(Some(jobs)), reading })
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

    fn send_borrowed(&self, parts: &[&[u8]]) -> Option<Sent> {
        let len = parts.iter().map(|p| p.len()).sum::<usize>() + 8;
        {
            let mut sending = crate::sync::lock(&self.sending);
            if !self.state.stopped() && sending.queued == 0 && sending.writer.fits(len) {
                let word = length_word(parts);
                for part in std::iter::once(&word[..]).chain(parts.iter().copied()) {
                    sending.writer.write(part);
                }
                if sending.writer.publish() {
                    self.state.ring(DATA);
                }
                return Some(Sent::Done(Ok(())));
            }
        }
        // No room now: a copy goes behind what is queued (never back to the caller, whose
        // copy would go through the link's writer and could be overtaken by a later group).
        Some(Sent::Later(self.send(vec![Bytes::from(parts.concat())])))
    }

    fn delivers_on_runtime(&self) -> bool {
        true
    }

    fn fits_now(&self, len: usize) -> bool {
        let mut sending = crate::sync::lock(&self.sending);
        sending.queued == 0 && sending.writer.fits(len + 8)
    }

    /// A ring is one queue each way that takes groups of any size, so it keeps a pair's
    /// point-to-point messages in order.
    fn carries_point_to_point(&self) -> bool {
        true
    }

    fn deliver_ready(&self, awaiting: Option<Awaiting<'_>>) -> Option<Duration> {
        self.reading.deliver_ready(awaiting)
    }

    fn usable(&self) -> bool {
        !self.state.stopped()
    }

    fn closed(&self) -> BulkClosed {
        let state = self.state.clone();
        Box::pin(async move { state.wait_stopped().await })
    }

    /// The reader met the peer's goodbye (everything before it is delivered), or the link
    /// stopped.
    fn drained(&self) -> BulkClosed {
        let state = self.state.clone();
        Box::pin(async move { crate::transport::reading::wait_notified(&state.ended, || state.stopped()).await })
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
        let queued = self.state.may_say_goodbye() && self.queue(Job::Goodbye(done));
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
                let parts = std::iter::once(&word[..]).chain(parts);
                let written = write_until(state, sending, parts, None, || state.stopped());
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
                let goodbye = GOODBYE.to_le_bytes();
                let parts = std::iter::once(&goodbye[..]);
                let _ = write_until(state, sending, parts, Some(deadline), || !state.may_say_goodbye());
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

/// Writes `parts` into the ring in order, waiting for room (spinning, then asleep with a
/// doorbell asked for), until `deadline` if any, and while the link is not `halted`.
fn write_until<'p>(
    state: &State,
    sending: &Mutex<Sending>,
    parts: impl Iterator<Item = &'p [u8]>,
    deadline: Option<Instant>,
    halted: impl Fn() -> bool,
) -> Result<(), String> {
    for part in parts {
        let mut at = 0;
        let mut idle_since: Option<Instant> = None;
        while at < part.len() {
            if halted() {
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
