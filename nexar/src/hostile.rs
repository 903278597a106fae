//! A hostile member, for tests only (crate feature `hostile-member`): a rank that joined with
//! valid credentials and then sends on its links what an honest rank never would: relay
//! envelopes that name another sender, answers to calls made to another rank, `Suspect`
//! reports, connections cut as "declared dead", raw frames and streams on its QUIC connection,
//! crafted groups on its TCP lane.
//!
//! It exists so that the tests of what a member of the cluster cannot do (see the README's
//! threat model) run from outside the crate, against the public surface an attacker with a
//! copy of nexar also has. Nothing here is needed to use nexar; nothing here bypasses the
//! receiving side's checks, which are what the tests exercise.
//!
//! ```
//! # async fn run() -> Result<(), nexar::NexarError> {
//! use nexar::NexarClient;
//! use nexar::hostile::HostileMember;
//! use nexar::proto::message::PeerMsg;
//!
//! let ranks = NexarClient::bootstrap_local(3).await?;
//! // Rank 2 tells rank 0 that rank 1 is dead; rank 0 checks rank 1 for itself.
//! let member = HostileMember::new(&ranks[2]);
//! let link = member.link(0).expect("rank 2 links to rank 0");
//! link.send(&PeerMsg::Suspect { rank: 1, reason: "a lie".into() }, None).await?;
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::comm::NexarClient;
use crate::comm::matcher::{Key, Refusal};
use crate::comm::membership::route::Route;
use crate::proto::frame::FrameError;
use crate::proto::message::PeerMsg;
use crate::transport::TransportError;
use crate::transport::bulk::BulkChannel;
use crate::transport::link::{Lane, PeerLink};
use crate::transport::relay_seal::SealError;

pub use crate::transport::bulk::LaneTamper;

/// Whose relay keys seal an envelope [`HostileMember::relay`] sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelaySealing {
    /// Not sealed at all.
    Unsealed,
    /// Sealed with the member's own keys, as if it were the sender it names.
    OwnKeys,
}

/// Why a hostile member could not craft what it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum HostileError {
    /// The member has no direct link to that rank.
    #[error("rank {rank} has no direct link to rank {peer}")]
    NoLink {
        /// The member.
        rank: usize,
        /// The rank it has no link to.
        peer: usize,
    },
    /// The cluster has no relay keys (it was started with `connect_static`).
    #[error("rank {rank} has no relay keys")]
    NoRelayKeys {
        /// The member.
        rank: usize,
    },
    /// The message could not be packed or sealed.
    #[error("rank {rank}: {what}")]
    Craft {
        /// The member.
        rank: usize,
        /// What went wrong.
        what: String,
    },
    /// Sending failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl From<(usize, FrameError)> for HostileError {
    fn from((rank, e): (usize, FrameError)) -> Self {
        HostileError::Craft { rank, what: e.to_string() }
    }
}

impl From<(usize, SealError)> for HostileError {
    fn from((rank, e): (usize, SealError)) -> Self {
        HostileError::Craft { rank, what: e.to_string() }
    }
}

/// A rank of a running cluster, used to send crafted messages on its links (see the module
/// docs). It keeps its client alive.
///
/// ```
/// # async fn run(ranks: Vec<nexar::NexarClient>) {
/// let member = nexar::hostile::HostileMember::new(&ranks[1]);
/// let quic = member.link(0).expect("a direct link").connection().clone();
/// let stream = quic.open_uni().await; // write any frames on it
/// # }
/// ```
pub struct HostileMember {
    client: NexarClient,
}

impl std::fmt::Debug for HostileMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostileMember").field("rank", &self.client.rank()).finish()
    }
}

impl HostileMember {
    /// World rank `client.rank()` turned hostile.
    ///
    /// ```
    /// # fn run(client: &nexar::NexarClient) {
    /// let member = nexar::hostile::HostileMember::new(client);
    /// # }
    /// ```
    pub fn new(client: &NexarClient) -> Self {
        HostileMember { client: client.clone() }
    }

    /// The member's world rank.
    ///
    /// ```
    /// # fn run(member: &nexar::hostile::HostileMember) {
    /// println!("rank {}", member.rank());
    /// # }
    /// ```
    pub fn rank(&self) -> usize {
        self.client.rank()
    }

    /// The member's direct link to world rank `peer`: send any [`PeerMsg`] on it
    /// ([`PeerLink::send`]), cut it with any code ([`PeerLink::close`]), or take its QUIC
    /// connection ([`PeerLink::connection`]) to open streams and write raw frames.
    ///
    /// ```
    /// # fn run(member: &nexar::hostile::HostileMember) {
    /// assert!(member.link(member.rank()).is_none(), "no link to itself");
    /// # }
    /// ```
    pub fn link(&self, peer: usize) -> Option<&PeerLink> {
        self.client.inner.links.get(peer)
    }

    fn link_or_err(&self, peer: usize) -> Result<&PeerLink, HostileError> {
        self.link(peer).ok_or(HostileError::NoLink { rank: self.rank(), peer })
    }

    /// Cuts the link to `peer` with the code a rank uses when it has declared the peer dead.
    ///
    /// ```
    /// # fn run(member: &nexar::hostile::HostileMember) {
    /// member.declare_dead(0, "rank 0 is silent (a lie)").unwrap();
    /// # }
    /// ```
    pub fn declare_dead(&self, peer: usize, reason: &str) -> Result<(), HostileError> {
        self.link_or_err(peer)?.close(crate::proto::close::CloseCode::DeclaredDead, reason);
        Ok(())
    }

    /// Sends `msg` (with `payload`) to world rank `dst` in a relay envelope through the
    /// member's link to `via`, naming `src` as its sender: a relay that lies about whom it
    /// relays for.
    ///
    /// ```
    /// # async fn run(member: &nexar::hostile::HostileMember, msg: nexar::proto::message::PeerMsg) {
    /// use nexar::hostile::RelaySealing;
    /// member.relay(0, 1, 0, &msg, None, RelaySealing::OwnKeys).await.unwrap();
    /// # }
    /// ```
    pub async fn relay(
        &self,
        via: usize,
        src: u32,
        dst: u32,
        msg: &PeerMsg,
        payload: Option<Bytes>,
        sealing: RelaySealing,
    ) -> Result<(), HostileError> {
        let via = self.link_or_err(via)?;
        let seals = match sealing {
            RelaySealing::Unsealed => None,
            RelaySealing::OwnKeys => {
                Some(self.client.inner.relay_seals.as_deref().ok_or(HostileError::NoRelayKeys { rank: self.rank() })?)
            }
        };
        Route::Relay { via, src, dst, seals }.send(msg, payload).await?;
        Ok(())
    }

    /// The relay envelope this rank would send to world rank `dst` for `msg` (and `payload`),
    /// sealed with its keys, as `(envelope, body)`: what a relay on the way sees, and can
    /// replay with [`PeerLink::send_queued_parts`].
    ///
    /// ```
    /// # async fn run(honest: &nexar::hostile::HostileMember, relay: &nexar::hostile::HostileMember, msg: nexar::proto::message::PeerMsg) {
    /// let (envelope, body) = honest.sealed_envelope(0, &msg, None).unwrap();
    /// let to_0 = relay.link(0).unwrap();
    /// to_0.send_queued_parts(&envelope, vec![body.clone()]).await.unwrap();
    /// # }
    /// ```
    pub fn sealed_envelope(
        &self,
        dst: u32,
        msg: &PeerMsg,
        payload: Option<Bytes>,
    ) -> Result<(PeerMsg, Bytes), HostileError> {
        let rank = self.rank();
        let seals = self.client.inner.relay_seals.as_deref().ok_or(HostileError::NoRelayKeys { rank })?;
        let lane = Lane::of(msg) as u8;
        let mut body = crate::proto::relay::pack(msg, payload).map_err(|e| (rank, e))?.concat();
        let seq = seals.seal(dst, lane, &mut body).map_err(|e| (rank, e))?;
        let envelope = PeerMsg::Relay { src: rank as u32, dst, lane, hops: 1, seq, len: body.len() as u64 };
        Ok((envelope, Bytes::from(body)))
    }

    /// The member's TCP lane (or other bulk channel) to world rank `peer`: a group sent on it
    /// with [`BulkChannel::send`] is any frames the member likes.
    ///
    /// ```
    /// # fn run(member: &nexar::hostile::HostileMember) {
    /// if let Some(lane) = member.bulk_channel(0) {
    ///     println!("carried by {}", lane.name());
    /// }
    /// # }
    /// ```
    pub fn bulk_channel(&self, peer: usize) -> Option<Arc<dyn BulkChannel>> {
        self.link(peer)?.bulk_channel()
    }

    /// Alters the next group the member's TCP lane to world rank `peer` sends (whatever sends
    /// it: the member's own collectives, or [`BulkChannel::send`]) as `tamper` says.
    ///
    /// ```
    /// # fn run(member: &nexar::hostile::HostileMember) {
    /// use nexar::hostile::LaneTamper;
    /// member.tamper_next_group(0, LaneTamper { flip_lead_byte: Some(5), ..Default::default() }).unwrap();
    /// # }
    /// ```
    pub fn tamper_next_group(&self, peer: usize, tamper: LaneTamper) -> Result<(), HostileError> {
        let lane = self.bulk_channel(peer).ok_or(HostileError::NoLink { rank: self.rank(), peer })?;
        if lane.tamper_next(tamper) {
            Ok(())
        } else {
            Err(HostileError::Craft {
                rank: self.rank(),
                what: format!("the {} lane cannot be tampered with", lane.name()),
            })
        }
    }
}

/// What an honest rank received, for a test's assertions: the payload of the collective
/// message that world rank `src` sent for collective `seq` of `client`'s communicator (part
/// 0), taken from the rank's collective store as the executor would take it, waiting up to
/// `within`. A message larger than `max_len` is not taken.
///
/// ```
/// # async fn run(rank0: &nexar::NexarClient) {
/// use std::time::Duration;
/// let bytes = nexar::hostile::take_collective_payload(rank0, 1, 1000, 1 << 20, Duration::from_secs(5)).await;
/// # }
/// ```
pub async fn take_collective_payload(
    client: &NexarClient,
    src: u32,
    seq: u64,
    max_len: u64,
    within: Duration,
) -> Result<Vec<u8>, String> {
    let key = Key { comm: client.comm_id(), src, tag: seq, part: 0 };
    let refused = |r: Refusal| format!("{r:?}");
    let held = match client.inner.coll.take_or_wait_for(key, max_len).map_err(refused)? {
        Ok(held) => held,
        Err(pending) => tokio::time::timeout(within, pending.wait())
            .await
            .map_err(|_| format!("nothing from rank {src} for #{seq} within {within:?}"))?
            .map_err(refused)?,
    };
    held.payload.to_vec().map_err(|e| e.to_string())
}
