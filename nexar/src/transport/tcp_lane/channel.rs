//! One link's TCP lane once connected: groups are sealed into records by whoever sends them
//! (straight from the caller's buffer for a borrowed payload), a writer thread puts the records
//! on the link's connection, and a reader reads the peer's records and hands each whole group
//! to nexar: its frames decrypted, its payload's records still sealed, to be opened by whoever
//! reads the payload, straight into the destination. The reader is in [`super::reader`] (a
//! thread) or [`super::runtime_reader`] (a task on the rank's runtime).

use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc as std_mpsc};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Notify, oneshot};

use super::cipher::LaneAead;
use super::connections::Parts;
pub(crate) use super::connections::{Connected, Pair};
use super::reader::{ReadLimits, read_groups};
use super::records::{Sealed, Sealer};
use super::writer::{Job, Spare, give_back, write_ready, write_records};
use crate::transport::TransportError;
use crate::transport::bulk::{Awaiting, BulkChannel, BulkClosed, BulkInbound, BulkSend, Sent};
use crate::transport::drivable::Drivable;

/// The name links report for this transport.
pub const TCP_LANE_NAME: &str = "tcp-tls";

/// How long the writer tries to say goodbye when the lane is dropped.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a receive that spins and reads the lane's socket itself may keep its thread from
/// the runtime's other tasks: a round trip on the lane takes ~10 µs here, and each runtime
/// cycle is an `epoll_wait` (20 µs gave the 4 KiB allreduce and barrier their lowest medians).
const SELF_READ_HOLD: Duration = Duration::from_micros(20);

/// Sealed bytes queued for the writer above which senders wait for room. Small enough that
/// the buffers are still in cache when the writer hands them to the kernel: 2 MiB ran 16 MiB
/// allreduces ~15 % faster than 8 MiB did.
const QUEUED_LIMIT: usize = 2 << 20;
/// Plaintext groups this long or shorter (on the wire) are first offered to the socket whole,
/// straight from the caller's buffer, rather than a [`CHUNK`](super::records::CHUNK) at a
/// time with a copy between: one that a drained socket takes goes out with no copy at all.
const STRAIGHT_WHOLE: usize = 2 << 20;

/// What both threads and the channel share.
pub(super) struct State {
    pub(super) peer: usize,
    pub(super) failed: AtomicBool,
    pub(super) stopped: Notify,
    /// Sealed bytes queued for the writer, and where senders wait for them to drain.
    pub(super) queued: AtomicUsize,
    pub(super) drained: Notify,
    /// A clone of the socket records are written to, to write from the sending task and to
    /// wake blocked threads on close.
    pub(super) socket: TcpStream,
    /// A clone of the socket the peer's records are read from, where that is another
    /// connection.
    incoming: Option<TcpStream>,
    /// Set when the lane says goodbye: the writer gives up on a peer that does not read by
    /// then.
    pub(super) write_deadline: std::sync::OnceLock<std::time::Instant>,
    /// When a receive last polled the lane's reader itself ([`super::landing::Spun`]).
    pub(super) spun: super::landing::Spun,
}

pub(super) use crate::transport::reading::Stop;

impl crate::transport::reading::Stoppable for State {
    fn has_stopped(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn stop_as(&self, why: &str, how: Stop) {
        self.stop(why, how);
    }

    fn wait_stopped(&self) -> impl std::future::Future<Output = ()> + Send + '_ {
        crate::transport::reading::wait_notified(&self.stopped, || self.failed.load(Ordering::SeqCst))
    }
}

impl State {
    /// Marks the channel unusable (once), closes its sockets and, unless the peer just said
    /// goodbye, wakes whoever waits for it to stop.
    pub(super) fn stop(&self, why: &str, how: Stop) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            if how == Stop::Failed {
                tracing::warn!(peer = self.peer, why, "tcp lane failed");
            } else {
                tracing::debug!(peer = self.peer, why, "tcp lane closed");
            }
            // After the peer's goodbye, this side still says its own, which the peer is still
            // reading: only the reading side closes.
            if how == Stop::Goodbye {
                self.stop_reading();
            } else {
                for s in std::iter::once(&self.socket).chain(&self.incoming) {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
        }
        if how != Stop::Goodbye {
            self.stopped.notify_waiters();
        }
        self.drained.notify_waiters();
    }

    /// Closes what the peer's records are read from (waking a reader blocked there): the
    /// incoming connection, or the reading half of the one connection.
    fn stop_reading(&self) {
        let _ = match &self.incoming {
            Some(incoming) => incoming.shutdown(Shutdown::Both),
            None => self.socket.shutdown(Shutdown::Read),
        };
    }

    /// A lane's state around `socket` (one connection), for tests of its parts.
    #[cfg(test)]
    pub(super) fn for_tests(peer: usize, socket: TcpStream) -> State {
        State {
            peer,
            failed: AtomicBool::new(false),
            stopped: Notify::new(),
            queued: AtomicUsize::new(0),
            drained: Notify::new(),
            socket,
            incoming: None,
            write_deadline: std::sync::OnceLock::new(),
            spun: super::landing::Spun::default(),
        }
    }

    pub(super) fn lost(&self, why: impl std::fmt::Display) -> TransportError {
        TransportError::ConnectionLost { peer: format!("rank {}", self.peer), reason: format!("tcp lane: {why}") }
    }
}

/// Resolves once `done(state)` holds, checked whenever `notify(state)` is notified (armed
/// before each check, so no notification is missed).
pub(super) fn wait_until(state: Arc<State>, notify: fn(&State) -> &Notify, done: fn(&State) -> bool) -> BulkClosed {
    Box::pin(async move { crate::transport::reading::wait_notified(notify(&state), || done(&state)).await })
}

/// The sending side: groups are sealed and queued under one lock, so records reach the wire
/// in the order of their counters.
struct Sending {
    sealer: Sealer,
    jobs: std_mpsc::Sender<Job>,
}

/// How a lane protects its records and who does its I/O.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LaneIo {
    /// Records are encrypted, with this cipher (`None` with `NEXAR_BULK_ENCRYPTION=off`).
    pub encrypt: Option<LaneAead>,
    /// The rank's runtime does the I/O: a sender writes its records to the socket itself
    /// while the writer thread is idle, instead of waking it, and a task reads the peer's
    /// groups ([`super::runtime_reader`]). For hosts whose every core runs a rank, where a
    /// thread would wait for a core. Otherwise a writer thread writes one buffer while the
    /// sender seals the next, and a reader thread reads.
    pub on_runtime: bool,
    /// With `on_runtime`, large groups go through threads of the lane's own: the writer
    /// thread writes them (the sender only seals), and a thread reads the rest of each
    /// ([`super::large_reads`]). For hosts with cores to spare.
    pub large_on_threads: bool,
}

/// The [`BulkChannel`] of one link's TCP lane.
pub(crate) struct TcpLane {
    state: Arc<State>,
    sending: Mutex<Option<Sending>>,
    spare: Spare,
    min_bytes: usize,
    /// The cipher that seals records (`None` with `NEXAR_BULK_ENCRYPTION=off`).
    sealed_by: Option<LaneAead>,
    write_inline: bool,
    /// Groups this long or longer are never written inline (see [`LaneIo::large_on_threads`]).
    inline_below: usize,
    /// Groups are read by a task on the rank's runtime ([`super::runtime_reader`]), not a
    /// thread (where writes are inline and a runtime was there to start it on): this task.
    reading: Option<Arc<Drivable>>,
    /// How the next group is to be altered (a hostile member's lane).
    #[cfg(feature = "hostile-member")]
    tamper: Mutex<Option<crate::transport::bulk::LaneTamper>>,
}

impl TcpLane {
    /// Starts the threads of a connected link. Groups from the peer (within `limits`) go to
    /// `inbound`; groups under `min_bytes` stay on QUIC; `io` says how records are protected
    /// and who reads and writes them.
    pub fn start(
        peer: usize,
        conns: Connected,
        inbound: BulkInbound,
        limits: ReadLimits,
        min_bytes: usize,
        io: LaneIo,
    ) -> io::Result<TcpLane> {
        let LaneIo { encrypt, on_runtime: write_inline, large_on_threads } = io;
        let Parts { sealer, opener, out: out_sock, incoming } = conns.into_parts(encrypt)?;
        let one_connection = incoming.is_none();
        let in_sock = match incoming {
            Some(incoming) => incoming,
            None => out_sock.try_clone()?,
        };
        let state = Arc::new(State {
            peer,
            failed: AtomicBool::new(false),
            stopped: Notify::new(),
            queued: AtomicUsize::new(0),
            drained: Notify::new(),
            socket: out_sock.try_clone()?,
            incoming: if one_connection { None } else { Some(in_sock.try_clone()?) },
            write_deadline: std::sync::OnceLock::new(),
            spun: super::landing::Spun::default(),
        });
        let on_runtime = write_inline && tokio::runtime::Handle::try_current().is_ok();
        let (jobs, queue) = std_mpsc::channel::<Job>();
        let (writer, spare) = (state.clone(), Spare::default());
        let written = spare.clone();
        // A reader on the runtime puts its socket in non-blocking mode, for the writer too
        // where they share it.
        let blocking = !(on_runtime && one_connection);
        std::thread::Builder::new().name(format!("nexar-tcp-tx-{peer}")).spawn(move || {
            crate::affinity::free_helper_thread();
            write_records(&writer, out_sock, blocking, queue, &written)
        })?;
        let reader = state.clone();
        let reading = if on_runtime {
            Some(super::runtime_reader::spawn(reader, in_sock, opener, limits, inbound, large_on_threads)?)
        } else {
            std::thread::Builder::new().name(format!("nexar-tcp-rx-{peer}")).spawn(move || {
                crate::affinity::free_helper_thread();
                read_groups(&reader, in_sock, opener, limits, &inbound)
            })?;
            None
        };
        Ok(TcpLane {
            state,
            sending: Mutex::new(Some(Sending { sealer, jobs })),
            spare,
            min_bytes,
            sealed_by: encrypt,
            write_inline,
            inline_below: if large_on_threads { super::large_reads::LARGE_GROUP } else { usize::MAX },
            reading,
            #[cfg(feature = "hostile-member")]
            tamper: Mutex::default(),
        })
    }

    /// Seals one group with `sealer`, as a test asked it altered should it have.
    fn seal_group(
        &self,
        sealer: &mut Sealer,
        parts: &[&[u8]],
        buffer: impl FnMut() -> Vec<u8>,
        emit: impl FnMut(Sealed, bool) -> bool,
    ) -> io::Result<bool> {
        #[cfg(feature = "hostile-member")]
        if let Some(tamper) = crate::sync::lock(&self.tamper).take() {
            return super::tamper::seal_tampered(sealer, parts, tamper, buffer, emit);
        }
        sealer.seal_group(parts, buffer, emit)
    }

    /// Whether a group of `len` bytes goes to the socket straight from its parts ([`super::plain_write`]):
    /// records in plaintext, written on the calling thread, nothing queued ahead of it, large
    /// enough that building the gather list costs less than the copy it saves.
    fn writes_plain_from_parts(&self, inline: bool, sealer: &Sealer, len: usize) -> bool {
        if !inline || sealer.encrypts() {
            return false;
        }
        #[cfg(feature = "hostile-member")]
        if crate::sync::lock(&self.tamper).is_some() {
            return false;
        }
        len >= super::records::DIRECT_MIN && self.state.queued.load(Ordering::SeqCst) == 0
    }

    /// Writes a plaintext group in buffer-sized pieces, alternately straight from `parts`
    /// (while the writer thread is idle, as far as the socket takes it) and copied for `emit`
    /// (which writes the copy here once the socket has drained and the writer is idle, else
    /// queues it, as sealed buffers go). A group of up to [`STRAIGHT_WHOLE`] bytes is first
    /// offered whole, so a drained socket takes it with no copy (a 1 MiB broadcast 24 %
    /// faster, the 16 MiB allreduce, whose ring sends 1 MiB segments, 25 %); a larger one goes
    /// with about half its bytes copied, and the copies pace the writes as sealing does.
    /// (Writing all of a large group straight away stuffed the socket, left the rest to the
    /// writer thread and made 64 MiB broadcasts fall into runs three times slower, in 5 of
    /// 18.) `false` if the lane stopped.
    fn write_plain(
        &self,
        parts: &[&[u8]],
        mut buffer: impl FnMut() -> Vec<u8>,
        mut emit: impl FnMut(Sealed, bool) -> bool,
    ) -> bool {
        use super::records::CHUNK;
        let group = super::plain_write::PlainGroup::new(parts, super::records::lead_of(parts) as u64);
        let (total, mut at) = (group.wire_len(), 0);
        // A group the socket can take whole goes in one piece, with no copy.
        let mut straight = if total <= STRAIGHT_WHOLE { total } else { CHUNK };
        while at < total {
            if self.state.queued.load(Ordering::SeqCst) == 0 {
                let piece = std::mem::replace(&mut straight, CHUNK);
                match group.write_ready(&self.state.socket, at, at + piece) {
                    Ok(written) => at += written,
                    Err(e) => {
                        self.state.stop(&format!("writing: {e}"), Stop::Failed);
                        return false;
                    }
                }
                if at == total {
                    break;
                }
            }
            let end = (at + CHUNK).min(total);
            if !emit(group.copy_range(at, end, buffer()), end == total) {
                return false;
            }
            at = end;
        }
        true
    }

    /// Seals one group (the concatenation of `parts`) on the calling thread and queues it.
    fn seal_and_queue(&self, parts: &[&[u8]]) -> Sent {
        // Told once the group's last buffer is written, where that is left to the writer.
        let mut written = None;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let inline = self.write_inline && len < self.inline_below;
        let queued = {
            let mut sending = crate::sync::lock(&self.sending);
            match sending.as_mut() {
                Some(s) if !self.state.failed.load(Ordering::SeqCst) => {
                    let spare = || crate::sync::lock(&self.spare).pop().unwrap_or_default();
                    let emit = |mut chunk: Sealed, last: bool| {
                        // With nothing queued the writer thread is idle (it counts a buffer
                        // off only once it is written), so the buffer may go to the socket
                        // from here, in order, without waking the thread (see
                        // `LaneIo::on_runtime`); it takes what the socket does not. (A buffer
                        // written here was preceded only by buffers written here.)
                        if inline && self.state.queued.load(Ordering::SeqCst) == 0 {
                            match write_ready(&self.state.socket, &chunk) {
                                Ok(n) if n == chunk.len() => {
                                    give_back(&self.spare, chunk);
                                    return true;
                                }
                                Ok(n) => chunk.advance(n),
                                Err(e) => {
                                    self.state.stop(&format!("writing: {e}"), Stop::Failed);
                                    return false;
                                }
                            }
                        }
                        let (tell, told) = oneshot::channel();
                        if last {
                            written = Some(told);
                        }
                        self.state.queued.fetch_add(chunk.len(), Ordering::SeqCst);
                        s.jobs.send((chunk, tell)).is_ok()
                    };
                    if self.writes_plain_from_parts(inline, &s.sealer, len) {
                        self.write_plain(parts, spare, emit)
                    } else {
                        match self.seal_group(&mut s.sealer, parts, spare, emit) {
                            Ok(queued) => queued,
                            Err(e) => {
                                self.state.stop(&format!("sealing: {e}"), Stop::Failed);
                                false
                            }
                        }
                    }
                }
                _ => false,
            }
        };
        if !queued {
            return Sent::Done(Err(self.state.lost("the lane stopped")));
        }
        let Some(written) = written else { return Sent::Done(Ok(())) };
        let state = self.state.clone();
        Sent::Later(Box::pin(async move { written.await.unwrap_or_else(|_| Err(state.lost("the writer stopped"))) }))
    }
}

impl BulkChannel for TcpLane {
    fn name(&self) -> &'static str {
        TCP_LANE_NAME
    }

    fn send(&self, frames: Vec<Bytes>) -> BulkSend {
        let parts: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        match self.seal_and_queue(&parts) {
            Sent::Done(result) => Box::pin(std::future::ready(result)),
            Sent::Later(sent) => sent,
        }
    }

    fn send_borrowed(&self, parts: &[&[u8]]) -> Option<Sent> {
        Some(self.seal_and_queue(parts))
    }

    fn has_room(&self) -> bool {
        self.state.queued.load(Ordering::SeqCst) < QUEUED_LIMIT || self.state.failed.load(Ordering::SeqCst)
    }

    fn room(&self) -> BulkClosed {
        wait_until(
            self.state.clone(),
            |s| &s.drained,
            |s| s.queued.load(Ordering::SeqCst) < QUEUED_LIMIT || s.failed.load(Ordering::SeqCst),
        )
    }

    fn usable(&self) -> bool {
        !self.state.failed.load(Ordering::SeqCst)
    }

    fn describe(&self) -> Option<String> {
        let protection = match self.sealed_by {
            Some(aead) => format!("sealed, {aead}"),
            None => "plaintext".into(),
        };
        Some(format!("{protection}, {} congestion control", super::congestion::in_use(&self.state.socket)))
    }

    fn closed(&self) -> BulkClosed {
        wait_until(self.state.clone(), |s| &s.stopped, |s| s.failed.load(Ordering::SeqCst))
    }

    /// The reader met the peer's goodbye (every group before it is delivered), or the lane
    /// stopped: either way the lane is marked stopped.
    fn drained(&self) -> BulkClosed {
        wait_until(self.state.clone(), |s| &s.drained, |s| s.failed.load(Ordering::SeqCst))
    }

    fn close(&self) {
        self.state.stop("nexar gave the lane up", Stop::GivenUp);
        // The writer's queue ends with the sender, so its thread stops too.
        drop(crate::sync::lock(&self.sending).take());
    }

    fn goodbye(&self) -> BulkClosed {
        self.say_goodbye()
    }

    fn min_bytes(&self) -> usize {
        self.min_bytes
    }

    /// A lane is one ordered stream each way, so it keeps a pair's point-to-point messages in
    /// order; it takes them where a task on the rank's runtime reads it (the default), so
    /// that a small message costs no thread wake-up (with `NEXAR_LANE_THREADS=on` they stay
    /// on QUIC, as collectives under `min_bytes` do).
    fn carries_point_to_point(&self) -> bool {
        self.reading.is_some()
    }

    fn delivers_on_runtime(&self) -> bool {
        self.reading.is_some()
    }

    /// Polls the lane's reader on the receive's thread; a reader that lands payloads (a
    /// plaintext lane's, or one whose cipher opens in place) reads the awaited message's
    /// payload straight into the buffer the receive lends, if it lends one, and otherwise
    /// stops waiting for a loan ([`super::landing`]).
    fn deliver_ready(&self, awaiting: Option<Awaiting<'_>>) -> Option<Duration> {
        let reading = self.reading.as_ref()?;
        self.state.spun.now();
        let lands = self.sealed_by.is_none_or(LaneAead::lands);
        let driven = match awaiting {
            Some(mut awaiting) if lands => {
                let awaited = awaiting.message();
                match awaiting.take_destination() {
                    // Asked under the reader's lock: only the reader delivers this lane's
                    // messages, so none can come between the answer and the loan.
                    Some((dst, ours)) => reading.drive_around(|poll| match ours() {
                        true => crate::transport::lent::lend(dst, awaited, poll),
                        false => poll(),
                    }),
                    // A receive that will not take the payload as it is (it reduces it) lends
                    // nothing, so that the reader does not wait for it to.
                    None => reading.drive_around(|poll| crate::transport::lent::lend(&mut [], awaited, poll)),
                }
            }
            _ => reading.drive(),
        };
        driven.then_some(SELF_READ_HOLD)
    }

    /// The reader stops waiting for the parked receive's loan ([`super::landing`]): where it
    /// was reading a payload into that receive's buffer, its task reads on into its pooled
    /// buffer on its next turn (at once: the receive leaves the thread).
    fn receive_parks(&self) {
        if let Some(reading) = &self.reading
            && self.state.spun.park()
        {
            reading.wake();
        }
    }

    #[cfg(feature = "hostile-member")]
    fn tamper_next(&self, tamper: crate::transport::bulk::LaneTamper) -> bool {
        *crate::sync::lock(&self.tamper) = Some(tamper);
        true
    }
}

impl TcpLane {
    /// Queues the goodbye (once) and stops taking groups: the writer stops after it (within
    /// [`GOODBYE_TIMEOUT`] should the peer not read), and this side's reader stops now.
    fn say_goodbye(&self) -> BulkClosed {
        let mut told = None;
        if let Some(mut s) = crate::sync::lock(&self.sending).take() {
            let mut out = Vec::new();
            if s.sealer.seal_goodbye(&mut out).is_ok() {
                // The writer looks at it at least every `WRITE_SLICE` while it waits for room.
                let _ = self.state.write_deadline.set(std::time::Instant::now() + GOODBYE_TIMEOUT);
                let (done, written) = oneshot::channel();
                if s.jobs.send((out.into(), done)).is_ok() {
                    told = Some(written);
                }
            }
        }
        self.state.failed.store(true, Ordering::SeqCst);
        self.state.stop_reading();
        self.state.stopped.notify_waiters();
        self.state.drained.notify_waiters();
        Box::pin(async move {
            if let Some(written) = told {
                let _ = written.await;
            }
        })
    }
}

impl Drop for TcpLane {
    fn drop(&mut self) {
        drop(self.say_goodbye());
    }
}
