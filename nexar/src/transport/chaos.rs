//! A faulty network for tests: a UDP socket wrapper that loses, delays and reorders datagrams,
//! or goes silent on command. The kernel's netem is not always available; this works anywhere
//! and affects exactly one rank's endpoint.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

use crate::config::NetChaos;

/// Why a rank with injected faults declines the transports that would carry its payloads
/// past them (shared memory, the TCP lane): the faults act on QUIC's datagrams only.
pub(crate) const KEEPS_QUIC: &str = "this rank injects network faults into QUIC";

/// The wrapped socket.
pub(crate) struct ChaosSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    chaos: NetChaos,
    rng: AtomicU64,
}

impl fmt::Debug for ChaosSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChaosSocket").field("chaos", &self.chaos).finish_non_exhaustive()
    }
}

impl ChaosSocket {
    pub fn wrap(inner: Arc<dyn AsyncUdpSocket>, chaos: NetChaos) -> Arc<dyn AsyncUdpSocket> {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        Arc::new(ChaosSocket { inner, chaos, rng: AtomicU64::new(seed) })
    }

    fn draw(&self) -> f64 {
        draw(&self.rng)
    }
}

/// A uniform draw in [0, 1) from a splitmix64 sequence.
fn draw(state: &AtomicU64) -> f64 {
    let mut z = state.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

impl AsyncUdpSocket for ChaosSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        if self.chaos.silence.is_on() || self.draw() < self.chaos.loss {
            return Ok(());
        }
        if self.chaos.reorder > 0.0 && self.draw() < self.chaos.reorder {
            let (inner, contents) = (self.inner.clone(), transmit.contents.to_vec());
            let (destination, ecn, src_ip) = (transmit.destination, transmit.ecn, transmit.src_ip);
            let delay = if self.chaos.delay.is_zero() { Duration::from_millis(2) } else { self.chaos.delay };
            let silence = self.chaos.silence.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if !silence.is_on() {
                    let late = Transmit { destination, ecn, contents: &contents, segment_size: None, src_ip };
                    // A full socket buffer loses the datagram, as a real network would.
                    let _ = inner.try_send(&late);
                }
            });
            return Ok(());
        }
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        loop {
            match self.inner.poll_recv(cx, bufs, meta) {
                Poll::Ready(Ok(_)) if self.chaos.silence.is_on() => continue,
                other => return other,
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// One datagram per transmit, so that loss and reordering apply to single datagrams.
    fn max_transmit_segments(&self) -> usize {
        1
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_uniform_enough() {
        let rng = AtomicU64::new(7);
        let n = 100_000;
        let below = (0..n).filter(|_| draw(&rng) < 0.05).count();
        assert!((4_000..6_000).contains(&below), "{below} of {n} draws below 0.05");
        assert!((0..1000).all(|_| (0.0..1.0).contains(&draw(&rng))));
    }
}
