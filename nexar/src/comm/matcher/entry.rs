//! What the mailbox holds: a received message (`Held`) under the key a receive matches it by
//! (`Key`), made from what a lane delivers.

use nexar_types::DType;

use super::key_of;
use crate::proto::message::{CollHeader, PeerMsg};
use crate::transport::framed::Payload;
use crate::transport::link::Incoming;

/// Which messages a `recv` matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub comm: u64,
    pub src: u32,
    pub tag: u64,
    /// The segment of a collective (0 for point-to-point messages and unsplit collectives).
    pub part: u32,
}

/// A received, not yet consumed, message.
#[derive(Debug)]
pub(crate) struct Held {
    pub dtype: DType,
    /// Elements in the payload.
    pub count: u64,
    pub payload: Payload,
    /// For collective messages: what the sender called.
    pub check: Option<CollHeader>,
    /// For the first segment of a point-to-point message sent in segments: how the rest
    /// follow (`count` is then the whole message's, the payload its first segments').
    pub segments: Option<Segments>,
}

/// How the rest of a point-to-point message sent in segments follows its first segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segments {
    /// The sender's id for the message: the key of its later segments.
    pub id: u64,
    /// Elements in every segment but the last.
    pub each: u64,
    /// The first segment not in the payload.
    pub next: u32,
}

/// Turns a lane message into a mailbox entry (`None` for messages this mailbox ignores).
pub(super) fn p2p_entry(incoming: Incoming) -> Option<(Key, Held)> {
    let key = key_of(&incoming.msg, incoming.from)?;
    let (dtype, count, segments) = match incoming.msg {
        PeerMsg::P2p { dtype, count, .. } => (dtype, count, None),
        PeerMsg::P2pSegment { dtype, total, count, id, index: 0, .. } => {
            (dtype, total, Some(Segments { id, each: count, next: 1 }))
        }
        PeerMsg::P2pSegment { dtype, count, .. } => (dtype, count, None),
        _ => return None,
    };
    let dtype = DType::from_wire(dtype).ok()?;
    Some((key, Held { dtype, count, payload: incoming.payload, check: None, segments }))
}

/// Turns a collective message into a mailbox entry keyed by `(comm, src, seq)`.
pub(super) fn coll_entry(incoming: Incoming) -> Option<(Key, Held)> {
    let PeerMsg::Coll { comm, seq, header, part, len } = incoming.msg else {
        return None;
    };
    let dtype = DType::from_wire(header.dtype).ok()?;
    Some((
        Key { comm, src: incoming.from, tag: seq, part },
        Held { dtype, count: len, payload: incoming.payload, check: Some(header), segments: None },
    ))
}
