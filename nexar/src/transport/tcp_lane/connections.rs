//! The connections of a TCP lane's link once their handshakes are done, and how they are
//! taken apart into the sealer, the opener and the sockets the lane runs on.

use std::io;
use std::net::TcpStream;
use std::sync::Arc;

use rustls::{ClientConnection, ServerConnection, StreamOwned};

use super::records::{Direction, Opener, Sealer, Session};

/// The connections of a link, their handshakes done. A link whose ranks both do all the
/// lane's I/O on their runtimes has one connection for both ways, each way under keys of its own:
/// the rank with the lower world rank dials (TLS client), the other answers (TLS server).
/// (Two one-way connections make every received message cost a pure acknowledgement through
/// the loopback path on the receiver's time; on one connection acknowledgements ride on the
/// replies: a 48-byte exchange 4.7 against 3.2 µs here, `bench/tcp_exchange_probe.c`.)
/// Otherwise it has one connection per direction: a reading and a writing thread on one
/// socket would take turns at its lock, and a 16 MiB allreduce ran ~7 % slower so.
pub(crate) enum Connected {
    /// One connection, which this rank dialled.
    Dialled(StreamOwned<ClientConnection, TcpStream>),
    /// One connection, which the peer dialled.
    Answered(StreamOwned<ServerConnection, TcpStream>),
    /// This rank's connection to the peer (it writes there) and the peer's to it (it reads).
    Pair(Box<Pair>),
}

/// The two connections of a link with one per direction.
pub(crate) struct Pair {
    pub outgoing: StreamOwned<ClientConnection, TcpStream>,
    pub incoming: StreamOwned<ServerConnection, TcpStream>,
}

/// A link's connections taken apart: how records are protected each way, and the sockets.
pub(super) struct Parts {
    pub sealer: Sealer,
    pub opener: Opener,
    /// Where records are written.
    pub out: TcpStream,
    /// Where the peer's records are read, where that is another connection.
    pub incoming: Option<TcpStream>,
}

impl Connected {
    /// Sets the congestion control of the link's connections (see [`super::congestion`]) and
    /// returns the algorithm they run (that of the connection this rank writes to).
    pub(crate) fn set_congestion(&self, want: &crate::config::LaneCongestion) -> String {
        match self {
            Connected::Dialled(stream) => super::congestion::apply(&stream.sock, want),
            Connected::Answered(stream) => super::congestion::apply(&stream.sock, want),
            Connected::Pair(pair) => {
                super::congestion::apply(&pair.incoming.sock, want);
                super::congestion::apply(&pair.outgoing.sock, want)
            }
        }
    }

    /// The sealer and opener (encrypting with `encrypt`, if given) and the sockets.
    pub(super) fn into_parts(self, encrypt: Option<super::cipher::LaneAead>) -> io::Result<Parts> {
        let one = |session: Session, sock: TcpStream, outgoing: Direction| {
            let sealer = Sealer::new(&session, outgoing, encrypt)?;
            let opener = Opener::new(&session, outgoing.reverse(), encrypt)?;
            Ok::<_, io::Error>(Parts { sealer, opener, out: sock, incoming: None })
        };
        match self {
            Connected::Dialled(stream) => {
                let (session, sock) = stream.into_parts();
                one(Arc::new(session), sock, Direction::FromDialler)
            }
            Connected::Answered(stream) => {
                let (session, sock) = stream.into_parts();
                one(Arc::new(session), sock, Direction::FromAnswerer)
            }
            Connected::Pair(pair) => {
                let Pair { outgoing, incoming } = *pair;
                let (out_session, out) = outgoing.into_parts();
                let (in_session, incoming) = incoming.into_parts();
                // On each connection, records travel from its dialler.
                let (out_session, in_session): (Session, Session) = (Arc::new(out_session), Arc::new(in_session));
                Ok(Parts {
                    sealer: Sealer::new(&out_session, Direction::FromDialler, encrypt)?,
                    opener: Opener::new(&in_session, Direction::FromDialler, encrypt)?,
                    out,
                    incoming: Some(incoming),
                })
            }
        }
    }
}
