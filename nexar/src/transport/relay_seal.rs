//! End-to-end protection of relayed messages on sparse topologies.
//!
//! A relay envelope travels over the links of other members, and each of them could alter or
//! invent one: the hop-by-hop TLS sessions only prove which neighbour handed it over. So the
//! original sender seals the envelope's body with a key it shares with the destination alone,
//! and the destination opens it before it believes the sender named in the envelope.
//!
//! Every rank holds an X25519 key pair of its own ([`RelaySecret`]). The public halves reach the
//! other ranks in the seed's peer table (or, in an in-process cluster, directly), where the seed
//! vouches for them exactly as it vouches for each rank's TLS key pin. The key of a pair of ranks
//! is HKDF-SHA256 over their X25519 agreement, bound to both ranks and both public keys, so no
//! third member can compute it. Bodies are sealed with AES-256-GCM: a relaying member can
//! neither read nor alter a relayed message, nor forge one from another rank.
//!
//! Each sealed envelope carries a sequence number, counted per destination and lane from 1.
//! It forms the nonce (with the lane and the direction), so no nonce repeats under a key, and the
//! receiver keeps a window of the numbers it has accepted per source and lane, so a relay that
//! replays an envelope has it dropped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use aws_lc_rs::agreement::{self, PrivateKey, UnparsedPublicKey, X25519};
use aws_lc_rs::hkdf::{HKDF_SHA256, Salt};

use crate::proto::lane::Lane;

/// The length of a relay public key (X25519).
pub const RELAY_KEY_LEN: usize = 32;

/// How many sequence numbers behind the highest one accepted an envelope may arrive and still
/// be taken (envelopes of one lane can overtake each other when a route changes).
const REPLAY_WINDOW: u64 = 128;

/// A rank's public relay key, as the peer table carries it.
pub type RelayPublicKey = [u8; RELAY_KEY_LEN];

/// A rank's own relay key pair. The private half never leaves the process.
pub struct RelaySecret {
    private: PrivateKey,
    public: RelayPublicKey,
}

impl std::fmt::Debug for RelaySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelaySecret").field("public", &hex_prefix(&self.public)).finish_non_exhaustive()
    }
}

fn hex_prefix(bytes: &[u8]) -> String {
    bytes.iter().take(4).map(|b| format!("{b:02x}")).collect::<String>() + "…"
}

impl RelaySecret {
    /// A fresh key pair.
    pub fn generate() -> Result<RelaySecret, String> {
        let private = PrivateKey::generate(&X25519).map_err(|_| "could not generate a relay key".to_string())?;
        let public = private.compute_public_key().map_err(|_| "could not derive a relay public key".to_string())?;
        let public = RelayPublicKey::try_from(public.as_ref())
            .map_err(|_| format!("an X25519 public key of {} bytes", public.as_ref().len()))?;
        Ok(RelaySecret { private, public })
    }

    /// The public half, for the peer table.
    pub fn public(&self) -> RelayPublicKey {
        self.public
    }
}

/// Why a relayed envelope was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    /// The peer table gave no relay key for the rank.
    #[error("no relay key is known for rank {0}")]
    NoKey(u32),
    /// The envelope arrived unsealed where every relayed message must be sealed.
    #[error("the envelope is not sealed, and every relayed message to this rank must be")]
    Unsealed,
    /// The envelope is sealed where this rank holds no relay keys.
    #[error("the envelope is sealed, but this rank holds no relay keys")]
    Unexpected,
    /// The body did not authenticate under the pair's key.
    #[error("the body does not authenticate as rank {src}'s (altered on the way, or forged by a relay)")]
    Forged {
        /// The rank the envelope claims.
        src: u32,
    },
    /// The sequence number was accepted before, or is too old to tell.
    #[error("sequence number {seq} from rank {src} on lane {lane} is a replay or too old")]
    Replayed {
        /// The rank the envelope claims.
        src: u32,
        /// The lane.
        lane: u8,
        /// The envelope's sequence number.
        seq: u64,
    },
    /// The cryptographic library failed.
    #[error("relay key agreement or sealing failed for rank {0}")]
    Crypto(u32),
}

/// The numbers accepted from one source on one lane: the highest, and which of the
/// [`REPLAY_WINDOW`] below it.
#[derive(Default, Clone, Copy)]
struct ReplayWindow {
    highest: u64,
    seen: u128,
}

impl ReplayWindow {
    /// Accepts `seq` once; false for a number seen before or too far behind.
    fn accept(&mut self, seq: u64) -> bool {
        if seq == 0 {
            return false;
        }
        if seq > self.highest {
            let shift = seq - self.highest;
            self.seen = if shift >= REPLAY_WINDOW { 0 } else { self.seen << shift };
            self.seen |= 1;
            self.highest = seq;
            return true;
        }
        let behind = self.highest - seq;
        if behind >= REPLAY_WINDOW || self.seen & (1u128 << behind) != 0 {
            return false;
        }
        self.seen |= 1u128 << behind;
        true
    }
}

/// One rank's relay keys: its own secret, every rank's public key, the pair keys derived on
/// first use, the next sequence number per destination and lane, and the replay windows per
/// source and lane.
pub struct RelaySeals {
    local: u32,
    secret: RelaySecret,
    publics: Vec<Option<RelayPublicKey>>,
    pairs: Vec<OnceLock<Option<LessSafeKey>>>,
    next_seq: Vec<[AtomicU64; Lane::COUNT]>,
    windows: Mutex<Vec<[ReplayWindow; Lane::COUNT]>>,
}

impl std::fmt::Debug for RelaySeals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelaySeals").field("local", &self.local).finish_non_exhaustive()
    }
}

impl RelaySeals {
    /// The seals of rank `local`, whose key pair is `secret`, in a cluster whose ranks' public
    /// keys are `publics` (by rank; `None` for a rank with none).
    pub fn new(local: u32, secret: RelaySecret, publics: Vec<Option<RelayPublicKey>>) -> RelaySeals {
        let n = publics.len();
        RelaySeals {
            local,
            secret,
            publics,
            pairs: (0..n).map(|_| OnceLock::new()).collect(),
            next_seq: (0..n).map(|_| std::array::from_fn(|_| AtomicU64::new(1))).collect(),
            windows: Mutex::new(vec![[ReplayWindow::default(); Lane::COUNT]; n]),
        }
    }

    /// The key this rank shares with `peer`, derived on first use.
    fn pair(&self, peer: u32) -> Result<&LessSafeKey, SealError> {
        let slot = self.pairs.get(peer as usize).ok_or(SealError::NoKey(peer))?;
        slot.get_or_init(|| self.derive(peer)).as_ref().ok_or(SealError::NoKey(peer))
    }

    fn derive(&self, peer: u32) -> Option<LessSafeKey> {
        let theirs = self.publics.get(peer as usize).copied().flatten()?;
        let ours = self.secret.public;
        // Bound to both ranks and both keys, lower rank first, so both sides derive the same.
        let (lo, hi) =
            if self.local < peer { ((self.local, ours), (peer, theirs)) } else { ((peer, theirs), (self.local, ours)) };
        let mut info = Vec::with_capacity(8 + 2 * RELAY_KEY_LEN);
        info.extend_from_slice(&lo.0.to_be_bytes());
        info.extend_from_slice(&hi.0.to_be_bytes());
        info.extend_from_slice(&lo.1);
        info.extend_from_slice(&hi.1);
        let peer_key = UnparsedPublicKey::new(&X25519, theirs);
        let key = agreement::agree(&self.secret.private, peer_key, (), |shared| {
            let prk = Salt::new(HKDF_SHA256, b"nexar relay seal v1").extract(shared);
            let info = [info.as_slice()];
            let okm = prk.expand(&info, &AES_256_GCM).map_err(|_| ())?;
            let mut bytes = [0u8; 32];
            okm.fill(&mut bytes).map_err(|_| ())?;
            UnboundKey::new(&AES_256_GCM, &bytes).map_err(|_| ())
        });
        match key {
            Ok(key) => Some(LessSafeKey::new(key)),
            Err(()) => {
                tracing::warn!(peer, "relay key agreement failed (an invalid public key in the peer table)");
                None
            }
        }
    }

    /// Seals `body` (the carried frames) from this rank to `dst` on `lane`, appending the tag.
    /// Returns the envelope's sequence number.
    pub fn seal(&self, dst: u32, lane: u8, body: &mut Vec<u8>) -> Result<u64, SealError> {
        let key = self.pair(dst)?;
        let counters = self.next_seq.get(dst as usize).ok_or(SealError::NoKey(dst))?;
        let counter = counters.get(lane as usize).ok_or(SealError::Crypto(dst))?;
        let seq = counter.fetch_add(1, Ordering::Relaxed);
        let aad = aad(self.local, dst, lane, seq);
        key.seal_in_place_append_tag(nonce(self.local, dst, lane, seq), Aad::from(&aad[..]), body)
            .map_err(|_| SealError::Crypto(dst))?;
        Ok(seq)
    }

    /// Opens `body`, sealed by `src` for this rank on `lane` with number `seq`, in place: on
    /// success it holds the carried frames (the tag removed).
    pub fn open(&self, src: u32, lane: u8, seq: u64, body: &mut Vec<u8>) -> Result<(), SealError> {
        if seq == 0 {
            return Err(SealError::Unsealed);
        }
        let key = self.pair(src)?;
        let aad = aad(src, self.local, lane, seq);
        let plain = key
            .open_in_place(nonce(src, self.local, lane, seq), Aad::from(&aad[..]), body)
            .map_err(|_| SealError::Forged { src })?
            .len();
        // Only an authentic envelope moves the window, so a forged one cannot push out real ones.
        let mut windows = crate::sync::lock(&self.windows);
        let window =
            windows.get_mut(src as usize).and_then(|w| w.get_mut(lane as usize)).ok_or(SealError::NoKey(src))?;
        if !window.accept(seq) {
            return Err(SealError::Replayed { src, lane, seq });
        }
        body.truncate(plain);
        Ok(())
    }
}

/// What the tag covers besides the body: who sent it to whom, on which lane, with which number.
fn aad(src: u32, dst: u32, lane: u8, seq: u64) -> [u8; 17] {
    let mut out = [0u8; 17];
    out[..4].copy_from_slice(&src.to_be_bytes());
    out[4..8].copy_from_slice(&dst.to_be_bytes());
    out[8] = lane;
    out[9..].copy_from_slice(&seq.to_be_bytes());
    out
}

/// The nonce of envelope `seq` from `src` to `dst` on `lane`: the two directions of a pair and
/// its lanes count separately, so no nonce repeats under the pair's key.
fn nonce(src: u32, dst: u32, lane: u8, seq: u64) -> Nonce {
    let mut bytes = [0u8; NONCE_LEN];
    bytes[0] = lane;
    bytes[1] = u8::from(src < dst);
    bytes[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seals for a cluster of `n` ranks, each knowing every public key.
    fn cluster(n: u32) -> Vec<RelaySeals> {
        let secrets: Vec<RelaySecret> = (0..n).map(|_| RelaySecret::generate().unwrap()).collect();
        let publics: Vec<Option<RelayPublicKey>> = secrets.iter().map(|s| Some(s.public())).collect();
        secrets.into_iter().enumerate().map(|(r, s)| RelaySeals::new(r as u32, s, publics.clone())).collect()
    }

    #[test]
    fn a_sealed_body_opens_only_at_its_destination_as_its_sender() {
        let ranks = cluster(3);
        let mut body = b"carried frames".to_vec();
        let seq = ranks[0].seal(2, 3, &mut body).unwrap();
        assert_eq!(body.len() as u64, 14 + crate::proto::relay::SEAL_TAG_LEN);
        assert_ne!(&body[..14], b"carried frames", "the relay cannot read it");
        // Rank 1, the relay, cannot pass it off as its own or open it as rank 0's.
        assert_eq!(ranks[2].open(1, 3, seq, &mut body.clone()), Err(SealError::Forged { src: 1 }));
        assert_eq!(ranks[1].open(0, 3, seq, &mut body.clone()), Err(SealError::Forged { src: 0 }));
        // Nor move it to another lane, or renumber it.
        assert_eq!(ranks[2].open(0, 2, seq, &mut body.clone()), Err(SealError::Forged { src: 0 }));
        assert_eq!(ranks[2].open(0, 3, seq + 1, &mut body.clone()), Err(SealError::Forged { src: 0 }));
        let mut flipped = body.clone();
        flipped[3] ^= 1;
        assert_eq!(ranks[2].open(0, 3, seq, &mut flipped), Err(SealError::Forged { src: 0 }));
        let mut opened = body.clone();
        ranks[2].open(0, 3, seq, &mut opened).unwrap();
        assert_eq!(opened, b"carried frames");
        // A replay of the same envelope is refused.
        assert_eq!(ranks[2].open(0, 3, seq, &mut body), Err(SealError::Replayed { src: 0, lane: 3, seq }));
    }

    #[test]
    fn both_directions_of_a_pair_share_a_key_but_never_a_nonce() {
        let ranks = cluster(2);
        let (mut a, mut b) = (b"same".to_vec(), b"same".to_vec());
        let sa = ranks[0].seal(1, 0, &mut a).unwrap();
        let sb = ranks[1].seal(0, 0, &mut b).unwrap();
        assert_eq!(sa, sb);
        assert_ne!(a, b, "two directions under one key must use different nonces");
        // An envelope reflected back to its sender does not open as the other's.
        assert_eq!(ranks[0].open(1, 0, sa, &mut a.clone()), Err(SealError::Forged { src: 1 }));
        ranks[1].open(0, 0, sa, &mut a).unwrap();
        ranks[0].open(1, 0, sb, &mut b).unwrap();
    }

    #[test]
    fn envelopes_may_overtake_each_other_within_the_window_but_never_repeat() {
        let mut w = ReplayWindow::default();
        assert!(!w.accept(0));
        assert!(w.accept(5));
        assert!(w.accept(3));
        assert!(!w.accept(3));
        assert!(w.accept(4));
        assert!(w.accept(5 + REPLAY_WINDOW - 1));
        assert!(!w.accept(5), "seen");
        assert!(!w.accept(5 + REPLAY_WINDOW - 1 - REPLAY_WINDOW), "too old");
        assert!(w.accept(1000));
        assert!(!w.accept(1000 - REPLAY_WINDOW));
        assert!(w.accept(1000 - REPLAY_WINDOW + 1));
    }

    #[test]
    fn a_rank_without_a_published_key_gets_no_envelopes() {
        let mut secrets: Vec<RelaySecret> = (0..2).map(|_| RelaySecret::generate().unwrap()).collect();
        let publics = vec![Some(secrets[0].public()), None];
        let zero = RelaySeals::new(0, secrets.remove(0), publics);
        assert_eq!(zero.seal(1, 0, &mut Vec::new()), Err(SealError::NoKey(1)));
        assert_eq!(zero.seal(7, 0, &mut Vec::new()), Err(SealError::NoKey(7)));
        assert_eq!(zero.open(1, 0, 1, &mut vec![0; 16]), Err(SealError::NoKey(1)));
        assert_eq!(zero.open(1, 0, 0, &mut vec![0; 16]), Err(SealError::Unsealed));
    }
}
