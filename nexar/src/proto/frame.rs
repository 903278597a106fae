//! Stream framing: a one-byte tag, an 8-byte little-endian length, then the body.
//!
//! `0x01` frames carry an rkyv-serialised message, `0x02` frames carry raw payload bytes.
//! Lengths are checked against a caller-supplied limit *before* anything is allocated.

use bytes::{BufMut, Bytes, BytesMut};

/// Tag of a frame holding an rkyv-serialised message.
pub const TAG_MESSAGE: u8 = 0x01;
/// Tag of a frame holding raw payload bytes.
pub const TAG_RAW: u8 = 0x02;
/// Bytes in a frame header: tag plus length.
pub const HEADER_LEN: usize = 9;
/// The wire limit on a frame body: 4 GiB.
pub const MAX_FRAME_LEN: u64 = 4 << 30;
/// Largest join request the seed reads from an unauthenticated connection.
pub const MAX_JOIN_FRAME: u64 = 4 << 10;
/// Largest control message (everything but raw payloads and RPC bodies) a peer may send.
pub const MAX_CONTROL_FRAME: u64 = 64 << 10;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// An rkyv-serialised message.
    Message,
    /// Raw payload bytes.
    Raw,
}

/// Why bytes are not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The tag byte is neither `0x01` nor `0x02`.
    #[error("unknown frame tag {0:#04x} (expected 0x01 message or 0x02 raw)")]
    UnknownTag(u8),
    /// The announced length exceeds what the reader accepts here.
    #[error("frame announces {len} bytes, more than the {limit}-byte limit")]
    TooLong {
        /// Announced body length.
        len: u64,
        /// Limit in force.
        limit: u64,
    },
    /// A frame of one kind arrived where another was required.
    #[error("expected a {expected:?} frame, got a {got:?} frame")]
    WrongKind {
        /// The kind required.
        expected: FrameKind,
        /// The kind received.
        got: FrameKind,
    },
    /// The message body failed validation.
    #[error("invalid message: {0}")]
    InvalidMessage(String),
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the body holds.
    pub kind: FrameKind,
    /// Body length in bytes.
    pub len: u64,
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0] = match self.kind {
            FrameKind::Message => TAG_MESSAGE,
            FrameKind::Raw => TAG_RAW,
        };
        out[1..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes a header, refusing unknown tags and bodies longer than `limit`
    /// (itself capped at [`MAX_FRAME_LEN`]).
    pub fn decode(bytes: &[u8; HEADER_LEN], limit: u64) -> Result<Self, FrameError> {
        let kind = match bytes[0] {
            TAG_MESSAGE => FrameKind::Message,
            TAG_RAW => FrameKind::Raw,
            other => return Err(FrameError::UnknownTag(other)),
        };
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[1..]);
        let len = u64::from_le_bytes(len);
        let limit = limit.min(MAX_FRAME_LEN);
        if len > limit {
            return Err(FrameError::TooLong { len, limit });
        }
        Ok(FrameHeader { kind, len })
    }

    /// Requires this header to be of `expected` kind.
    pub fn expect(self, expected: FrameKind) -> Result<Self, FrameError> {
        if self.kind == expected { Ok(self) } else { Err(FrameError::WrongKind { expected, got: self.kind }) }
    }
}

/// A message frame (header and body) in one buffer.
pub fn message_frame(body: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
    out.put_slice(&message_head(body.len()));
    out.put_slice(body);
    out.freeze()
}

/// The header of a message frame whose body is `len` bytes.
pub fn message_head(len: usize) -> [u8; HEADER_LEN] {
    FrameHeader { kind: FrameKind::Message, len: len as u64 }.encode()
}

/// The header of a raw frame of `len` bytes.
pub fn raw_header(len: u64) -> Bytes {
    Bytes::copy_from_slice(&raw_head(len))
}

/// [`raw_header`] as an array.
pub fn raw_head(len: u64) -> [u8; HEADER_LEN] {
    FrameHeader { kind: FrameKind::Raw, len }.encode()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn headers_round_trip_and_limits_hold() {
        let h = FrameHeader { kind: FrameKind::Raw, len: 77 };
        assert_eq!(FrameHeader::decode(&h.encode(), 100), Ok(h));
        assert_eq!(FrameHeader::decode(&h.encode(), 76), Err(FrameError::TooLong { len: 77, limit: 76 }));
        let huge = FrameHeader { kind: FrameKind::Message, len: MAX_FRAME_LEN + 1 }.encode();
        assert!(matches!(FrameHeader::decode(&huge, u64::MAX), Err(FrameError::TooLong { .. })));
        let mut junk = h.encode();
        junk[0] = 0x7f;
        assert_eq!(FrameHeader::decode(&junk, 100), Err(FrameError::UnknownTag(0x7f)));
        assert!(h.expect(FrameKind::Message).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics_and_respects_the_limit(bytes in any::<[u8; HEADER_LEN]>(), limit in any::<u64>()) {
            if let Ok(h) = FrameHeader::decode(&bytes, limit) {
                prop_assert!(h.len <= limit.min(MAX_FRAME_LEN));
                prop_assert_eq!(h.encode(), bytes);
            }
        }
    }
}
