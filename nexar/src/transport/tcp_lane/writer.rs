//! The writing side of a TCP lane: sealed record buffers written to the link's socket, by
//! the sender itself while nothing is queued ([`write_ready`]) or by the writer thread
//! ([`write_records`]), and the buffers handed back for reuse.

use std::io;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, mpsc as std_mpsc};
use std::time::Duration;

use tokio::sync::oneshot;

use super::channel::{State, Stop};
use super::reader::POOLED;
use super::records::{CHUNK, Sealed};
use crate::transport::TransportError;

/// Sealed records waiting for the writer thread, and who hears when they are written.
pub(super) type Job = (Sealed, oneshot::Sender<Result<(), TransportError>>);

/// Record buffers the writer hands back once written, so sealing does not fault in fresh
/// pages for every group.
pub(super) type Spare = Arc<Mutex<Vec<Vec<u8>>>>;

/// Gives a written buffer back for reuse, if the spare list has room and it is not huge.
pub(super) fn give_back(spare: &Spare, sealed: Sealed) {
    let buf = sealed.into_buffer();
    if buf.capacity() <= 2 * CHUNK {
        let mut spare = crate::sync::lock(spare);
        if spare.len() < POOLED {
            spare.push(buf);
        }
    }
}

/// Writes what the socket takes of `bytes` now, without blocking; returns how much that was.
pub(super) fn write_ready(socket: &TcpStream, bytes: &[u8]) -> io::Result<usize> {
    use rustix::net::SendFlags;
    let mut at = 0;
    while at < bytes.len() {
        match rustix::net::send(socket, &bytes[at..], SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(rustix::io::Errno::AGAIN) => break,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(at)
}

/// The longest the writer waits for room in the socket at a time before it looks at the
/// lane's write deadline again: a deadline set while it waits (the goodbye's) is kept, and a
/// peer that stops reading cannot hold the writer thread, its socket and its buffers forever.
pub(super) const WRITE_SLICE: Duration = Duration::from_millis(100);

/// Writes all of `bytes`, waiting for room in the socket as long as it takes, or until the
/// lane's write deadline (set when it says goodbye). A socket in `blocking` mode blocks in
/// `write` for at most [`WRITE_SLICE`] at a time (its write timeout, set by
/// [`write_records`]); otherwise (the lane's reader on the runtime shares the socket and
/// needs non-blocking mode) this waits for room in `poll`, as long.
fn write_all(state: &State, socket: &TcpStream, blocking: bool, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut at = 0;
    while at < bytes.len() {
        if blocking {
            match (&mut &*socket).write(&bytes[at..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => at += n,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        } else {
            at += write_ready(socket, &bytes[at..])?;
        }
        if at == bytes.len() {
            break;
        }
        let left = match state.write_deadline.get() {
            Some(by) => match by.checked_duration_since(std::time::Instant::now()) {
                Some(left) if !left.is_zero() => left.min(WRITE_SLICE),
                _ => return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer did not read the goodbye")),
            },
            None => WRITE_SLICE,
        };
        if !blocking {
            wait_for(socket, rustix::event::PollFlags::OUT, Some(left))?;
        }
    }
    Ok(())
}

/// Waits in `poll` until the non-blocking `socket` is ready for `flags`, `wait` passes (`None`:
/// no limit) or a signal comes; whoever called it tries again.
pub(super) fn wait_for(socket: &TcpStream, flags: rustix::event::PollFlags, wait: Option<Duration>) -> io::Result<()> {
    use rustix::event::{PollFd, Timespec};
    let timeout = wait.map(|d| Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) });
    let mut fds = [PollFd::new(socket, flags)];
    match rustix::event::poll(&mut fds, timeout.as_ref()) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The writer thread: sealed records, in the order they were queued.
pub(super) fn write_records(
    state: &State,
    out: TcpStream,
    blocking: bool,
    queue: std_mpsc::Receiver<Job>,
    spare: &Spare,
) {
    if blocking && let Err(e) = out.set_write_timeout(Some(WRITE_SLICE)) {
        state.stop(&format!("setting the write timeout: {e}"), Stop::Failed);
    }
    while let Ok((records, done)) = queue.recv() {
        let written = write_all(state, &out, blocking, &records);
        state.queued.fetch_sub(records.len(), Ordering::SeqCst);
        state.drained.notify_waiters();
        match written {
            Ok(()) => {
                let _ = done.send(Ok(()));
                give_back(spare, records);
            }
            Err(e) => {
                state.stop(&format!("writing: {e}"), Stop::Failed);
                let _ = done.send(Err(state.lost(e)));
                break;
            }
        }
    }
    // Whatever is still queued fails (the channel said so when it stopped).
    while let Ok((_, done)) = queue.try_recv() {
        let _ = done.send(Err(state.lost("the lane stopped")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that stops reading while the writer thread waits for room in a socket in
    /// either mode: the goodbye's deadline, set after the wait began, still ends the wait, the
    /// write fails and the thread ends (it held its socket and buffers forever before).
    #[test]
    fn a_writer_waiting_on_a_peer_that_stopped_reading_ends_at_the_goodbye_deadline() {
        for blocking in [true, false] {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let _silent = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (sock, _) = listener.accept().unwrap();
            sock.set_nonblocking(!blocking).unwrap();
            let state = Arc::new(State::for_tests(1, sock.try_clone().unwrap()));
            let (jobs, queue) = std_mpsc::channel::<Job>();
            let (done, written) = oneshot::channel();
            // Far more than the two sockets' buffers hold.
            jobs.send((Sealed::from(vec![1u8; 64 << 20]), done)).unwrap();
            drop(jobs);
            let writer = {
                let state = state.clone();
                std::thread::spawn(move || write_records(&state, sock, blocking, queue, &Spare::default()))
            };
            std::thread::sleep(Duration::from_millis(300));
            assert!(!writer.is_finished(), "blocking {blocking}: the writer waits for room");
            state.write_deadline.set(std::time::Instant::now() + Duration::from_millis(200)).unwrap();
            let started = std::time::Instant::now();
            while !writer.is_finished() {
                assert!(started.elapsed() < Duration::from_secs(30), "blocking {blocking}: the writer still waits");
                std::thread::sleep(Duration::from_millis(10));
            }
            writer.join().unwrap();
            let err = written.blocking_recv().unwrap().unwrap_err().to_string();
            assert!(err.contains("did not read the goodbye"), "blocking {blocking}: {err}");
            assert!(state.failed.load(Ordering::SeqCst), "blocking {blocking}: the lane stopped");
        }
    }
}
