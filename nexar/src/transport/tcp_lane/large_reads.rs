//! The rest of a large group, read by a thread of the lane's own for a reader that runs on the
//! rank's runtime, on hosts with cores to spare.
//!
//! A reader on the runtime ([`super::runtime_reader`]) costs no thread wake-up per group, which
//! is what small messages need. But it copies every byte out of the kernel on the rank's own
//! thread, between the sealing, opening and reducing that thread also does, where a reader
//! thread would copy them on another core meanwhile (on a 16-core host, np 2: a 16 MiB allreduce
//! at 1.8 GB/s all on the runtime, 3.2 with lane threads; a barrier 11 against 18 µs, as lane
//! threads leave small messages to QUIC). So once a group's frames are read and the mailbox has
//! admitted it, a group with at least [`LARGE_GROUP`] bytes left is handed to this thread,
//! which reads the rest of its records exactly as the reader thread does
//! ([`Opener::read_records`]) and hands the group back (2.8 GB/s, with such groups also
//! written by the writer thread). Between groups the thread looks for the next for
//! [`NEXT_GROUP_SPIN`] before it sleeps, so a stream of large groups costs no wake-up each.

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::channel::State;
use super::reader::PooledGroup;
use super::records::{Deferred, Opener};

/// Bytes a group must have left once admitted for the rest to go to the thread.
pub(super) const LARGE_GROUP: usize = 512 << 10;

/// How often a read waiting for bytes looks whether the lane has stopped.
const STOP_CHECK: Duration = Duration::from_millis(100);
/// How long the thread looks for the next group before it sleeps: while large groups stream
/// in, the next comes within microseconds, and a thread that slept would cost a wake-up each.
const NEXT_GROUP_SPIN: Duration = Duration::from_micros(50);

/// A group whose remaining records the thread is to read, with what reading them takes.
pub(super) struct Rest {
    /// The lane's opener (the records' keys and counters move with it).
    pub opener: Opener,
    /// The group, its first `at` bytes in place.
    pub group: PooledGroup,
    pub at: usize,
    pub defer_from: usize,
    pub deferred: Vec<Deferred>,
    /// Bytes of the group the runtime reader had already taken from the socket, unparsed.
    pub buffered: Vec<u8>,
    /// When the group's bytes must all be in.
    pub until: Instant,
}

/// A group read to its end by the thread (or the error that stopped it), with the opener.
pub(super) struct Done {
    pub opener: Opener,
    pub group: PooledGroup,
    pub deferred: Vec<Deferred>,
    pub read: io::Result<usize>,
}

type Job = (Rest, oneshot::Sender<Done>);

/// The lane's large-group reading thread.
pub(super) struct LargeReads {
    jobs: std_mpsc::Sender<Job>,
}

impl LargeReads {
    /// Starts the thread on `sock`, a clone of the socket the runtime reader reads (in
    /// non-blocking mode); it ends when this is dropped.
    pub fn start(state: Arc<State>, sock: TcpStream) -> io::Result<LargeReads> {
        let (jobs, queue) = std_mpsc::channel::<Job>();
        std::thread::Builder::new().name(format!("nexar-tcp-rxl-{}", state.peer)).spawn(move || {
            crate::affinity::free_helper_thread();
            while let Some((rest, done)) = next_job(&queue) {
                let _ = done.send(read_rest(&state, &sock, rest));
            }
        })?;
        Ok(LargeReads { jobs })
    }

    /// Reads the rest of a group on the thread.
    pub async fn read(&self, rest: Rest) -> io::Result<Done> {
        let (done, told) = oneshot::channel();
        let gone = || io::Error::other("the lane's large-group reader is gone");
        self.jobs.send((rest, done)).map_err(|_| gone())?;
        told.await.map_err(|_| gone())
    }
}

/// The next group to read, looked for a while before the thread sleeps; `None` once the lane's
/// reader is gone.
fn next_job(queue: &std_mpsc::Receiver<Job>) -> Option<Job> {
    let until = Instant::now() + NEXT_GROUP_SPIN;
    loop {
        match queue.try_recv() {
            Ok(job) => return Some(job),
            Err(std_mpsc::TryRecvError::Disconnected) => return None,
            Err(std_mpsc::TryRecvError::Empty) if Instant::now() < until => std::hint::spin_loop(),
            Err(std_mpsc::TryRecvError::Empty) => return queue.recv().ok(),
        }
    }
}

fn read_rest(state: &State, sock: &TcpStream, rest: Rest) -> Done {
    let Rest { mut opener, mut group, at, defer_from, mut deferred, buffered, until } = rest;
    let len = super::records::GroupSink::group_len(&group);
    let mut input = io::Cursor::new(buffered).chain(Polled { state, sock, until });
    let read = opener.read_records(&mut input, &mut group, at, len, defer_from, &mut deferred);
    Done { opener, group, deferred, read }
}

/// Blocking reads on a non-blocking socket: each waits in `poll` for bytes, until `until`
/// (then fails as the runtime reader's deadline does) or until the lane stops.
struct Polled<'a> {
    state: &'a State,
    sock: &'a TcpStream,
    until: Instant,
}

impl Read for Polled<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match rustix::net::recv(self.sock, &mut *buf, rustix::net::RecvFlags::empty()) {
                Ok((n, _)) => return Ok(n),
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            if self.state.failed.load(Ordering::SeqCst) {
                return Err(io::Error::other("the lane stopped while a group was read"));
            }
            let left = self.until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(super::runtime_reader::group_late());
            }
            super::writer::wait_for(self.sock, rustix::event::PollFlags::IN, Some(left.min(STOP_CHECK)))?;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;
    use crate::transport::tcp_lane::reader::RecvPool;
    use crate::transport::tcp_lane::records::{GroupHead, GroupSink, plain_group};

    /// A large group in plaintext records: its head, and the wire bytes of its records.
    fn group(payload: &[u8]) -> (GroupHead, Vec<u8>, Opener) {
        plain_group(&[payload])
    }

    /// A connected pair: the lane's side (non-blocking, as a runtime reader leaves it) and
    /// the peer's.
    fn sockets() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        ours.set_nonblocking(true).unwrap();
        (ours, peer)
    }

    #[tokio::test]
    async fn the_thread_reads_a_group_from_the_buffered_bytes_on_and_hands_it_back_whole() {
        let payload: Vec<u8> = (0..(LARGE_GROUP * 2 + 12_345)).map(|i| (i * 7 % 251) as u8).collect();
        let (head, rest, opener) = group(&payload);
        let (ours, mut peer) = sockets();
        let state = Arc::new(State::for_tests(1, ours.try_clone().unwrap()));
        let large = LargeReads::start(state, ours).unwrap();
        let pool = Arc::new(RecvPool::default());
        let len = head.len as usize;
        // What the runtime reader had buffered: part of the first record's header and body.
        let (buffered, on_socket) = rest.split_at(1_000);
        let sending = std::thread::spawn({
            let on_socket = on_socket.to_vec();
            move || {
                let (first, second) = on_socket.split_at(on_socket.len() / 3);
                peer.write_all(first).unwrap();
                std::thread::sleep(Duration::from_millis(50));
                peer.write_all(second).unwrap();
                peer
            }
        });
        let rest = Rest {
            opener,
            group: RecvPool::take(&pool, len, head.lead),
            at: 0,
            defer_from: usize::MAX,
            deferred: Vec::new(),
            buffered: buffered.to_vec(),
            until: Instant::now() + Duration::from_secs(60),
        };
        let done = large.read(rest).await.unwrap();
        assert_eq!(done.read.unwrap(), len);
        assert_eq!(done.group.group_len(), payload.len());
        assert!(done.group.as_ref() == &payload[..], "the group came back altered");
        drop(sending.join().unwrap());
    }

    #[tokio::test]
    async fn a_group_that_stalls_fails_at_its_deadline_and_a_stopped_lane_fails_at_once() {
        let payload = vec![3u8; LARGE_GROUP + 1];
        let (head, rest, opener) = group(&payload);
        let (ours, mut peer) = sockets();
        let state = Arc::new(State::for_tests(4, ours.try_clone().unwrap()));
        let large = LargeReads::start(state.clone(), ours).unwrap();
        let pool = Arc::new(RecvPool::default());
        peer.write_all(&rest[..rest.len() / 2]).unwrap();
        let job = |opener, until| Rest {
            opener,
            group: RecvPool::take(&pool, head.len as usize, head.lead),
            at: 0,
            defer_from: usize::MAX,
            deferred: Vec::new(),
            buffered: Vec::new(),
            until,
        };
        let began = Instant::now();
        let done = large.read(job(opener, began + Duration::from_millis(300))).await.unwrap();
        let err = done.read.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("did not all arrive"), "{err}");
        assert!(began.elapsed() >= Duration::from_millis(300));
        // The opener comes back with the failure; a lane that has stopped ends the next read
        // within a stop check, long before its deadline.
        state.failed.store(true, Ordering::SeqCst);
        let began = Instant::now();
        let done = large.read(job(done.opener, began + Duration::from_secs(60))).await.unwrap();
        assert!(done.read.unwrap_err().to_string().contains("stopped"));
        assert!(began.elapsed() < Duration::from_secs(30));
    }
}
