//! Relay envelopes that reach this rank: those addressed here are checked (the sender they
//! name could have relayed through this link at all, their seal opens) and unpacked; the
//! others go to the forwarder.

use bytes::Bytes;
use tokio::sync::mpsc;

use super::byte_budget::ByteBudget;
use super::framed::Payload;
use super::incoming::Incoming;
use crate::proto::frame::FrameError;
use crate::proto::lane::Lane;
use crate::proto::message::PeerMsg;

/// Where relayed messages go: those for this rank are unpacked and delivered, the others are
/// handed to the forwarder.
#[derive(Clone)]
pub(crate) struct RelayHook {
    /// This rank.
    pub local: u32,
    /// The forwarders' queues, one per lane, so a lane whose next hop is slow holds up only
    /// the same lane.
    pub forward: [mpsc::Sender<Incoming>; Lane::COUNT],
    /// Largest payload a carried message may have.
    pub max_payload: u64,
    /// By world rank: whether that rank may reach this one through a relay, which is only when
    /// the topology gives the two no direct link. A rank with a direct link never needs one, so
    /// an envelope naming it as the sender is forged.
    pub relayed_sources: std::sync::Arc<[bool]>,
    /// The keys that open relayed bodies end to end; `None` in a cluster without relay keys
    /// (started with `connect_static`), whose relayed messages are protected hop by hop only.
    pub seals: Option<std::sync::Arc<super::relay_seal::RelaySeals>>,
    /// The bytes of relay envelopes the rank holds at once (being read, queued to be forwarded
    /// or written, or being opened); a larger envelope waits until it can go alone.
    pub budget: ByteBudget,
}

/// Bytes of relay envelopes a rank holds at once (see [`RelayHook::budget`]).
pub(crate) const RELAY_BUDGET_BYTES: u64 = 256 << 20;

impl RelayHook {
    /// Opens an envelope addressed to this rank: the carried message, from its original sender,
    /// or `None` (logged) when the envelope is refused or does not open.
    pub(crate) fn open(&self, envelope: Incoming) -> Option<Incoming> {
        let PeerMsg::Relay { src, .. } = envelope.msg else { return None };
        let via = envelope.from;
        if let Some(why) = self.refuse_source(src, via) {
            tracing::warn!(src, via, %why, "refused a relayed message");
            return None;
        }
        unpack(envelope, self)
            .inspect_err(|error| tracing::warn!(src, via, %error, "dropped a malformed relayed message"))
            .ok()
    }

    /// Why an envelope from `via` that claims to carry `src`'s message to this rank is refused.
    fn refuse_source(&self, src: u32, via: u32) -> Option<String> {
        if src == self.local {
            Some(format!("rank {via} relayed a message that claims to come from this rank"))
        } else if src == via {
            Some(format!("rank {via} wrapped its own message in a relay envelope"))
        } else if !self.relayed_sources.get(src as usize).copied().unwrap_or(false) {
            Some(format!(
                "rank {via} relayed a message that claims to come from rank {src}, which never reaches this rank through \
                 a relay (it has a direct link here, or is not in the cluster)"
            ))
        } else {
            None
        }
    }
}

/// Opens a relay envelope addressed to this rank: the carried message, from its original
/// sender, once its seal proves that sender wrote it.
fn unpack(envelope: Incoming, hook: &RelayHook) -> Result<Incoming, FrameError> {
    let PeerMsg::Relay { src, lane, seq, .. } = envelope.msg else {
        return Err(FrameError::InvalidMessage("not a relay envelope".into()));
    };
    let mut body = envelope.payload.to_vec().map_err(|e| FrameError::InvalidMessage(format!("relay envelope: {e}")))?;
    let opened = match (&hook.seals, seq) {
        (Some(seals), _) => seals.open(src, lane, seq, &mut body),
        (None, 0) => Ok(()),
        (None, _) => Err(super::relay_seal::SealError::Unexpected),
    };
    opened.map_err(|e| FrameError::InvalidMessage(format!("relayed message from rank {src}: {e}")))?;
    let (msg, range) = crate::proto::relay::unpack(&body, hook.max_payload)?;
    let payload = Payload::from_bytes(Bytes::from(body).slice(range));
    // The carried message keeps the envelope's share of the relay budget until it is handed on.
    Ok(Incoming { from: src, msg, payload, budget: envelope.budget })
}
