//! Frame headers and every rkyv message type, from arbitrary bytes: decoding may fail, but it
//! must never panic or allocate without bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nexar::proto::frame::{FrameHeader, HEADER_LEN, MAX_CONTROL_FRAME};
use nexar::proto::message::{PeerMsg, SeedRequest, SeedResponse, decode};

fuzz_target!(|data: &[u8]| {
    if let Some(header) = data.get(..HEADER_LEN).and_then(|h| <&[u8; HEADER_LEN]>::try_from(h).ok()) {
        let _ = FrameHeader::decode(header, MAX_CONTROL_FRAME);
    }
    let _ = decode::<SeedRequest>(data);
    let _ = decode::<SeedResponse>(data);
    if let Ok(msg) = decode::<PeerMsg>(data) {
        let _ = msg.payload_len();
    }
});
