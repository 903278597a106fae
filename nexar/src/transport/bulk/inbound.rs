//! The receiving side of a bulk channel: [`BulkInbound`] checks each group a channel received
//! (the checks of the QUIC path) and delivers its message into the same router.

use std::sync::{Arc, Weak};

use bytes::Bytes;

use super::super::framed::{Landed, LentBytes, Payload};
use super::super::incoming::Incoming;
use super::super::lanes::LaneSenders;
use super::super::tcp_lane::Deferred;
use super::BulkSlot;
use crate::proto::announce::{announced_payload, raw_length_disagrees};
use crate::proto::frame::{FrameError, FrameHeader, FrameKind, HEADER_LEN, MAX_CONTROL_FRAME};
use crate::proto::message::{self, PeerMsg};
use crate::transport::inbox::{Admission, Admitted};

/// Where a bulk transport hands the message groups it received from one peer.
///
/// ```no_run
/// # async fn run(comm: nexar::NexarClient, received: bytes::Bytes) {
/// let inbound = comm.bulk_inbound(1).expect("rank 1 is a peer");
/// if let Err(e) = inbound.deliver(received).await {
///     eprintln!("rank 1 broke the protocol: {e}"); // close the transport
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct BulkInbound {
    peer: u32,
    lanes: LaneSenders,
    max_payload: u64,
    /// Weak: the transport's delivery task must not keep the link's channel alive.
    slot: Weak<BulkSlot>,
}

impl std::fmt::Debug for BulkInbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BulkInbound").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl BulkInbound {
    pub(crate) fn new(peer: u32, lanes: LaneSenders, max_payload: u64, slot: &Arc<BulkSlot>) -> BulkInbound {
        BulkInbound { peer, lanes, max_payload, slot: Arc::downgrade(slot) }
    }

    /// The world rank whose groups this delivers.
    pub fn peer(&self) -> u32 {
        self.peer
    }

    /// Checks one received message group and delivers it like a message read from QUIC.
    /// An error means the peer broke the protocol: the transport should stop using it.
    /// A rank that is shutting down drops the message quietly.
    pub async fn deliver(&self, group: Bytes) -> Result<(), FrameError> {
        self.deliver_sealed(group, &[]).await
    }

    /// Like [`deliver`](Self::deliver), for a TCP lane's group of which the records in
    /// `deferred` are still sealed (they must lie in the payload).
    pub(crate) async fn deliver_sealed(&self, group: Bytes, deferred: &[Deferred]) -> Result<(), FrameError> {
        self.deliver_admitted(group, deferred, None).await
    }

    /// Like [`deliver_sealed`](Self::deliver_sealed), for a group whose payload was read once
    /// [`admit`](Self::admit) let it: the reservation ends as the message is counted as held.
    pub(crate) async fn deliver_admitted(
        &self,
        group: Bytes,
        deferred: &[Deferred],
        admitted: Option<Admitted<'_>>,
    ) -> Result<(), FrameError> {
        let (msg, payload) = decode_group_carrying(&group, deferred, self.max_payload, self.carries())?;
        if let (PeerMsg::Coll { comm, seq, .. }, Some(slot)) = (&msg, self.slot.upgrade()) {
            slot.received((*comm, *seq));
        }
        drop(admitted);
        let _ = self.lanes.deliver(Incoming::new(self.peer, msg, payload)).await;
        Ok(())
    }

    /// Like [`deliver_admitted`](Self::deliver_admitted), for a TCP lane's group whose frames
    /// [`payload_after`](Self::payload_after) checked (finding `msg` and a `payload_len`-byte
    /// payload) and whose payload's first `landed.bytes` bytes it read straight into the
    /// destination of the receive that waits for the message; `rest` is the payload's other
    /// bytes.
    pub(crate) async fn deliver_landed(
        &self,
        msg: PeerMsg,
        payload_len: usize,
        landed: Landed,
        rest: Payload,
        admitted: Option<Admitted<'_>>,
    ) -> Result<(), FrameError> {
        if payload_len != landed.bytes + rest.len() {
            return Err(FrameError::InvalidMessage(format!(
                "a {payload_len}-byte payload delivered with {} bytes",
                landed.bytes + rest.len()
            )));
        }
        if let (PeerMsg::Coll { comm, seq, .. }, Some(slot)) = (&msg, self.slot.upgrade()) {
            slot.received((*comm, *seq));
        }
        drop(admitted);
        let _ = self.lanes.deliver(Incoming::new(self.peer, msg, Payload::from_landed(landed, rest))).await;
        Ok(())
    }

    /// The message of a `group_len`-byte group and where its payload lies, from `frames`,
    /// the group's bytes before its payload, checked as a whole group's are: refused unless
    /// the payload starts right after them and runs to the group's end. A TCP lane checks
    /// this before it reads a payload straight into a receive's buffer, so that a group it
    /// would refuse never writes there.
    pub(crate) fn payload_after(
        &self,
        frames: &[u8],
        group_len: usize,
    ) -> Result<(PeerMsg, std::ops::Range<usize>), FrameError> {
        let (msg, body_end, expected, limit) = payload_message(frames, self.max_payload, self.carries())?;
        let payload = raw_payload(frames, body_end, expected, limit, group_len)?;
        if payload.start != frames.len() {
            return Err(FrameError::InvalidMessage(format!(
                "a payload at bytes {}..{} of a group whose frames end at byte {}",
                payload.start,
                payload.end,
                frames.len()
            )));
        }
        Ok((msg, payload))
    }

    /// The admission of `msg`'s `len`-byte payload if the mailbox gives it at once (as
    /// [`admit`](Self::admit) would without waiting); `None` when it would have to wait.
    pub(crate) fn admit_now(&self, msg: &PeerMsg, len: u64) -> Option<Admitted<'_>> {
        match self.lanes.admission(msg, self.peer, len) {
            None => Some(Admitted::unreserved()),
            Some(Admission::Now(admitted)) => Some(admitted),
            Some(Admission::Wait(_)) => None,
        }
    }

    /// Checks a whole group as [`deliver`](Self::deliver) does and turns it into the message
    /// it carries, without delivering it (see [`deliver_now`](Self::deliver_now)).
    pub(crate) fn open(&self, group: Bytes) -> Result<Incoming, FrameError> {
        let (msg, payload) = decode_group_carrying(&group, &[], self.max_payload, self.carries())?;
        if let (PeerMsg::Coll { comm, seq, .. }, Some(slot)) = (&msg, self.slot.upgrade()) {
            slot.received((*comm, *seq));
        }
        Ok(Incoming::new(self.peer, msg, payload))
    }

    /// Checks a group whose every byte is in `copied`, a private copy [`peek`](Self::peek)
    /// found `msg` in, as [`open`](Self::open) does, and turns it into `msg` with its payload
    /// copied out of `copied`: a small group needs no buffer from the pool, no second read of
    /// its channel and no second decoding of its message. The frames are parsed again (their
    /// lengths are checked against `copied`, so a `msg` from other bytes can only fail).
    pub(crate) fn open_copied(&self, copied: &[u8], msg: PeerMsg) -> Result<Incoming, FrameError> {
        let (header, rest) = frame_header(copied, 0, MAX_CONTROL_FRAME)?;
        header.expect(FrameKind::Message)?;
        let body_end = body_end(rest, header.len, copied.len())?;
        let Some((expected, limit)) = announced_payload(&msg, self.max_payload)? else {
            return Err(FrameError::InvalidMessage("a message without a payload".into()));
        };
        let payload = raw_payload(copied, body_end, expected, limit, copied.len())?;
        let payload = if payload.is_empty() { Bytes::new() } else { Bytes::copy_from_slice(&copied[payload]) };
        if let (PeerMsg::Coll { comm, seq, .. }, Some(slot)) = (&msg, self.slot.upgrade()) {
            slot.received((*comm, *seq));
        }
        Ok(Incoming::new(self.peer, msg, Payload::from_group(&payload, 0..payload.len(), &[])?))
    }

    /// Checks a `len`-byte group as [`open`](Self::open) does, from its first bytes `prefix`,
    /// and turns it into its message with a payload that `lend` lends (given the payload's
    /// range in the group) instead of a copy. `Ok(None)` when `prefix` ends before the
    /// payload starts, or `lend` cannot lend it: the caller reads the group as usual.
    pub(crate) fn open_lent(
        &self,
        prefix: &[u8],
        len: usize,
        lend: impl FnOnce(std::ops::Range<usize>) -> Option<Arc<dyn LentBytes>>,
    ) -> Result<Option<Incoming>, FrameError> {
        if !message_frame_whole(prefix)? {
            return Ok(None);
        }
        let (msg, body_end, expected, limit) = payload_message(prefix, self.max_payload, self.carries())?;
        if prefix.len() < body_end + HEADER_LEN {
            return Ok(None);
        }
        let Some(lent) = lend(raw_payload(prefix, body_end, expected, limit, len)?) else { return Ok(None) };
        if let (PeerMsg::Coll { comm, seq, .. }, Some(slot)) = (&msg, self.slot.upgrade()) {
            slot.received((*comm, *seq));
        }
        Ok(Some(Incoming::new(self.peer, msg, Payload::from_lent(lent))))
    }

    /// Delivers an [`open`](Self::open)ed message if nexar takes it at once; otherwise gives
    /// it back (`Some`), for [`deliver_opened`](Self::deliver_opened).
    pub(crate) fn deliver_now(&self, incoming: Incoming) -> Option<Incoming> {
        self.lanes.deliver_now(incoming)
    }

    /// Whether the receive that waits for `msg` (a message [`peek`](Self::peek) found, so one
    /// the channel may carry) may take it straight off the channel (see
    /// [`BulkChannel::deliver_ready`]): where its lane goes straight into the rank's store,
    /// the one that receive would otherwise take it from.
    ///
    /// [`BulkChannel::deliver_ready`]: super::BulkChannel::deliver_ready
    pub(crate) fn hands_over(&self, msg: &PeerMsg) -> bool {
        self.lanes.delivers_directly(msg)
    }

    /// Hands an opened message to the receive that waits for it instead of delivering it:
    /// a sign of life from the peer, as a delivery is.
    pub(crate) fn hand_over(&self, incoming: Incoming) -> Incoming {
        self.lanes.heard(self.peer);
        incoming
    }

    /// Delivers an [`open`](Self::open)ed message, waiting as long as delivery takes.
    pub(crate) async fn deliver_opened(&self, incoming: Incoming) {
        let _ = self.lanes.deliver(incoming).await;
    }

    /// The messages this peer's channel may carry: collective ones, and point-to-point ones
    /// where the channel takes those ([`BulkChannel::carries_point_to_point`]).
    ///
    /// [`BulkChannel::carries_point_to_point`]: super::BulkChannel::carries_point_to_point
    fn carries(&self) -> Carries {
        match self.slot.upgrade() {
            Some(slot) if slot.carries_point_to_point() => Carries::AlsoPointToPoint,
            _ => Carries::Collectives,
        }
    }

    /// The message a `group_len`-byte group announces, and its payload's length, from the
    /// group's first bytes (`opened`: authenticated), checked as a whole group is; `Ok(None)`
    /// while they end inside the message frame. A group whose length leaves its payload no
    /// room, or more than [`FRAMES_MAX`] besides it, is refused here, before the mailbox
    /// admits the payload and before the rest of the group is read: what a peer makes this
    /// rank hold for a group is what the mailbox admitted, not a length it announced.
    pub(crate) fn peek(&self, opened: &[u8], group_len: usize) -> Result<Option<(PeerMsg, u64)>, FrameError> {
        if !message_frame_whole(opened)? {
            return Ok(None);
        }
        let (msg, _, payload_len, _) = payload_message(opened, self.max_payload, self.carries())?;
        let frames = (group_len as u64).checked_sub(payload_len);
        if frames.is_none_or(|frames| frames > FRAMES_MAX) {
            return Err(FrameError::InvalidMessage(format!(
                "a {group_len}-byte group announces a {payload_len}-byte payload"
            )));
        }
        Ok(Some((msg, payload_len)))
    }

    /// Waits until the `len`-byte payload of `msg` may be read off the channel: the rank's
    /// mailbox admits it as it admits a message on a QUIC stream (a receive waits for it, or
    /// its sender has room under the limits), so a peer's groups cost no more memory than
    /// its QUIC messages. Until then the caller reads nothing more, and the transport's flow
    /// control holds the peer. `None` when no mailbox takes `msg`.
    pub(crate) async fn admit(&self, msg: &PeerMsg, len: u64) -> Option<Admitted<'_>> {
        Some(self.lanes.admission(msg, self.peer, len)?.ready().await)
    }
}

/// How much longer than its payload a group may be: its message frame (a header and a body of
/// at most [`MAX_CONTROL_FRAME`]) and the payload's raw frame header.
pub(crate) const FRAMES_MAX: u64 = MAX_CONTROL_FRAME + 2 * HEADER_LEN as u64;

/// Whether `opened` holds a group's whole message frame (its header checked).
fn message_frame_whole(opened: &[u8]) -> Result<bool, FrameError> {
    if opened.len() < HEADER_LEN {
        return Ok(false);
    }
    let (header, rest) = frame_header(opened, 0, MAX_CONTROL_FRAME)?;
    Ok(header.len <= (opened.len() - rest) as u64)
}

/// Which messages a peer's groups may hold on a channel.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Carries {
    /// Collective messages only.
    Collectives,
    /// Collective and typed point-to-point messages.
    AlsoPointToPoint,
}

/// The message at the start of a group's opened bytes (a collective one, or a point-to-point
/// one where the channel `carries` those), where its frame ends, its payload's length and
/// the limit that length was checked against.
fn payload_message(
    opened: &[u8],
    max_payload: u64,
    carries: Carries,
) -> Result<(PeerMsg, usize, u64, u64), FrameError> {
    let (header, rest) = frame_header(opened, 0, MAX_CONTROL_FRAME)?;
    header.expect(FrameKind::Message)?;
    let body_end = body_end(rest, header.len, opened.len())?;
    let msg: PeerMsg = message::decode(&opened[rest..body_end])?;
    let taken = match msg {
        PeerMsg::Coll { .. } => true,
        PeerMsg::P2p { .. } | PeerMsg::P2pSegment { .. } => carries == Carries::AlsoPointToPoint,
        _ => false,
    };
    if !taken {
        let what = match carries {
            Carries::Collectives => "collective payloads only",
            Carries::AlsoPointToPoint => "collective and point-to-point payloads only",
        };
        return Err(FrameError::InvalidMessage(format!(
            "a bulk transport carries {what}, not {:?} messages",
            crate::proto::lane::Lane::of(&msg)
        )));
    }
    let Some((expected, limit)) = announced_payload(&msg, max_payload)? else {
        return Err(FrameError::InvalidMessage("a message without a payload".into()));
    };
    Ok((msg, body_end, expected, limit))
}

/// Splits a message group received by a bulk transport into its message and payload, with
/// the checks of the QUIC path: frame kinds and lengths, a valid collective message, a payload
/// of exactly the announced length within `max_payload`, nothing after it. The payload is a
/// view of `group`, not a copy.
#[cfg(any(test, feature = "unstable-internals"))]
pub fn decode_group(group: &Bytes, max_payload: u64) -> Result<(PeerMsg, Payload), FrameError> {
    decode_sealed_group(group, &[], max_payload)
}

/// [`decode_group`] for a group whose records in `deferred` are still sealed: those must lie
/// in the payload, whose bytes nobody reads before they are opened.
///
/// Where the payload starts is what the receiver parses here, not the sender's placement hint
/// that decided which records were left sealed: the frames are parsed only from the group's
/// opened (authenticated) prefix, and a frame that reaches into a sealed record is refused
/// before any of its bytes are read.
#[cfg(any(test, feature = "unstable-internals"))]
pub(crate) fn decode_sealed_group(
    group: &Bytes,
    deferred: &[Deferred],
    max_payload: u64,
) -> Result<(PeerMsg, Payload), FrameError> {
    decode_group_carrying(group, deferred, max_payload, Carries::Collectives)
}

/// [`decode_sealed_group`] on a channel that `carries` these messages.
pub(crate) fn decode_group_carrying(
    group: &Bytes,
    deferred: &[Deferred],
    max_payload: u64,
    carries: Carries,
) -> Result<(PeerMsg, Payload), FrameError> {
    let opened = &group[..deferred.first().map_or(group.len(), |d| d.at.min(group.len()))];
    let (msg, body_end, expected, limit) = payload_message(opened, max_payload, carries)?;
    let payload = raw_payload(opened, body_end, expected, limit, group.len())?;
    Ok((msg, Payload::from_group(group, payload, deferred)?))
}

/// Where the payload of a `total`-byte group lies: the raw frame whose header follows the
/// message frame (which ends at `body_end`) in the group's first bytes `prefix`, of exactly
/// the `expected` length, with nothing after it.
fn raw_payload(
    prefix: &[u8],
    body_end: usize,
    expected: u64,
    limit: u64,
    total: usize,
) -> Result<std::ops::Range<usize>, FrameError> {
    let (raw, start) = frame_header(prefix, body_end, limit)?;
    raw.expect(FrameKind::Raw)?;
    if raw.len != expected {
        return Err(raw_length_disagrees(expected, raw.len));
    }
    Ok(start..body_end_exact(start, raw.len, total)?)
}

/// The frame header at `at`, checked against `limit`, and where its body starts.
fn frame_header(group: &[u8], at: usize, limit: u64) -> Result<(FrameHeader, usize), FrameError> {
    let bytes: &[u8; HEADER_LEN] = group
        .get(at..at + HEADER_LEN)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| FrameError::InvalidMessage(format!("group ends inside a frame header at byte {at}")))?;
    Ok((FrameHeader::decode(bytes, limit)?, at + HEADER_LEN))
}

/// Where a body of `len` bytes starting at `start` ends, if the group holds all of it.
fn body_end(start: usize, len: u64, total: usize) -> Result<usize, FrameError> {
    usize::try_from(len).ok().and_then(|len| start.checked_add(len)).filter(|end| *end <= total).ok_or_else(|| {
        FrameError::InvalidMessage(format!("a {len}-byte frame body runs past the group's {total} bytes"))
    })
}

/// Like [`body_end`], for the last frame: the group must end exactly there.
fn body_end_exact(start: usize, len: u64, total: usize) -> Result<usize, FrameError> {
    let end = body_end(start, len, total)?;
    if end != total {
        return Err(FrameError::InvalidMessage(format!("{} bytes follow the payload", total - end)));
    }
    Ok(end)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_group_decodes_into_its_message_and_payload() {
        use crate::proto::frame::{message_frame, raw_header};
        use crate::proto::message::{PeerMsg, encode};
        use crate::transport::bulk::decode_group;

        let msg = PeerMsg::Coll {
            comm: 0,
            seq: 1,
            header: crate::proto::message::CollHeader {
                kind: 1,
                op: 1,
                dtype: 1,
                root: 0,
                count: 2,
                fingerprint: 0,
                segment: 0,
            },
            part: 0,
            len: 2,
        };
        let mut group = message_frame(&encode(&msg).unwrap()).to_vec();
        group.extend_from_slice(&raw_header(8));
        group.extend_from_slice(&[0u8; 8]);
        let (decoded, payload) = decode_group(&group.into(), 1 << 20).unwrap();
        assert_eq!((decoded, payload.len()), (msg, 8));
    }
}
