//! Opening a connection of a TCP lane: TLS with the cluster's certificates, then a hello that
//! binds the connection to a link.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConnection, ServerConnection, StreamOwned};

use super::setup::TOKEN_LEN;
use crate::transport::TransportError;
use crate::transport::tls::{Identity, mesh_client_tls, mesh_server_tls, rank_from_cert, rank_server_name};

/// ALPN protocol of the TCP lane (2: records both ways on a connection, keys per direction).
const LANE_ALPN: &[u8] = b"nexar-lane/2";

/// What the dialler sends first: the token the peer gave it, then its world rank.
pub(crate) type Hello = [u8; TOKEN_LEN + 4];

/// TLS configurations of the lane, built once per rank.
#[derive(Clone)]
pub(crate) struct LaneTls {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
}

impl LaneTls {
    /// Mutual TLS 1.3 with `identity`, trusting only the cluster CA.
    pub fn new(identity: &Identity, ca: &CertificateDer<'static>) -> Result<LaneTls, TransportError> {
        let client = mesh_client_tls(identity, ca, LANE_ALPN)?;
        let mut server = mesh_server_tls(identity, ca, LANE_ALPN)?;
        // After the handshake the dialler reads lane records, not TLS: nothing of TLS may
        // follow the handshake on its side.
        server.send_tls13_tickets = 0;
        Ok(LaneTls { client: Arc::new(client), server: Arc::new(server) })
    }
}

fn tls_io(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Keep-alive probes, so an idle lane to a host that vanished notices. (No TCP user timeout:
/// a receiver may rightly hold its window shut for as long as its application is busy.)
fn keep_alive(sock: &TcpStream) -> io::Result<()> {
    let probes = socket2::TcpKeepalive::new().with_time(Duration::from_secs(10)).with_interval(Duration::from_secs(2));
    #[cfg(target_os = "linux")]
    let probes = probes.with_retries(5);
    socket2::SockRef::from(sock).set_tcp_keepalive(&probes)
}

fn with_timeouts(sock: &TcpStream, limit: Option<Duration>) -> io::Result<()> {
    sock.set_read_timeout(limit)?;
    sock.set_write_timeout(limit)
}

/// Reads and writes on a socket that fail once `deadline` has passed, however slowly the bytes
/// trickle in: a per-read timeout alone would let a peer that sends a byte now and then hold
/// the handshake open for ever.
struct Deadlined<'a> {
    sock: &'a TcpStream,
    deadline: Instant,
}

impl Deadlined<'_> {
    /// Sets the socket's timeouts to what is left before the deadline.
    fn arm(&self) -> io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the lane handshake ran past its deadline"));
        }
        with_timeouts(self.sock, Some(left))
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        (&mut &*self.sock).read(buf)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        (&mut &*self.sock).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        (&mut &*self.sock).flush()
    }
}

/// Dials the lane listener of world rank `peer` at `addr` and says hello (blocking, the whole
/// of it within `limit`).
pub(crate) fn dial(
    tls: &LaneTls,
    addr: SocketAddr,
    peer: u32,
    hello: Hello,
    limit: Duration,
) -> io::Result<StreamOwned<ClientConnection, TcpStream>> {
    let deadline = Instant::now() + limit;
    let sock = TcpStream::connect_timeout(&addr, limit)?;
    sock.set_nodelay(true)?;
    keep_alive(&sock)?;
    let name = ServerName::try_from(rank_server_name(peer)).map_err(tls_io)?;
    let mut conn = ClientConnection::new(tls.client.clone(), name).map_err(tls_io)?;
    {
        let mut io = Deadlined { sock: &sock, deadline };
        let mut stream = rustls::Stream::new(&mut conn, &mut io);
        // Completes the handshake (the peer's certificate must name `peer`) before the hello.
        stream.write_all(&hello)?;
        stream.flush()?;
    }
    with_timeouts(&sock, None)?;
    Ok(StreamOwned::new(conn, sock))
}

/// Answers a connection to the lane listener (blocking, the whole of it within `limit`): the
/// dialler's hello and the world rank its certificate is bound to.
pub(crate) fn answer(
    tls: &LaneTls,
    sock: TcpStream,
    limit: Duration,
) -> io::Result<(Hello, u32, StreamOwned<ServerConnection, TcpStream>)> {
    let deadline = Instant::now() + limit;
    sock.set_nodelay(true)?;
    keep_alive(&sock)?;
    let mut conn = ServerConnection::new(tls.server.clone()).map_err(tls_io)?;
    let mut hello: Hello = [0; TOKEN_LEN + 4];
    {
        let mut io = Deadlined { sock: &sock, deadline };
        rustls::Stream::new(&mut conn, &mut io).read_exact(&mut hello)?;
    }
    let stream = StreamOwned::new(conn, sock);
    let cert = stream
        .conn
        .peer_certificates()
        .and_then(|c| c.first())
        .ok_or_else(|| io::Error::new(io::ErrorKind::PermissionDenied, "no client certificate"))?;
    let rank = rank_from_cert(cert).map_err(tls_io)?;
    with_timeouts(&stream.sock, None)?;
    Ok((hello, rank, stream))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::tls::ClusterCa;
    use std::net::TcpListener;

    const LIMIT: Duration = Duration::from_secs(5);

    fn rank_tls(ca: &ClusterCa, rank: u32) -> LaneTls {
        LaneTls::new(&ca.issue(&rank_server_name(rank)).unwrap(), &ca.certificate()).unwrap()
    }

    /// Answers one connection on a fresh listener while `client` runs against it.
    fn answered<T: Send + 'static>(
        tls: LaneTls,
        client: impl FnOnce(SocketAddr) -> T + Send + 'static,
    ) -> (io::Result<(Hello, u32)>, T) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || client(addr));
        let (sock, _) = listener.accept().unwrap();
        let answer = answer(&tls, sock, LIMIT).map(|(hello, rank, _)| (hello, rank));
        (answer, client.join().unwrap())
    }

    #[test]
    fn a_rank_of_the_cluster_dials_and_its_hello_and_rank_arrive() {
        let ca = ClusterCa::generate().unwrap();
        let (server, client) = (rank_tls(&ca, 1), rank_tls(&ca, 0));
        let hello: Hello = [7; TOKEN_LEN + 4];
        let (answer, dialled) = answered(server, move |addr| dial(&client, addr, 1, hello, LIMIT).map(|_| ()));
        dialled.unwrap();
        assert_eq!(answer.unwrap(), (hello, 0));
    }

    /// A dialler that sends one byte every 50 ms never lets a per-read timeout expire; the
    /// handshake's single deadline still ends it.
    #[test]
    fn a_slowloris_handshake_ends_at_the_deadline() {
        let ca = ClusterCa::generate().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let trickle = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                // A TLS record header promising a long ClientHello, then a byte at a time.
                let _ = s.write_all(&[0x16, 3, 1, 0x3f, 0xff]);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if s.write_all(&[0]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        let (sock, _) = listener.accept().unwrap();
        let started = Instant::now();
        let err = answer(&rank_tls(&ca, 1), sock, Duration::from_millis(500)).map(|_| ()).unwrap_err();
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        trickle.join().unwrap();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        // 16 KiB at 20 bytes a second would take 13 minutes; the deadline ends it long before.
        assert!(took < Duration::from_secs(60), "took {took:?}");
    }

    #[test]
    fn strangers_and_garbage_are_refused() {
        let ca = ClusterCa::generate().unwrap();
        // Plain bytes instead of a TLS handshake.
        let (answer, _) = answered(rank_tls(&ca, 1), |addr| {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(&[0x16, 3, 3, 0xff, 0xff, 1, 2, 3]);
            std::thread::sleep(Duration::from_millis(100));
        });
        assert!(answer.is_err());
        // A certificate from another cluster's CA, either way round.
        let other = ClusterCa::generate().unwrap();
        let (stranger, hello) = (rank_tls(&other, 0), [1; TOKEN_LEN + 4]);
        let (answer, _) = answered(rank_tls(&ca, 1), move |addr| dial(&stranger, addr, 1, hello, LIMIT).is_ok());
        assert!(answer.is_err(), "a client certificate from another CA is refused");
        let member = rank_tls(&ca, 0);
        let (_, dialled) = answered(rank_tls(&other, 1), move |addr| dial(&member, addr, 1, hello, LIMIT).map(|_| ()));
        assert!(dialled.is_err(), "a listener from another CA is refused");
        // A listener whose certificate names another rank than the one dialled.
        let member = rank_tls(&ca, 0);
        let (_, dialled) = answered(rank_tls(&ca, 2), move |addr| dial(&member, addr, 1, hello, LIMIT).map(|_| ()));
        assert!(dialled.is_err(), "rank 2's certificate does not pass for rank 1");
    }
}
