//! A socket read that, while a spinning receive drives it, asks the kernel for bytes itself
//! instead of waiting for the runtime's next readiness poll.
//!
//! tokio reads a socket only after its reactor has seen it readable, and on a current-thread
//! runtime the reactor is polled once per runtime cycle (an `epoll_wait` per `yield_now`). A
//! receive that spins for a lane's message polls the lane's reader itself
//! ([`Drivable::drive`](super::drivable::Drivable::drive)); during such a poll the reader
//! tries a non-blocking `recv` first, so bytes that arrived since the last cycle are read at
//! once, and the spin need not hand the thread to the runtime to learn of them. Polled by its
//! own task, the reader reads as tokio does (no extra system call per wake-up).

use std::cell::Cell;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;

thread_local! {
    /// Set while a spinning receive polls a reader on this thread.
    static DRIVEN: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with readers polled within it reading eagerly.
pub(crate) fn driven<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            DRIVEN.with(|d| d.set(self.0));
        }
    }
    let _reset = Reset(DRIVEN.with(|d| d.replace(true)));
    f()
}

/// A tokio socket whose reads go to the kernel directly while driven (see the module docs).
pub(crate) struct EagerRead(pub TcpStream);

impl AsyncRead for EagerRead {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if DRIVEN.with(Cell::get) && buf.remaining() > 0 {
            let unfilled = buf.initialize_unfilled();
            match rustix::net::recv(&this.0, unfilled, rustix::net::RecvFlags::DONTWAIT) {
                Ok((n, _)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
        Pin::new(&mut this.0).poll_read(cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn poll_once(reader: &mut EagerRead, into: &mut [u8]) -> Poll<io::Result<usize>> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut buf = ReadBuf::new(into);
        match Pin::new(reader).poll_read(&mut cx, &mut buf) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(buf.filled().len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    #[tokio::test]
    async fn a_driven_read_takes_what_arrived_without_the_reactor() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut reader = EagerRead(TcpStream::from_std(ours).unwrap());
        let mut into = [0u8; 16];
        // Nothing there: the driven read falls back to tokio's, which waits.
        assert!(driven(|| poll_once(&mut reader, &mut into)).is_pending());
        peer.write_all(b"hello").unwrap();
        // Read in this very poll: no runtime cycle has run since the bytes were written.
        let got = (0..1000).find_map(|_| match driven(|| poll_once(&mut reader, &mut into)) {
            Poll::Ready(n) => Some(n.unwrap()),
            Poll::Pending => None,
        });
        assert_eq!(got, Some(5));
        assert_eq!(&into[..5], b"hello");
        // The flag is down again once the driven poll returns.
        assert!(!DRIVEN.with(Cell::get));
        // The peer's end of the stream reads as the end (0 bytes), driven or not.
        drop(peer);
        let end = (0..1000).find_map(|_| match driven(|| poll_once(&mut reader, &mut into)) {
            Poll::Ready(n) => Some(n.unwrap()),
            Poll::Pending => None,
        });
        assert_eq!(end, Some(0));
    }
}
