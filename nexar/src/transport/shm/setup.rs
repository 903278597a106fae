//! Setting up one same-host link: which host a rank is on, the offers exchanged over the
//! (authenticated) QUIC link, and the Unix socket over which the two ranks prove who they are
//! and pass each other their ring segments.
//!
//! The socket is an abstract one (Linux), so it lives in the network namespace: ranks in
//! different namespaces never meet here, which is why the namespace is part of the host
//! identity. Anyone in the namespace could connect to it, so the connection proves itself
//! twice: the dialler presents the secret token the listener sent it over QUIC, and each
//! side checks the other's process credentials (`SO_PEERCRED`): the same user, and the process
//! id the peer announced over QUIC.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

use super::mapping::SharedMap;
use super::ring::segment_len;

/// Bytes of the token that binds a connection to its link.
pub(crate) const TOKEN_LEN: usize = 16;
const MAGIC: u8 = 0x53; // 'S'
const VERSION: u8 = 1;
/// Longest reason or host identity kept from a peer.
const MAX_TEXT: usize = 512;
/// The largest ring a peer may pass.
const MAX_RING: u64 = 256 << 20;

/// The identity of the host a rank runs on, as far as shared memory goes: the machine, its
/// current boot, the network namespace (abstract sockets live in it) and the user (a segment
/// is shared only between processes of one user). `overridden` (`NEXAR_HOST_ID`) replaces it,
/// so that tests can place ranks on fake hosts.
pub(crate) fn host_identity(overridden: Option<&str>) -> String {
    if let Some(id) = overridden {
        return format!("override:{id}");
    }
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    let uid = rustix::process::getuid().as_raw();
    format!("machine:{} boot:{} {} uid:{uid}", read("/etc/machine-id"), read("/proc/sys/kernel/random/boot_id"), netns)
}

/// A same-host offer, sent inside the negotiation driver's round one (`comm/backends/negotiate.rs`):
/// I am on `host`, process `pid`; dial my abstract socket `socket` with `token` (the lower
/// world rank of a link dials).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ShmOffer {
    pub host: String,
    pub pid: u32,
    pub socket: String,
    pub token: [u8; TOKEN_LEN],
}

fn push_text(out: &mut Vec<u8>, text: &str) {
    let text = &text.as_bytes()[..text.len().min(MAX_TEXT)];
    out.extend_from_slice(&(text.len() as u16).to_le_bytes());
    out.extend_from_slice(text);
}

fn take_text(rest: &mut &[u8]) -> Result<String, String> {
    let [a, b, tail @ ..] = *rest else { return Err("a same-host offer ends inside a length".into()) };
    let len = u16::from_le_bytes([*a, *b]) as usize;
    if len > MAX_TEXT || len > tail.len() {
        return Err(format!("a {len}-byte text in a same-host offer with {} bytes left", tail.len()));
    }
    let text = String::from_utf8_lossy(&tail[..len]).into_owned();
    *rest = &tail[len..];
    Ok(text)
}

impl ShmOffer {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![MAGIC, VERSION];
        push_text(&mut out, &self.host);
        out.extend_from_slice(&self.pid.to_le_bytes());
        push_text(&mut out, &self.socket);
        out.extend_from_slice(&self.token);
        out
    }

    /// An offer from untrusted bytes, or what is wrong with them.
    pub fn decode(bytes: &[u8]) -> Result<ShmOffer, String> {
        let [magic, version, rest @ ..] = bytes else {
            return Err(format!("a {}-byte same-host offer is too short", bytes.len()));
        };
        if (*magic, *version) != (MAGIC, VERSION) {
            return Err(format!(
                "a same-host offer with magic {magic:#x} version {version}, expected {MAGIC:#x} {VERSION}"
            ));
        }
        let mut rest = rest;
        let host = take_text(&mut rest)?;
        let [p0, p1, p2, p3, tail @ ..] = rest else { return Err("a same-host offer without a pid".into()) };
        let pid = u32::from_le_bytes([*p0, *p1, *p2, *p3]);
        rest = tail;
        let socket = take_text(&mut rest)?;
        let token: [u8; TOKEN_LEN] =
            rest.try_into().map_err(|_| format!("a same-host offer's token has {} bytes", rest.len()))?;
        Ok(ShmOffer { host, pid, socket, token })
    }
}

/// A listener on a fresh abstract socket, and its name.
pub(crate) fn listen() -> io::Result<(UnixListener, String)> {
    let name = format!("nexar-shm-{}", hex::encode(rand::random::<[u8; 12]>()));
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    Ok((listener, name))
}

/// Checks that the process at the other end of `sock` is this user's and has `pid`.
pub(crate) fn check_peer(sock: &UnixStream, pid: u32, peer: usize) -> io::Result<()> {
    let cred = rustix::net::sockopt::socket_peercred(sock)?;
    let me = rustix::process::getuid();
    if cred.uid != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("rank {peer}'s socket belongs to uid {}, not this rank's {}", cred.uid.as_raw(), me.as_raw()),
        ));
    }
    if cred.pid.as_raw_nonzero().get() as u32 != pid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the process at rank {peer}'s socket is pid {}, not the {pid} rank {peer} announced",
                cred.pid.as_raw_nonzero()
            ),
        ));
    }
    Ok(())
}

/// Dials `socket` as world rank `world`, proving the link with `token`.
pub(crate) fn dial(socket: &str, token: &[u8; TOKEN_LEN], world: u32, limit: Duration) -> io::Result<UnixStream> {
    let mut sock = UnixStream::connect_addr(&SocketAddr::from_abstract_name(socket.as_bytes())?)?;
    sock.set_read_timeout(Some(limit))?;
    sock.set_write_timeout(Some(limit))?;
    let mut hello = [0u8; TOKEN_LEN + 4];
    hello[..TOKEN_LEN].copy_from_slice(token);
    hello[TOKEN_LEN..].copy_from_slice(&world.to_le_bytes());
    sock.write_all(&hello)?;
    Ok(sock)
}

/// Reads a dialler's hello: the token it presents and the world rank it claims.
pub(crate) fn read_hello(sock: &mut UnixStream, limit: Duration) -> io::Result<([u8; TOKEN_LEN], u32)> {
    sock.set_read_timeout(Some(limit))?;
    sock.set_write_timeout(Some(limit))?;
    let mut hello = [0u8; TOKEN_LEN + 4];
    sock.read_exact(&mut hello)?;
    let mut token = [0u8; TOKEN_LEN];
    token.copy_from_slice(&hello[..TOKEN_LEN]);
    let world =
        u32::from_le_bytes([hello[TOKEN_LEN], hello[TOKEN_LEN + 1], hello[TOKEN_LEN + 2], hello[TOKEN_LEN + 3]]);
    Ok((token, world))
}

/// Passes this side's ring segment (its capacity, then its descriptor).
pub(crate) fn send_ring(sock: &UnixStream, ring: &SharedMap, capacity: usize) -> io::Result<()> {
    let fds = [ring.fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for a descriptor in the control message"));
    }
    let bytes = (capacity as u64).to_le_bytes();
    let sent = rustix::net::sendmsg(sock, &[IoSlice::new(&bytes)], &mut control, SendFlags::NOSIGNAL)?;
    if sent != bytes.len() {
        return Err(io::Error::other(format!("sent {sent} of the ring message's {} bytes", bytes.len())));
    }
    Ok(())
}

/// Receives the peer's ring segment and maps it, after checking its capacity (a power of two
/// up to 256 MiB), its size and its seals.
pub(crate) fn recv_ring(sock: &UnixStream, peer: usize) -> io::Result<(SharedMap, usize)> {
    let mut bytes = [0u8; 8];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(sock, &mut [IoSliceMut::new(&mut bytes)], &mut control, RecvFlags::CMSG_CLOEXEC)?;
    let mut fd: Option<OwnedFd> = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            // Any further descriptor is closed as it drops.
            for received in fds {
                fd.get_or_insert(received);
            }
        }
    }
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, format!("rank {peer}: {what}"));
    if got.bytes != bytes.len() {
        return Err(invalid(format!("a {}-byte ring message, expected {}", got.bytes, bytes.len())));
    }
    let fd = fd.ok_or_else(|| invalid("the ring message carried no descriptor".into()))?;
    let capacity = u64::from_le_bytes(bytes);
    if !capacity.is_power_of_two() || !(4096..=MAX_RING).contains(&capacity) {
        return Err(invalid(format!("a {capacity}-byte ring (a power of two from 4 KiB to 256 MiB expected)")));
    }
    let capacity = capacity as usize;
    Ok((SharedMap::open(fd, segment_len(capacity)).map_err(|e| invalid(e.to_string()))?, capacity))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn offers_round_trip_and_bad_ones_say_why() {
        let offer =
            ShmOffer { host: "machine:a boot:b".into(), pid: 42, socket: "nexar-shm-x".into(), token: [7; TOKEN_LEN] };
        assert_eq!(ShmOffer::decode(&offer.encode()), Ok(offer.clone()));
        assert!(ShmOffer::decode(&[MAGIC]).unwrap_err().contains("too short"));
        assert!(ShmOffer::decode(&[MAGIC, 9, 2]).unwrap_err().contains("version 9"));
        assert!(ShmOffer::decode(&[MAGIC, VERSION, 200, 0, b'x']).unwrap_err().contains("200-byte text"));
        let mut long = offer.encode();
        long.push(0);
        assert!(ShmOffer::decode(&long).unwrap_err().contains("token has 17 bytes"));
    }

    #[test]
    fn a_ring_passes_over_the_socket_and_credentials_are_checked() {
        let (listener, name) = listen().unwrap();
        let token = [3u8; TOKEN_LEN];
        let dialler = std::thread::spawn(move || dial(&name, &token, 5, Duration::from_secs(10)).unwrap());
        let (mut accepted, _) = listener.accept().unwrap();
        let dialled = dialler.join().unwrap();
        assert_eq!(read_hello(&mut accepted, Duration::from_secs(10)).unwrap(), (token, 5));
        check_peer(&accepted, std::process::id(), 1).unwrap();
        let err = check_peer(&accepted, std::process::id() + 1, 1).unwrap_err();
        assert!(err.to_string().contains("not the"), "{err}");
        let ring = SharedMap::create("t", segment_len(4096)).unwrap();
        send_ring(&dialled, &ring, 4096).unwrap();
        let (theirs, capacity) = recv_ring(&accepted, 1).unwrap();
        assert_eq!(capacity, 4096);
        assert!(ring.copy_in(4096, b"seen"));
        let mut got = [0u8; 4];
        assert!(theirs.copy_out(4096, &mut got));
        assert_eq!(&got, b"seen");
        // A capacity that is not a power of two is refused.
        send_ring(&dialled, &ring, 5000).unwrap();
        assert!(recv_ring(&accepted, 1).unwrap_err().to_string().contains("5000-byte ring"));
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = ShmOffer::decode(&bytes);
        }
    }
}
