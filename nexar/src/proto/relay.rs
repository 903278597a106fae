//! The body of a relayed message: the carried message's frame, then its raw frame when it has
//! one. Packing and unpacking are pure functions over bytes, validated like any frame.

use bytes::Bytes;

use super::frame::{FrameError, FrameHeader, FrameKind, HEADER_LEN, MAX_CONTROL_FRAME, message_frame, raw_header};
use super::message::{self, PeerMsg};

/// The most relays a message may pass; a message that has passed more is dropped (a routing
/// loop, or a hostile peer).
pub const MAX_HOPS: u8 = 16;

/// Bytes a relay envelope's body may hold beyond the carried payload: the carried message
/// frame (a control frame), the payload's frame header, and the seal's tag.
pub const ENVELOPE_OVERHEAD: u64 = MAX_CONTROL_FRAME + 2 * HEADER_LEN as u64 + SEAL_TAG_LEN;

/// Bytes the end-to-end seal adds to a relay body (an AES-GCM tag).
pub const SEAL_TAG_LEN: u64 = 16;

/// Packs `msg` and its `payload` into the body of a relay envelope, as parts to be sent one
/// after the other (the payload is not copied).
pub fn pack(msg: &PeerMsg, payload: Option<Bytes>) -> Result<Vec<Bytes>, FrameError> {
    if matches!(msg, PeerMsg::Relay { .. }) {
        return Err(FrameError::InvalidMessage("a relay envelope cannot carry another".into()));
    }
    let body = message::encode(msg)?;
    let mut parts = vec![message_frame(&body)];
    if msg.payload_elements().is_some() {
        let payload = payload.unwrap_or_default();
        parts.push(raw_header(payload.len() as u64));
        parts.push(payload);
    }
    Ok(parts)
}

fn header(bytes: &[u8], at: usize, limit: u64) -> Result<FrameHeader, FrameError> {
    let raw: &[u8; HEADER_LEN] = bytes
        .get(at..at + HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| FrameError::InvalidMessage("relay body ends inside a frame header".into()))?;
    FrameHeader::decode(raw, limit)
}

/// Unpacks a relay body: the carried message and the byte range of its payload in `bytes`.
/// Everything is checked: frame kinds and lengths, the message itself (which may not be
/// another relay), and that its payload is exactly as long as it announces.
pub fn unpack(bytes: &[u8], max_payload: u64) -> Result<(PeerMsg, std::ops::Range<usize>), FrameError> {
    let h = header(bytes, 0, MAX_CONTROL_FRAME)?.expect(FrameKind::Message)?;
    let start = HEADER_LEN;
    let end = start
        .checked_add(usize::try_from(h.len).map_err(|_| FrameError::TooLong { len: h.len, limit: MAX_CONTROL_FRAME })?)
        .filter(|e| *e <= bytes.len())
        .ok_or_else(|| FrameError::InvalidMessage("relay body ends inside the carried message".into()))?;
    let msg: PeerMsg = message::decode(&bytes[start..end])?;
    if matches!(msg, PeerMsg::Relay { .. }) {
        return Err(FrameError::InvalidMessage("a relay envelope carries another".into()));
    }
    let payload = match msg.payload_elements() {
        None => end..end,
        Some(_) => {
            let want =
                msg.payload_len().ok_or_else(|| FrameError::InvalidMessage("payload length overflows".into()))?;
            if want > max_payload {
                return Err(FrameError::TooLong { len: want, limit: max_payload });
            }
            let raw = header(bytes, end, max_payload)?.expect(FrameKind::Raw)?;
            if raw.len != want {
                return Err(FrameError::InvalidMessage(format!(
                    "carried message announces {want} payload bytes but its raw frame has {}",
                    raw.len
                )));
            }
            let from = end + HEADER_LEN;
            from..from + raw.len as usize
        }
    };
    if payload.end != bytes.len() {
        return Err(FrameError::InvalidMessage(format!(
            "relay body has {} bytes, the carried frames {}",
            bytes.len(),
            payload.end
        )));
    }
    Ok((msg, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_message_packs_and_unpacks_as_it_was() {
        use crate::proto::message::PeerMsg;
        use crate::proto::relay::{pack, unpack};
        let msg = PeerMsg::Ping { nonce: 7 };
        let body = pack(&msg, None).unwrap().concat();
        let (back, payload) = unpack(&body, 0).unwrap();
        assert_eq!((back, payload.len()), (msg, 0));
    }

    fn packed(msg: &PeerMsg, payload: &[u8]) -> Vec<u8> {
        pack(msg, Some(Bytes::copy_from_slice(payload))).unwrap().concat()
    }

    #[test]
    fn packed_messages_unpack_to_themselves() {
        let m = PeerMsg::P2p { comm: 3, tag: 9, dtype: nexar_types::DType::U8.to_wire(), count: 16 };
        let body = packed(&m, &[1u8; 16]);
        let (back, range) = unpack(&body, 1 << 20).unwrap();
        assert_eq!(back, m);
        assert_eq!(&body[range], &[1u8; 16]);
        let s = PeerMsg::Suspect { rank: 2, reason: "quiet".into() };
        let (back, range) = unpack(&packed(&s, &[]), 0).unwrap();
        assert_eq!((back, range.len()), (s, 0));
    }

    #[test]
    fn bad_bodies_are_refused() {
        let m = PeerMsg::P2p { comm: 3, tag: 9, dtype: nexar_types::DType::U8.to_wire(), count: 16 };
        let body = packed(&m, &[1u8; 16]);
        assert!(unpack(&body[..body.len() - 1], 1 << 20).is_err(), "short payload");
        let mut long = body.clone();
        long.push(0);
        assert!(unpack(&long, 1 << 20).is_err(), "trailing bytes");
        assert!(unpack(&body, 8).is_err(), "payload over the limit");
        let relay = PeerMsg::Relay { src: 0, dst: 1, lane: 3, hops: 0, seq: 1, len: 0 };
        assert!(pack(&relay, None).is_err());
    }

    proptest! {
        #[test]
        fn mutated_bodies_never_panic(flip in 0usize..200, xor in 1u8..=255, cut in 0usize..200) {
            let m = PeerMsg::Coll { comm: 1, seq: 2, header: crate::proto::message::CollHeader { kind: 3, op: 1, dtype: 9, root: 0, count: 10, fingerprint: 7, segment: 0 }, part: 0, len: 5 };
            let mut body = packed(&m, &[7u8; 20]);
            let i = flip % body.len();
            body[i] ^= xor;
            body.truncate(body.len() - cut % body.len());
            let _ = unpack(&body, 1 << 20);
        }

        #[test]
        fn random_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = unpack(&bytes, 1 << 20);
        }
    }
}
