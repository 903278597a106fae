//! The TCP lane's offer, sent inside the negotiation driver's round one
//! (`comm/backends/negotiate.rs`): where to dial, with which token, and how the offering rank seals
//! its records.

use crate::proto::message::LaneSealing;

/// Bytes of the token that binds a connection to its link.
pub(crate) const TOKEN_LEN: usize = 16;
/// Bytes of an offer: port, token, one-connection flag, sealing.
const OFFER_LEN: usize = 2 + TOKEN_LEN + 2;

/// Dial my lane listener on this port (at the address of my QUIC endpoint) with this token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LaneOffer {
    pub port: u16,
    pub token: [u8; TOKEN_LEN],
    /// I would rather the link had one connection for both ways (all my lane I/O runs on my
    /// runtime, where a reply carries TCP's acknowledgement); where threads do some of it, one
    /// connection per direction, so that a reading and a writing thread do not take turns at
    /// one socket's lock.
    pub one_connection: bool,
    /// How I seal my records: a peer that seals otherwise could read none of them (the seed
    /// refuses such a worker; ranks formed without a seed, `connect_static`, are told here).
    pub sealing: LaneSealing,
}

/// The offer's byte for `sealing`.
fn sealing_byte(sealing: LaneSealing) -> u8 {
    match sealing {
        LaneSealing::Plain => 0,
        LaneSealing::Aes128Gcm => 1,
        LaneSealing::Aegis128X2 => 2,
    }
}

impl LaneOffer {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.port.to_le_bytes().to_vec();
        out.extend_from_slice(&self.token);
        out.push(u8::from(self.one_connection));
        out.push(sealing_byte(self.sealing));
        out
    }

    /// An offer from untrusted bytes, or what is wrong with them.
    pub fn decode(bytes: &[u8]) -> Result<LaneOffer, String> {
        let sealing = |byte: u8| {
            [LaneSealing::Plain, LaneSealing::Aes128Gcm, LaneSealing::Aegis128X2]
                .into_iter()
                .find(|s| sealing_byte(*s) == byte)
                .ok_or_else(|| format!("a tcp lane offer whose sealing byte is {byte}, not 0, 1 or 2"))
        };
        match bytes {
            [p0, p1, token @ .., one @ (0 | 1), seal] if token.len() == TOKEN_LEN => Ok(LaneOffer {
                port: u16::from_le_bytes([*p0, *p1]),
                token: token.try_into().map_err(|_| "token length".to_string())?,
                one_connection: *one == 1,
                sealing: sealing(*seal)?,
            }),
            [.., flag, _] if bytes.len() == OFFER_LEN => {
                Err(format!("a tcp lane offer whose one-connection byte is {flag}, not 0 or 1"))
            }
            _ => Err(format!("a tcp lane offer of {} bytes, expected {OFFER_LEN}", bytes.len())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn offers_round_trip_and_bad_ones_say_why() {
        let sealings = [LaneSealing::Plain, LaneSealing::Aes128Gcm, LaneSealing::Aegis128X2];
        for (one_connection, sealing) in [false, true].into_iter().flat_map(|one| sealings.map(|s| (one, s))) {
            let offer = LaneOffer { port: 40123, token: [7; TOKEN_LEN], one_connection, sealing };
            assert_eq!(LaneOffer::decode(&offer.encode()), Ok(offer));
        }
        assert!(LaneOffer::decode(&[1, 2]).unwrap_err().contains("offer of 2 bytes"));
        assert!(LaneOffer::decode(&[0; OFFER_LEN + 1]).unwrap_err().contains("expected 20"));
        let mut flagged = [0; OFFER_LEN];
        flagged[OFFER_LEN - 2] = 2;
        assert!(LaneOffer::decode(&flagged).unwrap_err().contains("one-connection byte is 2"));
        let mut sealed = [0; OFFER_LEN];
        sealed[OFFER_LEN - 1] = 3;
        assert!(LaneOffer::decode(&sealed).unwrap_err().contains("sealing byte is 3"));
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = LaneOffer::decode(&bytes);
        }
    }
}
