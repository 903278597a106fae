//! What a message announces of the raw frame that follows it, checked before a byte of that
//! frame is read or a buffer allocated for it: every transport's reader (QUIC lanes, the TCP
//! lane, shared memory) asks here.

use super::frame::FrameError;
use super::lane::Lane;
use super::message::PeerMsg;
use super::relay;

/// The error for a raw frame whose length is not the one its message announced.
pub(crate) fn raw_length_disagrees(announced: u64, found: u64) -> FrameError {
    FrameError::InvalidMessage(format!("message announces {announced} payload bytes but its raw frame has {found}"))
}

/// Checks what a message announces before anything else is read: relay envelopes name a real
/// lane and a bounded hop count, and a payload has a known dtype and fits the limit. Returns
/// `(payload bytes, limit)` for messages followed by a raw frame.
pub(crate) fn announced_payload(msg: &PeerMsg, max_payload: u64) -> Result<Option<(u64, u64)>, FrameError> {
    if let PeerMsg::Relay { lane, hops, .. } = *msg
        && (Lane::from_code(lane).is_none() || hops > relay::MAX_HOPS)
    {
        return Err(FrameError::InvalidMessage(format!("relay envelope with lane {lane} after {hops} hops")));
    }
    let Some((dtype, _)) = msg.payload_elements() else { return Ok(None) };
    nexar_types::DType::from_wire(dtype).map_err(|e| FrameError::InvalidMessage(e.to_string()))?;
    let expected =
        msg.payload_len().ok_or_else(|| FrameError::InvalidMessage("payload length overflows 64 bits".into()))?;
    // A relay envelope carries a whole message: its payload plus the carried frames.
    let limit = match msg {
        PeerMsg::Relay { .. } => max_payload.saturating_add(relay::ENVELOPE_OVERHEAD),
        _ => max_payload,
    };
    if expected > limit {
        return Err(FrameError::TooLong { len: expected, limit });
    }
    Ok(Some((expected, limit)))
}

#[cfg(test)]
mod tests {
    use nexar_types::DType;

    use super::*;

    fn p2p(dtype: u8, count: u64) -> PeerMsg {
        PeerMsg::P2p { comm: 1, tag: 7, dtype, count }
    }

    fn relay(lane: u8, hops: u8, len: u64) -> PeerMsg {
        PeerMsg::Relay { src: 0, dst: 2, lane, hops, seq: 1, len }
    }

    #[test]
    fn a_payload_is_announced_in_bytes_of_its_element_type() {
        let f32s = p2p(DType::F32.to_wire(), 10);
        assert_eq!(announced_payload(&f32s, 1 << 20).unwrap(), Some((40, 1 << 20)));
        assert_eq!(announced_payload(&PeerMsg::Heartbeat, 1 << 20).unwrap(), None, "no raw frame follows");
    }

    #[test]
    fn an_unknown_element_type_an_overflow_or_an_oversized_payload_is_refused() {
        assert!(matches!(announced_payload(&p2p(250, 1), 1 << 20), Err(FrameError::InvalidMessage(_))));
        let overflow = p2p(DType::F64.to_wire(), u64::MAX / 4);
        assert!(matches!(announced_payload(&overflow, u64::MAX), Err(FrameError::InvalidMessage(_))));
        let big = p2p(DType::U8.to_wire(), (1 << 20) + 1);
        assert!(
            matches!(announced_payload(&big, 1 << 20), Err(FrameError::TooLong { len, limit }) if len == (1 << 20) + 1 && limit == 1 << 20)
        );
    }

    #[test]
    fn a_relay_envelope_names_a_real_lane_within_the_hop_bound_and_may_carry_its_frames() {
        let max = 1 << 20;
        let whole = max + relay::ENVELOPE_OVERHEAD;
        assert_eq!(announced_payload(&relay(Lane::Data as u8, 3, whole), max).unwrap(), Some((whole, whole)));
        assert!(announced_payload(&relay(Lane::Data as u8, 3, whole + 1), max).is_err());
        assert!(announced_payload(&relay(Lane::COUNT as u8, 0, 8), max).is_err(), "no such lane");
        assert!(announced_payload(&relay(Lane::Data as u8, relay::MAX_HOPS + 1, 8), max).is_err(), "too many hops");
    }

    #[test]
    fn a_raw_frame_of_another_length_is_named_with_both_lengths() {
        let e = raw_length_disagrees(40, 39).to_string();
        assert!(e.contains("40") && e.contains("39"), "{e}");
    }
}
