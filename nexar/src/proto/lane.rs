//! The lanes of a link: the independent streams a peer's messages travel on, so that bulk
//! payloads never hold up control traffic or RPC. Which lane a message takes is part of the
//! wire protocol (a relay envelope names its message's lane by code), so it is decided here,
//! beside the messages.

use super::message::PeerMsg;

/// The independent receive queues of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Incoming RPC requests.
    RpcRequests = 0,
    /// Responses to our RPC calls.
    RpcResponses = 1,
    /// Control traffic: liveness, membership, collective agreement.
    Control = 2,
    /// Typed point-to-point messages.
    Data = 3,
    /// Bulk payloads of collectives.
    Raw = 4,
}

impl Lane {
    /// How many lanes there are.
    pub const COUNT: usize = 5;

    /// The lane a message travels on.
    pub fn of(msg: &PeerMsg) -> Lane {
        match msg {
            PeerMsg::P2p { .. } | PeerMsg::P2pSegment { .. } => Lane::Data,
            PeerMsg::Coll { .. } => Lane::Raw,
            PeerMsg::RpcRequest { .. } => Lane::RpcRequests,
            PeerMsg::RpcResponse { .. } => Lane::RpcResponses,
            PeerMsg::Ping { .. }
            | PeerMsg::Pong { .. }
            | PeerMsg::Goodbye
            | PeerMsg::Abort { .. }
            | PeerMsg::Registry { .. }
            | PeerMsg::Heartbeat
            | PeerMsg::Admit { .. }
            | PeerMsg::Suspect { .. }
            | PeerMsg::Setup { .. }
            | PeerMsg::WhereAreYou { .. }
            | PeerMsg::Position { .. }
            | PeerMsg::ProbeFor { .. }
            | PeerMsg::ProbeResult { .. } => Lane::Control,
            PeerMsg::Relay { lane, .. } => Lane::from_code(*lane).unwrap_or(Lane::Control),
        }
    }

    /// The lane with wire code `code`.
    pub fn from_code(code: u8) -> Option<Lane> {
        [Lane::RpcRequests, Lane::RpcResponses, Lane::Control, Lane::Data, Lane::Raw].get(usize::from(code)).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lane_round_trips_through_its_code_and_no_other_code_is_a_lane() {
        for code in 0..=u8::MAX {
            match Lane::from_code(code) {
                Some(lane) => assert_eq!(lane as u8, code),
                None => assert!(usize::from(code) >= Lane::COUNT),
            }
        }
    }

    #[test]
    fn payloads_never_share_the_control_lane() {
        assert_eq!(Lane::of(&PeerMsg::Heartbeat), Lane::Control);
        let relayed = PeerMsg::Relay { src: 0, dst: 2, lane: Lane::Raw as u8, hops: 0, seq: 0, len: 0 };
        assert_eq!(Lane::of(&relayed), Lane::Raw, "an envelope travels on its message's lane");
        let unknown = PeerMsg::Relay { src: 0, dst: 2, lane: 200, hops: 0, seq: 0, len: 0 };
        assert_eq!(Lane::of(&unknown), Lane::Control);
    }
}
