//! One driver for bringing a transport back end up on the links of a communicator, for every
//! back end (shared memory, the TCP lane, `nexar-rdma`): two rounds of setup messages per link
//! in a tag space of its own, with deadlines counted from one start so both ends of a link
//! give up at about the same time.
//!
//! Round one: each rank sends each peer an offer (the back end's bytes: where to connect, a
//! token, a queue pair) or a refusal with its reason. Where both offered, the back end connects
//! the link ([`LinkSetup::connect`]). Round two: each side says whether its half came up,
//! naming the offers it answers (a nonce each), and only a link where both did is started
//! ([`LinkSetup::start`]). Anything else leaves that link as it was, with a reason. Each peer's
//! exchange runs on its own, so one slow peer delays nobody else.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::client::NexarClient;

/// What a back end's [`LinkSetup::connect`] returns.
pub type Connecting<C> = Pin<Box<dyn Future<Output = Result<C, String>> + Send>>;

/// One back end's part in [`negotiate`]: how it connects a link once both ranks offered, and
/// how it starts a link that both sides connected.
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::{Duration, Instant};
/// use nexar::backend::{Connecting, LinkSetup, negotiate, setup_tags};
///
/// /// A back end whose links "connect" when both ranks offer the same fabric name.
/// struct Fabric;
///
/// impl LinkSetup for Fabric {
///     type Connected = ();
///     fn name(&self) -> &'static str {
///         "my-fabric"
///     }
///     fn connect(self: Arc<Self>, peer: usize, ours: Vec<u8>, theirs: Vec<u8>, _by: Instant) -> Connecting<()> {
///         Box::pin(async move {
///             if ours == theirs { Ok(()) } else { Err(format!("rank {peer} offers another fabric")) }
///         })
///     }
///     fn start(&self, _peer: usize, _link: ()) -> Result<(), String> {
///         Ok(()) // here: comm.attach_bulk(peer, channel)
///     }
/// }
///
/// # async fn run(comm: nexar::NexarClient) {
/// let tags = setup_tags("my-fabric", comm.comm_id(), comm.next_setup_number());
/// let offers = (0..comm.world_size()).filter(|p| *p != comm.rank()).map(|p| (p, Ok(b"v1".to_vec()))).collect();
/// for (peer, outcome) in negotiate(&comm, Arc::new(Fabric), tags, offers, Duration::from_secs(10)).await {
///     println!("rank {peer}: {outcome:?}");
/// }
/// # }
/// ```
pub trait LinkSetup: Send + Sync + 'static {
    /// One link connected on this side and not yet carrying anything (dropped, it closes).
    type Connected: Send + 'static;

    /// The back end's name, in reasons and logs.
    fn name(&self) -> &'static str;

    /// Connects the link to `peer` (a rank of the communicator) from this rank's offer and the
    /// peer's, both as the back end encoded them; the peer's bytes are untrusted. Must be done
    /// by `deadline` (the driver stops waiting then).
    fn connect(
        self: Arc<Self>,
        peer: usize,
        ours: Vec<u8>,
        theirs: Vec<u8>,
        deadline: Instant,
    ) -> Connecting<Self::Connected>;

    /// Starts a link that both sides connected, and attaches it
    /// ([`NexarClient::attach_bulk`]).
    fn start(&self, peer: usize, link: Self::Connected) -> Result<(), String>;
}

/// Why [`negotiate`] left a link as it was.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotAttached {
    /// This rank made the peer no offer, for this reason.
    #[error("declined here: {0}")]
    DeclinedHere(String),
    /// The peer made this rank no offer, for this reason.
    #[error("{0}")]
    DeclinedThere(String),
    /// Both offered, but the link did not come up on both sides.
    #[error("{0}")]
    Failed(String),
}

/// The setup tags of the two rounds of exchange number `attempt` (see
/// [`NexarClient::next_setup_number`]) of the back end `backend` on the communicator `comm`:
/// every back end, communicator and attempt has its own, so messages an abandoned exchange
/// left unread never meet a later one.
///
/// ```
/// use nexar::backend::setup_tags;
/// let (offers, outcomes) = setup_tags("rdma", 7, 0);
/// assert_ne!(offers, outcomes);
/// assert_ne!(setup_tags("rdma", 7, 0), setup_tags("rdma", 7, 1));
/// assert_ne!(setup_tags("rdma", 7, 0), setup_tags("shm", 7, 0));
/// ```
pub fn setup_tags(backend: &str, comm: u64, attempt: u64) -> (u64, u64) {
    let mut h = 0x6e65_676f_7469_6174u64; // "negotiat"
    for byte in backend.bytes() {
        h = (h ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    for word in [comm, attempt] {
        h = (h ^ word).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    // Never the all-ones tag nexar reserves; the lowest bit tells the rounds apart.
    let base = h & !(1 << 63) & !1;
    (base, base | 1)
}

/// Brings `setup`'s back end up with every peer in `offers` (`Ok(bytes)`: this rank's offer to
/// that peer; `Err(reason)`: none). Every rank of the communicator calls it at the same point,
/// with the same `tags` (like a collective). Returns each peer's outcome, in rank order. Round
/// one is heard by `limit` after the start, connections by twice that, round two by three times.
pub async fn negotiate<S: LinkSetup>(
    comm: &NexarClient,
    setup: Arc<S>,
    tags: (u64, u64),
    offers: Vec<(usize, Result<Vec<u8>, String>)>,
    limit: Duration,
) -> Vec<(usize, Result<(), NotAttached>)> {
    let start = Instant::now();
    let mut outcomes = Vec::new();
    let mut exchanges = tokio::task::JoinSet::new();
    for (peer, offer) in offers {
        let (message, offered) = match offer {
            Ok(body) => {
                let nonce = rand::random::<u64>();
                (Envelope::Offer { nonce, body: body.clone() }, Ok((nonce, body)))
            }
            Err(reason) => (Envelope::Decline { reason: reason.clone() }, Err(reason)),
        };
        let sent = comm.send_setup(peer, tags.0, message.encode()).await;
        match (sent, offered) {
            (Err(e), _) => outcomes.push((peer, Err(NotAttached::Failed(format!("telling rank {peer}: {e}"))))),
            (Ok(()), Err(reason)) => outcomes.push((peer, Err(NotAttached::DeclinedHere(reason)))),
            (Ok(()), Ok((nonce, body))) => {
                let exchange = Exchange { comm: comm.clone(), setup: setup.clone(), tags, peer, start, limit };
                exchanges.spawn(async move { (peer, exchange.run(nonce, body).await) });
            }
        }
    }
    while let Some(done) = exchanges.join_next().await {
        match done {
            Ok(outcome) => outcomes.push(outcome),
            Err(e) => tracing::warn!(rank = comm.rank(), backend = setup.name(), error = %e, "a link setup failed"),
        }
    }
    outcomes.sort_by_key(|(peer, _)| *peer);
    outcomes
}

/// One peer's exchange, after this rank's offer went out.
struct Exchange<S> {
    comm: NexarClient,
    setup: Arc<S>,
    tags: (u64, u64),
    peer: usize,
    start: Instant,
    limit: Duration,
}

impl<S: LinkSetup> Exchange<S> {
    async fn run(self, nonce: u64, ours: Vec<u8>) -> Result<(), NotAttached> {
        let (peer, failed) = (self.peer, NotAttached::Failed);
        let connected = match self.hear(self.tags.0, 1).await {
            Ok(Envelope::Offer { nonce: theirs, body }) => {
                let by = self.start + 2 * self.limit;
                let connecting = self.setup.clone().connect(peer, ours, body, by);
                match tokio::time::timeout_at(by.into(), connecting).await {
                    Ok(connected) => connected.map(|link| (link, theirs)),
                    Err(_) => Err(format!("the {} link to rank {peer} did not connect in time", self.setup.name())),
                }
            }
            Ok(Envelope::Decline { reason }) => {
                return Err(NotAttached::DeclinedThere(format!("rank {peer} declined: {reason}")));
            }
            Ok(other) => Err(format!("rank {peer} answered round one with {}", other.kind())),
            Err(e) => Err(e),
        };
        let said = match &connected {
            Ok((_, theirs)) => Envelope::Ready { mine: nonce, seen: *theirs },
            Err(reason) => Envelope::Failed { reason: reason.clone() },
        };
        let told = self.comm.send_setup(peer, self.tags.1, said.encode()).await;
        let (link, theirs) = connected.map_err(failed)?;
        told.map_err(|e| failed(format!("telling rank {peer}: {e}")))?;
        match self.hear(self.tags.1, 3).await {
            Ok(Envelope::Ready { mine, seen }) if mine == theirs && seen == nonce => {
                self.setup.start(peer, link).map_err(failed)
            }
            Ok(Envelope::Ready { .. }) => Err(failed(format!("rank {peer}'s outcome answers other offers"))),
            Ok(Envelope::Failed { reason }) => Err(failed(format!("rank {peer}: {reason}"))),
            Ok(other) => Err(failed(format!("rank {peer} answered round two with {}", other.kind()))),
            Err(e) => Err(failed(e)),
        }
    }

    /// The peer's next message with `tag`, by `limits` times the limit after the start.
    async fn hear(&self, tag: u64, limits: u32) -> Result<Envelope, String> {
        let (peer, name) = (self.peer, self.setup.name());
        let deadline = self.start + limits * self.limit;
        match tokio::time::timeout_at(deadline.into(), self.comm.recv_setup(peer, tag)).await {
            Ok(Ok(bytes)) => Envelope::decode(&bytes).map_err(|e| format!("rank {peer}: {name} setup: {e}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("rank {peer} sent no {name} setup in time")),
        }
    }
}

const MAGIC: [u8; 2] = *b"NG";
const VERSION: u8 = 1;
/// Longest reason kept from a peer.
const MAX_REASON: usize = 1024;

/// The driver's messages; the back end's bytes ride inside an offer.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Envelope {
    Offer { nonce: u64, body: Vec<u8> },
    Decline { reason: String },
    Ready { mine: u64, seen: u64 },
    Failed { reason: String },
}

impl Envelope {
    fn kind(&self) -> &'static str {
        match self {
            Envelope::Offer { .. } => "an offer",
            Envelope::Decline { .. } => "a refusal",
            Envelope::Ready { .. } => "ready",
            Envelope::Failed { .. } => "failed",
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = vec![MAGIC[0], MAGIC[1], VERSION];
        match self {
            Envelope::Offer { nonce, body } => {
                out.push(0);
                out.extend_from_slice(&nonce.to_le_bytes());
                out.extend_from_slice(body);
            }
            Envelope::Decline { reason } => {
                out.push(1);
                out.extend_from_slice(&reason.as_bytes()[..reason.len().min(MAX_REASON)]);
            }
            Envelope::Ready { mine, seen } => {
                out.push(2);
                out.extend_from_slice(&mine.to_le_bytes());
                out.extend_from_slice(&seen.to_le_bytes());
            }
            Envelope::Failed { reason } => {
                out.push(3);
                out.extend_from_slice(&reason.as_bytes()[..reason.len().min(MAX_REASON)]);
            }
        }
        out
    }

    /// A message from untrusted bytes, or what is wrong with them.
    fn decode(bytes: &[u8]) -> Result<Envelope, String> {
        let [m0, m1, version, kind, rest @ ..] = bytes else {
            return Err(format!("a message of {} bytes is too short", bytes.len()));
        };
        if [*m0, *m1] != MAGIC || *version != VERSION {
            return Err(format!(
                "a message with magic {m0:#04x}{m1:02x} version {version}, expected {:#04x}{:02x} version {VERSION}",
                MAGIC[0], MAGIC[1]
            ));
        }
        let reason = || String::from_utf8_lossy(&rest[..rest.len().min(MAX_REASON)]).into_owned();
        let word = |at: usize| rest.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        match kind {
            0 => match word(0) {
                Some(nonce) => Ok(Envelope::Offer { nonce, body: rest[8..].to_vec() }),
                None => Err(format!("an offer of {} bytes has no nonce", rest.len())),
            },
            1 => Ok(Envelope::Decline { reason: reason() }),
            2 => match (word(0), word(8), rest.len()) {
                (Some(mine), Some(seen), 16) => Ok(Envelope::Ready { mine, seen }),
                _ => Err(format!("a ready message of {} bytes, expected 16", rest.len())),
            },
            3 => Ok(Envelope::Failed { reason: reason() }),
            other => Err(format!("unknown message kind {other}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_round_trip_and_bad_ones_say_why() {
        for msg in [
            Envelope::Offer { nonce: 7, body: vec![1, 2, 3] },
            Envelope::Offer { nonce: 8, body: vec![] },
            Envelope::Decline { reason: "no device".into() },
            Envelope::Ready { mine: 1, seen: u64::MAX },
            Envelope::Failed { reason: "refused".into() },
        ] {
            assert_eq!(Envelope::decode(&msg.encode()), Ok(msg));
        }
        assert!(Envelope::decode(b"NG").unwrap_err().contains("too short"));
        assert!(Envelope::decode(b"not an offer").unwrap_err().contains("magic"));
        assert!(Envelope::decode(&[b'N', b'G', 9, 2]).unwrap_err().contains("version 9"));
        assert!(Envelope::decode(&[b'N', b'G', VERSION, 0, 1]).unwrap_err().contains("no nonce"));
        assert!(Envelope::decode(&[b'N', b'G', VERSION, 2, 1, 2]).unwrap_err().contains("expected 16"));
        assert!(Envelope::decode(&[b'N', b'G', VERSION, 9]).unwrap_err().contains("kind 9"));
        // A long reason is cut, on both sides.
        let long = Envelope::Failed { reason: "x".repeat(5000) };
        assert!(
            matches!(Envelope::decode(&long.encode()), Ok(Envelope::Failed { reason }) if reason.len() == MAX_REASON)
        );
    }

    #[test]
    fn tags_differ_by_backend_communicator_attempt_and_round_and_never_take_the_reserved_one() {
        let mut seen = std::collections::HashSet::new();
        for backend in ["shm", "tcp-lane", "rdma"] {
            for comm in 0..4 {
                for attempt in 0..4 {
                    let (a, b) = setup_tags(backend, comm, attempt);
                    assert!(seen.insert(a) && seen.insert(b));
                    assert_ne!(a, u64::MAX);
                }
            }
        }
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Envelope::decode(&bytes);
        }
    }
}
