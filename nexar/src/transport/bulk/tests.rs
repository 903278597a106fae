//! Tests of bulk channels: group decoding and its checks, carried collectives.

use super::*;
use crate::proto::frame::{message_frame, raw_header};
use crate::proto::message::{self, PeerMsg};
use crate::transport::bulk::inbound::FRAMES_MAX;
use proptest::prelude::*;

/// A collective message announcing `len` f32 elements (for tests that build groups).
pub(crate) fn coll(len: u64) -> PeerMsg {
    PeerMsg::Coll {
        comm: 3,
        seq: 9,
        header: crate::proto::message::CollHeader {
            kind: 1,
            op: 1,
            dtype: 1,
            root: 0,
            count: len,
            fingerprint: 0,
            segment: 0,
        },
        part: 0,
        len,
    }
}

fn group(msg: &PeerMsg, raw_len: u64, payload: &[u8]) -> Bytes {
    let mut out = message_frame(&message::encode(msg).unwrap()).to_vec();
    out.extend_from_slice(&raw_header(raw_len));
    out.extend_from_slice(payload);
    out.into()
}

#[test]
fn a_well_formed_group_decodes_without_copying_the_payload() {
    let g = group(&coll(4), 16, &[7u8; 16]);
    let (msg, payload) = decode_group(&g, 1 << 20).unwrap();
    assert_eq!(msg, coll(4));
    assert_eq!(payload.to_chunks().unwrap()[0].as_ptr(), g[g.len() - 16..].as_ptr());
}

#[test]
fn bad_groups_are_refused_with_a_reason() {
    let cases = [
        (group(&coll(4), 12, &[0u8; 12]), "announces 16"),
        (group(&coll(4), 16, &[0u8; 15]), "runs past"),
        (group(&coll(4), 16, &[0u8; 17]), "follow the payload"),
        (group(&coll(1 << 20), 4 << 20, &[]), "limit"),
        (group(&PeerMsg::Heartbeat, 0, &[]), "collective payloads only"),
        (Bytes::from_static(&[1, 2, 3]), "inside a frame header"),
    ];
    for (g, want) in cases {
        let err = decode_group(&g, 1 << 20).unwrap_err().to_string();
        assert!(err.to_lowercase().contains(want), "{err:?} should mention {want:?}");
    }
}

#[test]
fn a_group_opened_from_its_peeked_copy_is_checked_as_a_whole_one_is() {
    let lanes = super::super::lanes::lanes(4).0;
    let slot = Arc::new(BulkSlot::new(1, &lanes));
    let inbound = BulkInbound::new(1, lanes, 1 << 20, &slot);
    // Well formed: the same message and payload as the whole group's decoding.
    for payload in [&[][..], &[7u8; 16][..]] {
        let g = group(&coll(payload.len() as u64 / 4), payload.len() as u64, payload);
        let (msg, len) = inbound.peek(&g, g.len()).unwrap().unwrap();
        assert_eq!(len, payload.len() as u64);
        let opened = inbound.open_copied(&g, msg).unwrap();
        assert_eq!((opened.from, &opened.msg), (1, &coll(payload.len() as u64 / 4)));
        assert_eq!(opened.payload.to_vec().unwrap(), payload);
    }
    // A raw frame that disagrees with the message, a short or long group: refused for the
    // same reasons (the message alone, found in the copy, does not make the group whole).
    let cases = [
        (group(&coll(4), 12, &[0u8; 12]), "announces 16"),
        (group(&coll(4), 16, &[0u8; 15]), "runs past"),
        (group(&coll(4), 16, &[0u8; 17]), "follow the payload"),
    ];
    for (g, want) in cases {
        let (msg, _) = inbound.peek(&g, g.len()).unwrap().unwrap();
        let err = inbound.open_copied(&g, msg).unwrap_err().to_string();
        assert!(err.to_lowercase().contains(want), "{err:?} should mention {want:?}");
    }
}

#[test]
fn a_group_far_longer_or_shorter_than_its_payload_is_refused_from_its_first_bytes() {
    let lanes = super::super::lanes::lanes(4).0;
    let slot = Arc::new(BulkSlot::new(1, &lanes));
    let inbound = BulkInbound::new(1, lanes, 1 << 30, &slot);
    let g = group(&coll(2), 8, &[5u8; 8]);
    let frames = g.len() - 8;
    // Its frames and nothing more, or up to FRAMES_MAX of them: found.
    for len in [g.len(), 8 + FRAMES_MAX as usize] {
        assert_eq!(inbound.peek(&g[..frames], len).unwrap().unwrap().1, 8, "{len}");
    }
    // An 8-byte payload in a group announced at a GiB (what the mailbox would admit is
    // 8 bytes; the reader would read on to the GiB), or in a group too short for it.
    for len in [1usize << 30, 9 + FRAMES_MAX as usize, 7] {
        let err = inbound.peek(&g[..frames], len).unwrap_err().to_string();
        assert!(err.contains(&format!("a {len}-byte group announces a 8-byte payload")), "{err}");
    }
}

struct Nowhere(std::sync::atomic::AtomicBool);

impl BulkChannel for Nowhere {
    fn name(&self) -> &'static str {
        "nowhere"
    }
    fn send(&self, _: Vec<Bytes>) -> BulkSend {
        Box::pin(async { Ok(()) })
    }
    fn usable(&self) -> bool {
        !self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[tokio::test]
async fn a_collective_never_spans_two_transports() {
    let slot = Arc::new(BulkSlot::new(1, &super::super::lanes::lanes(4).0));
    let (before, after, received, later) = ((0, 1), (0, 2), (0, 3), (0, 4));
    assert_eq!(slot.route(before, 0).err(), Some(false), "no channel yet: QUIC");
    let channel = Arc::new(Nowhere(Default::default()));
    slot.attach(channel.clone(), None).unwrap();
    assert_eq!(slot.route(before, 0).err(), Some(false), "started on QUIC, stays there");
    assert!(slot.route(after, 0).is_ok(), "a new collective takes the channel");
    slot.received(received);
    channel.0.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(!slot.working(), "a channel that stopped is not working before its failure is handled");
    // The channel failed: what it carried (either way) is not sent at all, the rest goes
    // over QUIC.
    assert_eq!(slot.route(after, 0).err(), Some(true));
    assert_eq!(slot.route(received, 0).err(), Some(true));
    assert_eq!(slot.route(before, 0).err(), Some(false));
    assert_eq!(slot.route(later, 0).err(), Some(false));
    assert!(!slot.working());
    assert!(slot.attach(Arc::new(Nowhere(Default::default())), None).is_err(), "one channel per link");
}

proptest! {
    #[test]
    fn mutated_groups_never_panic(flip in 0usize..200, xor in 1u8..=255, cut in 0usize..200) {
        let mut bytes = group(&coll(8), 32, &[5u8; 32]).to_vec();
        let i = flip % bytes.len();
        bytes[i] ^= xor;
        bytes.truncate(bytes.len() - cut % bytes.len());
        let _ = decode_group(&bytes.into(), 1 << 20);
    }
}
