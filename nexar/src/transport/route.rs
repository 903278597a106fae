//! The way to one peer: its direct link, or an envelope through a neighbour that carries the
//! message (its lane, its payload) sealed end to end for the destination. Which neighbour is
//! the comm layer's choice; this module only sends along the way it is given.

use bytes::Bytes;
use tokio::sync::oneshot;

use super::TransportError;
use super::link::{Lane, PeerLink, SendDone};
use super::relay_seal::RelaySeals;
use crate::proto::message::PeerMsg;
use crate::proto::relay;

/// The way to one peer.
pub(crate) enum Route<'a> {
    /// A direct link.
    Direct(&'a PeerLink),
    /// Through `via`, in an envelope from `src` to `dst`, sealed end to end with `seals` (when
    /// the cluster has relay keys).
    Relay { via: &'a PeerLink, src: u32, dst: u32, seals: Option<&'a RelaySeals> },
}

impl Route<'_> {
    /// Sends `msg` (and its payload), returning once it is handed to QUIC.
    pub async fn send(&self, msg: &PeerMsg, payload: Option<Bytes>) -> Result<(), TransportError> {
        let wait = self.send_queued(msg, payload).await?;
        wait.await.map_err(|_| self.lost("its writer has stopped"))?
    }

    /// Queues `msg` (and its payload) on the first hop; see [`PeerLink::send_queued`].
    pub async fn send_queued(
        &self,
        msg: &PeerMsg,
        payload: Option<Bytes>,
    ) -> Result<oneshot::Receiver<Result<(), TransportError>>, TransportError> {
        match *self {
            Route::Direct(link) => link.send_queued(msg, payload).await,
            Route::Relay { via, src, dst, seals } => {
                let lane = Lane::of(msg) as u8;
                let parts = relay::pack(msg, payload)
                    .map_err(|error| TransportError::Protocol { peer: format!("rank {dst}"), error })?;
                let (seq, parts) = match seals {
                    Some(seals) => seal(seals, dst, lane, &parts)?,
                    None => (0, parts),
                };
                let len = parts.iter().map(|p| p.len() as u64).sum();
                let envelope = PeerMsg::Relay { src, dst, lane, hops: 0, seq, len };
                via.send_queued_parts(&envelope, parts).await
            }
        }
    }

    /// Hands a collective message with a lent payload to the direct link's bulk channel when
    /// it takes it and can read the payload now; `None` when the caller must copy the payload
    /// and queue it (relayed routes, QUIC, channels that cannot).
    pub async fn send_borrowed(&self, msg: &PeerMsg, payload: &[&[u8]]) -> Option<Result<SendDone, TransportError>> {
        match *self {
            Route::Direct(link) => link.send_borrowed(msg, payload).await,
            Route::Relay { .. } => None,
        }
    }

    /// The first hop's link.
    pub fn first_hop(&self) -> &PeerLink {
        match self {
            Route::Direct(link) | Route::Relay { via: link, .. } => link,
        }
    }

    fn lost(&self, reason: &str) -> TransportError {
        let peer = match self {
            Route::Direct(l) => format!("rank {}", l.peer()),
            Route::Relay { dst, via, .. } => format!("rank {dst} (via rank {})", via.peer()),
        };
        TransportError::ConnectionLost { peer, reason: reason.into() }
    }
}

/// Seals a relay body's `parts` for `dst` in one buffer: its sequence number and the sealed body.
fn seal(seals: &RelaySeals, dst: u32, lane: u8, parts: &[Bytes]) -> Result<(u64, Vec<Bytes>), TransportError> {
    let len: usize = parts.iter().map(Bytes::len).sum();
    let mut body = Vec::with_capacity(len + relay::SEAL_TAG_LEN as usize);
    for part in parts {
        body.extend_from_slice(part);
    }
    let seq = seals
        .seal(dst, lane, &mut body)
        .map_err(|e| TransportError::Tls(format!("cannot seal a relayed message for rank {dst}: {e}")))?;
    Ok((seq, vec![Bytes::from(body)]))
}
