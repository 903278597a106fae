//! The queue-pair exchange, without I/O: the messages two ranks swap over nexar's control lane
//! before their RDMA link carries anything, their byte encoding (validated on decode: these
//! bytes come from the network), and the decision each side takes from them.
//!
//! The exchange has two rounds. First each rank sends an [`SetupMsg::Offer`] (its queue pair
//! and receive ring) or a [`SetupMsg::Decline`] (no device, wrong fabric). When both offered
//! and the offers fit ([`decide`]), each side connects its queue pair and sends
//! [`SetupMsg::Ready`] or [`SetupMsg::Failed`]; only when both are ready does the link switch
//! to RDMA. Any other outcome keeps the link on QUIC, on both sides.

/// Version of the setup messages; ranks with different versions fall back to QUIC.
pub const SETUP_VERSION: u16 = 1;
/// nexar setup-message tag of round one (offers) of exchange number `attempt` on the
/// communicator with id `comm`. Every attempt has its own tags, so messages an abandoned
/// attempt left unread are never taken for a later one's.
///
/// ```
/// use nexar_rdma::setup::{offer_tag, outcome_tag};
/// assert_ne!(offer_tag(7, 0), offer_tag(8, 0));
/// assert_ne!(offer_tag(7, 0), offer_tag(7, 1));
/// assert_ne!(offer_tag(7, 0), outcome_tag(7, 0));
/// ```
pub fn offer_tag(comm: u64, attempt: u64) -> u64 {
    tag(comm, attempt, 1)
}

/// nexar setup-message tag of round two (outcomes); see [`offer_tag`].
pub fn outcome_tag(comm: u64, attempt: u64) -> u64 {
    tag(comm, attempt, 2)
}

fn tag(comm: u64, attempt: u64, round: u64) -> u64 {
    let mut h = 0x4e58_5244_4d41_0000u64;
    for word in [comm, attempt, round] {
        h = (h ^ word).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    // Never the all-ones tag nexar reserves.
    h & !(1 << 63)
}

const MAGIC: &[u8; 4] = b"NXRD";
/// Largest reason text carried in a message.
const MAX_REASON: usize = 1024;
/// Largest receive ring a peer may ask this rank to write into.
const MAX_RING_BYTES: u64 = 1 << 30;

/// Which fabric a queue pair lives on. Both ends must use the same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricKind {
    /// A real NIC through ibverbs.
    Verbs = 1,
    /// The in-process emulation ([`crate::Fabric::Emulated`]).
    Emulated = 2,
}

/// One side's queue pair and receive ring, as the other side needs them to write into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpOffer {
    /// The fabric.
    pub fabric: FabricKind,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID for global routing (RoCE), if any.
    pub gid: Option<[u8; 16]>,
    /// Queue-pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// Path MTU as the verbs enum (1 = 256 … 5 = 4096).
    pub mtu: u8,
    /// Address of the receive ring in the offering rank's memory.
    pub ring_addr: u64,
    /// Remote key that lets the peer write the ring.
    pub rkey: u32,
    /// Slots in the ring.
    pub slots: u16,
    /// Bytes per slot.
    pub slot_size: u32,
    /// Random, new for every attempt: round two echoes it, so an offer left over from an
    /// earlier attempt is never connected to.
    pub nonce: u64,
}

/// A message of the exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SetupMsg {
    /// "Here is my queue pair": round one.
    Offer(QpOffer),
    /// "I will not use RDMA with you": round one, when a rank has no device or cannot build
    /// a queue pair.
    Decline {
        /// Why, for the peer's log.
        reason: String,
    },
    /// "My queue pair is connected to yours": round two.
    Ready {
        /// The nonce of this rank's offer.
        mine: u64,
        /// The nonce of the offer this rank connected to.
        seen: u64,
    },
    /// "Connecting failed": round two; both sides stay on QUIC.
    Failed {
        /// Why.
        reason: String,
    },
}

const KIND_OFFER: u8 = 1;
const KIND_DECLINE: u8 = 2;
const KIND_READY: u8 = 3;
const KIND_FAILED: u8 = 4;
/// Bytes of an encoded offer after the common header.
const OFFER_LEN: usize = 1 + 2 + 1 + 16 + 4 + 4 + 1 + 8 + 4 + 2 + 4 + 8;

impl SetupMsg {
    /// The message's bytes.
    ///
    /// ```
    /// use nexar_rdma::setup::SetupMsg;
    /// let ready = SetupMsg::Ready { mine: 1, seen: 2 };
    /// assert_eq!(SetupMsg::decode(&ready.encode()).unwrap(), ready);
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(7 + OFFER_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&SETUP_VERSION.to_le_bytes());
        match self {
            SetupMsg::Offer(o) => {
                out.push(KIND_OFFER);
                out.push(o.fabric as u8);
                out.extend_from_slice(&o.lid.to_le_bytes());
                out.push(u8::from(o.gid.is_some()));
                out.extend_from_slice(&o.gid.unwrap_or_default());
                out.extend_from_slice(&o.qpn.to_le_bytes());
                out.extend_from_slice(&o.psn.to_le_bytes());
                out.push(o.mtu);
                out.extend_from_slice(&o.ring_addr.to_le_bytes());
                out.extend_from_slice(&o.rkey.to_le_bytes());
                out.extend_from_slice(&o.slots.to_le_bytes());
                out.extend_from_slice(&o.slot_size.to_le_bytes());
                out.extend_from_slice(&o.nonce.to_le_bytes());
            }
            SetupMsg::Decline { reason } => {
                out.push(KIND_DECLINE);
                out.extend_from_slice(&bounded(reason));
            }
            SetupMsg::Ready { mine, seen } => {
                out.push(KIND_READY);
                out.extend_from_slice(&mine.to_le_bytes());
                out.extend_from_slice(&seen.to_le_bytes());
            }
            SetupMsg::Failed { reason } => {
                out.push(KIND_FAILED);
                out.extend_from_slice(&bounded(reason));
            }
        }
        out
    }

    /// Reads a message from untrusted bytes, checking every field.
    ///
    /// ```
    /// use nexar_rdma::setup::SetupMsg;
    /// let err = SetupMsg::decode(b"NXRD\x09\x00\x03").unwrap_err();
    /// assert!(err.contains("version 9"));
    /// ```
    pub fn decode(bytes: &[u8]) -> Result<SetupMsg, String> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != MAGIC {
            return Err("not an RDMA setup message (bad magic)".into());
        }
        let version = r.u16()?;
        if version != SETUP_VERSION {
            return Err(format!("setup version {version}, this rank speaks version {SETUP_VERSION}"));
        }
        let msg = match r.u8()? {
            KIND_OFFER => SetupMsg::Offer(read_offer(&mut r)?),
            KIND_DECLINE => SetupMsg::Decline { reason: r.text()? },
            KIND_READY => SetupMsg::Ready { mine: r.u64()?, seen: r.u64()? },
            KIND_FAILED => SetupMsg::Failed { reason: r.text()? },
            other => return Err(format!("unknown message kind {other}")),
        };
        if r.at != bytes.len() {
            return Err(format!("{} bytes after the message", bytes.len() - r.at));
        }
        Ok(msg)
    }
}

fn read_offer(r: &mut Reader<'_>) -> Result<QpOffer, String> {
    let fabric = match r.u8()? {
        1 => FabricKind::Verbs,
        2 => FabricKind::Emulated,
        other => return Err(format!("unknown fabric {other}")),
    };
    let lid = r.u16()?;
    let has_gid = match r.u8()? {
        0 => false,
        1 => true,
        other => return Err(format!("gid flag {other}")),
    };
    let gid: [u8; 16] = r.take(16)?.try_into().map_err(|_| "gid")?;
    let offer = QpOffer {
        fabric,
        lid,
        gid: has_gid.then_some(gid),
        qpn: r.u32()?,
        psn: r.u32()?,
        mtu: r.u8()?,
        ring_addr: r.u64()?,
        rkey: r.u32()?,
        slots: r.u16()?,
        slot_size: r.u32()?,
        nonce: r.u64()?,
    };
    check_offer(&offer)?;
    Ok(offer)
}

/// The limits every offer must respect, whoever made it.
fn check_offer(o: &QpOffer) -> Result<(), String> {
    if o.qpn >= 1 << 24 || o.psn >= 1 << 24 {
        return Err(format!("queue pair {:#x} / psn {:#x} do not fit 24 bits", o.qpn, o.psn));
    }
    if !(1..=5).contains(&o.mtu) {
        return Err(format!("path MTU code {} (1 to 5 expected)", o.mtu));
    }
    if o.slots == 0 || !o.slot_size.is_power_of_two() || o.slot_size < 4096 {
        return Err(format!(
            "ring of {} slots of {} bytes (slots > 0, power-of-two slots ≥ 4 KiB)",
            o.slots, o.slot_size
        ));
    }
    let ring = u64::from(o.slots) * u64::from(o.slot_size);
    if ring > MAX_RING_BYTES || o.ring_addr.checked_add(ring).is_none() {
        return Err(format!("a {ring}-byte ring at {:#x} is over the 1 GiB limit or wraps", o.ring_addr));
    }
    Ok(())
}

fn bounded(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = (end as u16).to_le_bytes().to_vec();
    out.extend_from_slice(&reason.as_bytes()[..end]);
    out
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.bytes.len());
        let end = end.ok_or_else(|| format!("message ends at byte {} inside a {n}-byte field", self.bytes.len()))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().map_err(|_| "u16")?))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| "u32")?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| "u64")?))
    }
    fn text(&mut self) -> Result<String, String> {
        let len = usize::from(self.u16()?);
        if len > MAX_REASON {
            return Err(format!("a {len}-byte reason (at most {MAX_REASON})"));
        }
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| "a reason that is not UTF-8".to_string())
    }
}

/// What round one decided for one link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Connect to this queue pair.
    Connect(QpOffer),
    /// Stay on QUIC, for this reason.
    Fallback(String),
}

/// Round one's outcome from this rank's message and the peer's (`peer` names it in reasons).
/// Both sides reach the same verdict: they see the same two messages.
///
/// ```
/// use nexar_rdma::setup::{Decision, SetupMsg, decide};
/// let theirs = SetupMsg::Decline { reason: "no RDMA device".into() };
/// let ours = SetupMsg::Decline { reason: "no RDMA device".into() };
/// assert!(matches!(decide(&ours, &theirs, 1), Decision::Fallback(_)));
/// ```
pub fn decide(ours: &SetupMsg, theirs: &SetupMsg, peer: usize) -> Decision {
    match (ours, theirs) {
        (SetupMsg::Offer(mine), SetupMsg::Offer(remote)) => {
            if mine.fabric != remote.fabric {
                Decision::Fallback(format!("rank {peer} is on {:?}, this rank on {:?}", remote.fabric, mine.fabric))
            } else if (mine.slots, mine.slot_size) != (remote.slots, remote.slot_size) {
                Decision::Fallback(format!(
                    "rank {peer} has a ring of {}×{} bytes, this rank {}×{}",
                    remote.slots, remote.slot_size, mine.slots, mine.slot_size
                ))
            } else {
                Decision::Connect(*remote)
            }
        }
        (SetupMsg::Decline { reason }, _) => Decision::Fallback(format!("this rank declined: {reason}")),
        (_, SetupMsg::Decline { reason }) => Decision::Fallback(format!("rank {peer} declined: {reason}")),
        (_, other) => Decision::Fallback(format!("rank {peer} answered round one with {other:?}")),
    }
}

/// Round two's outcome: whether both sides attach, from both outcomes. Both sides compute
/// the same answer: both must be ready, and each must have connected to the other's offer of
/// this attempt.
///
/// ```
/// use nexar_rdma::setup::{SetupMsg, both_ready};
/// let a = SetupMsg::Ready { mine: 1, seen: 2 };
/// let b = SetupMsg::Ready { mine: 2, seen: 1 };
/// assert!(both_ready(&a, &b) && both_ready(&b, &a));
/// assert!(!both_ready(&a, &SetupMsg::Ready { mine: 2, seen: 9 })); // b connected to a stale offer
/// ```
pub fn both_ready(ours: &SetupMsg, theirs: &SetupMsg) -> bool {
    matches!((ours, theirs), (SetupMsg::Ready { mine, seen }, SetupMsg::Ready { mine: their_mine, seen: their_seen })
        if seen == their_mine && their_seen == mine)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn offer() -> QpOffer {
        QpOffer {
            fabric: FabricKind::Verbs,
            lid: 7,
            gid: Some([0xfe; 16]),
            qpn: 0x12,
            psn: 0xabcdef,
            mtu: 5,
            ring_addr: 0x7f00_0000_1000,
            rkey: 99,
            slots: 8,
            slot_size: 1 << 20,
            nonce: 0x1234_5678_9abc_def0,
        }
    }

    #[test]
    fn every_message_round_trips() {
        for msg in [
            SetupMsg::Offer(offer()),
            SetupMsg::Offer(QpOffer { gid: None, ..offer() }),
            SetupMsg::Decline { reason: "no RDMA device: ibverbs lists none".into() },
            SetupMsg::Ready { mine: 5, seen: u64::MAX },
            SetupMsg::Failed { reason: "ibv_modify_qp(RTR): Invalid argument".into() },
        ] {
            assert_eq!(SetupMsg::decode(&msg.encode()), Ok(msg));
        }
    }

    #[test]
    fn bad_offers_are_refused_with_the_field_named() {
        let cases = [
            (QpOffer { qpn: 1 << 24, ..offer() }, "24 bits"),
            (QpOffer { mtu: 6, ..offer() }, "mtu"),
            (QpOffer { slots: 0, ..offer() }, "slots"),
            (QpOffer { slot_size: 5000, ..offer() }, "power-of-two"),
            (QpOffer { slots: 2048, ..offer() }, "1 gib"),
            (QpOffer { ring_addr: u64::MAX - 10, ..offer() }, "wraps"),
        ];
        for (o, want) in cases {
            let err = SetupMsg::decode(&SetupMsg::Offer(o).encode()).unwrap_err();
            assert!(err.to_lowercase().contains(want), "{err:?} should mention {want:?}");
        }
    }

    #[test]
    fn truncated_padded_and_foreign_bytes_are_refused() {
        let good = SetupMsg::Offer(offer()).encode();
        for cut in 0..good.len() {
            assert!(SetupMsg::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut padded = good.clone();
        padded.push(0);
        assert!(SetupMsg::decode(&padded).unwrap_err().contains("after the message"));
        assert!(SetupMsg::decode(b"HTTP/1.1 200").unwrap_err().contains("magic"));
    }

    #[test]
    fn long_reasons_are_cut_on_a_character_boundary() {
        let reason = "é".repeat(MAX_REASON);
        let SetupMsg::Decline { reason: back } = SetupMsg::decode(&SetupMsg::Decline { reason }.encode()).unwrap()
        else {
            panic!("not a decline")
        };
        assert!(back.len() <= MAX_REASON && back.chars().all(|c| c == 'é'));
    }

    #[test]
    fn both_sides_decide_alike() {
        let a = SetupMsg::Offer(offer());
        let b = SetupMsg::Offer(QpOffer { qpn: 0x34, ..offer() });
        assert_eq!(decide(&a, &b, 1), Decision::Connect(QpOffer { qpn: 0x34, ..offer() }));
        assert_eq!(decide(&b, &a, 0), Decision::Connect(offer()));
        let emulated = SetupMsg::Offer(QpOffer { fabric: FabricKind::Emulated, ..offer() });
        assert!(matches!(decide(&a, &emulated, 1), Decision::Fallback(r) if r.contains("Emulated")));
        assert!(matches!(decide(&emulated, &a, 0), Decision::Fallback(_)));
        let small = SetupMsg::Offer(QpOffer { slots: 4, ..offer() });
        assert!(matches!(decide(&a, &small, 1), Decision::Fallback(r) if r.contains("4×")));
        let no = SetupMsg::Decline { reason: "no RDMA device".into() };
        assert!(matches!(decide(&a, &no, 3), Decision::Fallback(r) if r.contains("rank 3 declined")));
        assert!(matches!(decide(&no, &a, 0), Decision::Fallback(r) if r.contains("this rank declined")));
        assert!(matches!(decide(&a, &SetupMsg::Ready { mine: 1, seen: 2 }, 2), Decision::Fallback(_)));
    }

    proptest! {
        #[test]
        fn random_and_mutated_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..96),
                                               flip in 0usize..64, xor in 1u8..=255) {
            let _ = SetupMsg::decode(&bytes);
            let mut good = SetupMsg::Offer(offer()).encode();
            let i = flip % good.len();
            good[i] ^= xor;
            if let Ok(SetupMsg::Offer(o)) = SetupMsg::decode(&good) {
                prop_assert!(check_offer(&o).is_ok());
            }
        }
    }
}
