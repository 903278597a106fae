//! The queue-pair offer, without I/O: what a rank tells each peer before their RDMA link
//! carries anything, its byte encoding (validated on decode: these bytes come from the
//! network), and the decision each side takes from the two offers.
//!
//! The exchange itself is nexar's negotiation driver ([`nexar::backend::negotiate`]), which
//! every back end shares: round one carries an offer (this rank's queue pair and receive
//! ring) or a refusal (no device, wrong fabric); where both offered and the offers fit
//! ([`decide`]), each side connects its queue pair and round two says whether it did; only
//! when both are ready does the link switch to RDMA. Any other outcome keeps the link on
//! QUIC, on both sides.

/// Version of the offer's encoding; ranks with different versions fall back to QUIC.
pub const SETUP_VERSION: u16 = 2;

const MAGIC: &[u8; 4] = b"NXRD";
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
}

/// Bytes of an encoded offer after the header.
const OFFER_LEN: usize = 1 + 2 + 1 + 16 + 4 + 4 + 1 + 8 + 4 + 2 + 4;

impl QpOffer {
    /// The offer's bytes.
    ///
    /// ```
    /// use nexar_rdma::setup::{FabricKind, QpOffer};
    /// let offer = QpOffer { fabric: FabricKind::Emulated, lid: 0, gid: None, qpn: 1, psn: 2, mtu: 5,
    ///                       ring_addr: 4096, rkey: 3, slots: 4, slot_size: 4096 };
    /// assert_eq!(QpOffer::decode(&offer.encode()).unwrap(), offer);
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(6 + OFFER_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&SETUP_VERSION.to_le_bytes());
        out.push(self.fabric as u8);
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.push(u8::from(self.gid.is_some()));
        out.extend_from_slice(&self.gid.unwrap_or_default());
        out.extend_from_slice(&self.qpn.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.push(self.mtu);
        out.extend_from_slice(&self.ring_addr.to_le_bytes());
        out.extend_from_slice(&self.rkey.to_le_bytes());
        out.extend_from_slice(&self.slots.to_le_bytes());
        out.extend_from_slice(&self.slot_size.to_le_bytes());
        out
    }

    /// Reads an offer from untrusted bytes, checking every field.
    ///
    /// ```
    /// use nexar_rdma::setup::QpOffer;
    /// let err = QpOffer::decode(b"NXRD\x09\x00\x03").unwrap_err();
    /// assert!(err.contains("version 9"));
    /// ```
    pub fn decode(bytes: &[u8]) -> Result<QpOffer, String> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != MAGIC {
            return Err("not an RDMA offer (bad magic)".into());
        }
        let version = r.u16()?;
        if version != SETUP_VERSION {
            return Err(format!("offer version {version}, this rank speaks version {SETUP_VERSION}"));
        }
        let offer = read_offer(&mut r)?;
        if r.at != bytes.len() {
            return Err(format!("{} bytes after the offer", bytes.len() - r.at));
        }
        Ok(offer)
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
}

/// Whether this rank's offer and the peer's fit (`peer` names it in reasons): the peer's
/// queue pair to connect to, or why the link stays on QUIC. Both sides reach the same verdict:
/// they see the same two offers.
///
/// ```
/// use nexar_rdma::setup::{FabricKind, QpOffer, decide};
/// let ours = QpOffer { fabric: FabricKind::Emulated, lid: 0, gid: None, qpn: 1, psn: 2, mtu: 5,
///                      ring_addr: 4096, rkey: 3, slots: 4, slot_size: 4096 };
/// let theirs = QpOffer { fabric: FabricKind::Verbs, ..ours };
/// assert!(decide(&ours, &theirs, 1).unwrap_err().contains("rank 1 is on Verbs"));
/// ```
pub fn decide(mine: &QpOffer, remote: &QpOffer, peer: usize) -> Result<QpOffer, String> {
    if mine.fabric != remote.fabric {
        Err(format!("rank {peer} is on {:?}, this rank on {:?}", remote.fabric, mine.fabric))
    } else if (mine.slots, mine.slot_size) != (remote.slots, remote.slot_size) {
        Err(format!(
            "rank {peer} has a ring of {}×{} bytes, this rank {}×{}",
            remote.slots, remote.slot_size, mine.slots, mine.slot_size
        ))
    } else {
        Ok(*remote)
    }
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
        }
    }

    #[test]
    fn offers_round_trip() {
        for o in [offer(), QpOffer { gid: None, ..offer() }] {
            assert_eq!(QpOffer::decode(&o.encode()), Ok(o));
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
            let err = QpOffer::decode(&o.encode()).unwrap_err();
            assert!(err.to_lowercase().contains(want), "{err:?} should mention {want:?}");
        }
    }

    #[test]
    fn truncated_padded_and_foreign_bytes_are_refused() {
        let good = offer().encode();
        for cut in 0..good.len() {
            assert!(QpOffer::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut padded = good.clone();
        padded.push(0);
        assert!(QpOffer::decode(&padded).unwrap_err().contains("after the offer"));
        assert!(QpOffer::decode(b"HTTP/1.1 200").unwrap_err().contains("magic"));
    }

    #[test]
    fn both_sides_decide_alike() {
        let (a, b) = (offer(), QpOffer { qpn: 0x34, ..offer() });
        assert_eq!(decide(&a, &b, 1), Ok(b));
        assert_eq!(decide(&b, &a, 0), Ok(a));
        let emulated = QpOffer { fabric: FabricKind::Emulated, ..offer() };
        assert!(decide(&a, &emulated, 1).unwrap_err().contains("Emulated"));
        assert!(decide(&emulated, &a, 0).is_err());
        let small = QpOffer { slots: 4, ..offer() };
        assert!(decide(&a, &small, 1).unwrap_err().contains("4×"));
    }

    proptest! {
        #[test]
        fn random_and_mutated_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..96),
                                               flip in 0usize..64, xor in 1u8..=255) {
            let _ = QpOffer::decode(&bytes);
            let mut good = offer().encode();
            let i = flip % good.len();
            good[i] ^= xor;
            if let Ok(o) = QpOffer::decode(&good) {
                prop_assert!(check_offer(&o).is_ok());
            }
        }
    }
}
