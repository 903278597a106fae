//! The lane's record key: AEGIS-128X2 (libaegis), or AES-128-GCM from the implementation
//! [`LaneAes`] picks, aws-lc's or ring's ([`LaneAead`]). The two AES-GCMs produce the same
//! records (RFC 5116 AES-128-GCM, 12-byte nonce, 16-byte tag), so the two ranks of a lane need
//! not use the same one; the cipher itself they must share ([`crate::LaneCipher`]).
//!
//! AEGIS-128X2 and aws-lc seal out of place and open into a separate buffer; ring's API works
//! in place only, so its out-of-place calls copy first ([`copy_bytes`]; a record is at most
//! 256 KiB, so the copy stays in the core's L2 cache and the in-place pass reads it from
//! there).

use std::fmt;

use crate::config::{LaneAes, LaneCipher};
use crate::transport::copy::copy_bytes;

/// Bytes of a key (AES-128's, AEGIS-128X2's).
pub(crate) const KEY_LEN: usize = 16;
/// Bytes of a nonce.
pub(crate) const NONCE_LEN: usize = 12;
/// Bytes of a tag.
const TAG_LEN: usize = 16;

/// A record failed authentication, or the implementation refused the call (a record longer
/// than the cipher allows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the lane's cipher refused the record")]
pub(crate) struct Refused;

/// What seals a lane's records: AEGIS-128X2, or AES-128-GCM from an implementation resolved
/// for this CPU ([`LaneAes::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LaneAead {
    Aegis128X2,
    AesGcm(LaneAes),
}

impl LaneAead {
    /// The cipher `cipher` names, with AES-GCM from `aes` resolved on this CPU.
    pub fn new(cipher: LaneCipher, aes: LaneAes) -> LaneAead {
        match cipher {
            LaneCipher::Aegis128X2 => LaneAead::Aegis128X2,
            LaneCipher::Aes128Gcm => LaneAead::AesGcm(aes.resolve()),
        }
    }

    /// Whether a payload read straight into its destination is opened there at no extra cost
    /// ([`super::landing`]): AEGIS-128X2 opens in place as fast as out of place, and ring's
    /// AES-GCM opens in place only. aws-lc's opens out of place only; a lane with it leaves a
    /// payload's records sealed and opens them straight into the destination instead.
    pub fn lands(self) -> bool {
        match self {
            LaneAead::Aegis128X2 => true,
            LaneAead::AesGcm(aes) => aes.resolve() == LaneAes::Ring,
        }
    }

    /// The byte that sets the cipher's keys apart from another cipher's in the lane's key
    /// derivation, so that no key is ever used with two ciphers.
    pub fn context_byte(self) -> u8 {
        match self {
            LaneAead::AesGcm(_) => 0,
            LaneAead::Aegis128X2 => 1,
        }
    }
}

impl fmt::Display for LaneAead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LaneAead::Aegis128X2 => f.write_str("AEGIS-128X2"),
            LaneAead::AesGcm(aes) => write!(f, "AES-GCM from {}", aes.resolve()),
        }
    }
}

/// A record key: AEGIS-128X2's, or an AES-128-GCM key of one implementation (ring's holds
/// its expanded key and GHASH tables inline, about 550 bytes, so it is boxed).
pub(crate) enum LaneKey {
    AwsLc(aws_lc_rs::aead::LessSafeKey),
    Ring(Box<ring::aead::LessSafeKey>),
    /// AEGIS expands its key anew for each record, a few rounds of its state update.
    Aegis([u8; KEY_LEN]),
}

impl LaneKey {
    /// The key `bytes` for `aead`.
    pub fn new(aead: LaneAead, bytes: &[u8; KEY_LEN]) -> Result<LaneKey, Refused> {
        Ok(match aead {
            LaneAead::Aegis128X2 => LaneKey::Aegis(*bytes),
            LaneAead::AesGcm(aes) => match aes.resolve() {
                LaneAes::Auto | LaneAes::AwsLc => LaneKey::AwsLc(aws_lc_rs::aead::LessSafeKey::new(
                    aws_lc_rs::aead::UnboundKey::new(&aws_lc_rs::aead::AES_128_GCM, bytes).map_err(|_| Refused)?,
                )),
                LaneAes::Ring => LaneKey::Ring(Box::new(ring::aead::LessSafeKey::new(
                    ring::aead::UnboundKey::new(&ring::aead::AES_128_GCM, bytes).map_err(|_| Refused)?,
                ))),
            },
        })
    }

    /// Whether [`open_into`](Self::open_into) decrypts straight from one buffer into
    /// another (aws-lc, AEGIS), rather than copying the ciphertext over first (ring).
    pub fn opens_out_of_place(&self) -> bool {
        !matches!(self, LaneKey::Ring(_))
    }

    /// Encrypts `plain` into `body` (as long) and writes the tag into `tag`.
    pub fn seal_into(
        &self,
        nonce: [u8; NONCE_LEN],
        aad: &[u8],
        plain: &[u8],
        body: &mut [u8],
        tag: &mut [u8],
    ) -> Result<(), Refused> {
        match self {
            LaneKey::AwsLc(key) => key
                .seal_out_of_place_scatter(aws_nonce(nonce), aws_lc_rs::aead::Aad::from(aad), plain, body, &[], tag)
                .map_err(|_| Refused),
            LaneKey::Ring(_) => {
                copy_bytes(body, plain);
                tag.copy_from_slice(&self.seal_in_place(nonce, aad, body)?);
                Ok(())
            }
            LaneKey::Aegis(key) => {
                let mut sealing = Aegis::new(key, &aegis_nonce(nonce)).encryptor(aad);
                sealing.update(plain, body);
                tag.copy_from_slice(&sealing.finalize());
                Ok(())
            }
        }
    }

    /// Encrypts the pieces `pieces` hands its callback, one after another, into `body` (as
    /// long as they are together) and writes the tag into `tag`: AEGIS encrypts each piece
    /// where it lies; AES-GCM (whose APIs take one input) has them copied into `body` first.
    pub fn seal_pieces<'p>(
        &self,
        nonce: [u8; NONCE_LEN],
        aad: &[u8],
        body: &mut [u8],
        tag: &mut [u8],
        pieces: impl FnOnce(&mut dyn FnMut(&'p [u8])),
    ) -> Result<(), Refused> {
        let mut at = 0;
        match self {
            LaneKey::Aegis(key) => {
                let mut sealing = Aegis::new(key, &aegis_nonce(nonce)).encryptor(aad);
                pieces(&mut |piece: &[u8]| {
                    sealing.update(piece, &mut body[at..at + piece.len()]);
                    at += piece.len();
                });
                tag.copy_from_slice(&sealing.finalize());
            }
            LaneKey::AwsLc(_) | LaneKey::Ring(_) => {
                pieces(&mut |piece: &[u8]| {
                    copy_bytes(&mut body[at..at + piece.len()], piece);
                    at += piece.len();
                });
                tag.copy_from_slice(&self.seal_in_place(nonce, aad, body)?);
            }
        }
        if at == body.len() { Ok(()) } else { Err(Refused) }
    }

    /// Encrypts `body` in place and returns its tag.
    pub fn seal_in_place(&self, nonce: [u8; NONCE_LEN], aad: &[u8], body: &mut [u8]) -> Result<[u8; TAG_LEN], Refused> {
        let mut out = [0u8; TAG_LEN];
        match self {
            LaneKey::AwsLc(key) => {
                let tag = key
                    .seal_in_place_separate_tag(aws_nonce(nonce), aws_lc_rs::aead::Aad::from(aad), body)
                    .map_err(|_| Refused)?;
                out.copy_from_slice(tag.as_ref());
            }
            LaneKey::Ring(key) => {
                let tag = key
                    .seal_in_place_separate_tag(ring_nonce(nonce), ring::aead::Aad::from(aad), body)
                    .map_err(|_| Refused)?;
                out.copy_from_slice(tag.as_ref());
            }
            LaneKey::Aegis(key) => out = Aegis::new(key, &aegis_nonce(nonce)).encrypt_in_place(body, aad),
        }
        Ok(out)
    }

    /// Authenticates and decrypts `record` (ciphertext, then its tag) in place: its plaintext,
    /// the record less the tag.
    pub fn open_in_place<'r>(
        &self,
        nonce: [u8; NONCE_LEN],
        aad: &[u8],
        record: &'r mut [u8],
    ) -> Result<&'r mut [u8], Refused> {
        match self {
            LaneKey::AwsLc(key) => {
                key.open_in_place(aws_nonce(nonce), aws_lc_rs::aead::Aad::from(aad), record).map_err(|_| Refused)
            }
            LaneKey::Ring(key) => {
                key.open_in_place(ring_nonce(nonce), ring::aead::Aad::from(aad), record).map_err(|_| Refused)
            }
            LaneKey::Aegis(_) => {
                let len = record.len().checked_sub(TAG_LEN).ok_or(Refused)?;
                let (body, tag) = record.split_at_mut(len);
                let tag: [u8; TAG_LEN] = (&*tag).try_into().map_err(|_| Refused)?;
                self.open_in_place_tagged(nonce, aad, &tag, body)?;
                Ok(body)
            }
        }
    }

    /// Authenticates `body` (ciphertext whose tag is `tag`) and decrypts it in place. After an
    /// error `body` is zeroed. aws-lc opens out of place only, so there the ciphertext is
    /// copied aside first (a lane with aws-lc leaves records sealed instead, and never calls
    /// this on its path).
    pub fn open_in_place_tagged(
        &self,
        nonce: [u8; NONCE_LEN],
        aad: &[u8],
        tag: &[u8; TAG_LEN],
        body: &mut [u8],
    ) -> Result<(), Refused> {
        let opened = match self {
            LaneKey::AwsLc(_) => {
                let cipher = body.to_vec();
                return self.open_into(nonce, aad, &cipher, tag, body);
            }
            LaneKey::Ring(key) => key
                .open_in_place_separate_tag(
                    ring_nonce(nonce),
                    ring::aead::Aad::from(aad),
                    ring::aead::Tag::from(*tag),
                    body,
                    0..,
                )
                .map(|_| ())
                .map_err(|_| Refused),
            LaneKey::Aegis(key) => {
                Aegis::new(key, &aegis_nonce(nonce)).decrypt_in_place(body, tag, aad).map_err(|_| Refused)
            }
        };
        if opened.is_err() {
            body.fill(0);
        }
        opened
    }

    /// Authenticates `cipher` with `tag` and decrypts it into `out` (as long). After an error
    /// `out` is zeroed.
    pub fn open_into(
        &self,
        nonce: [u8; NONCE_LEN],
        aad: &[u8],
        cipher: &[u8],
        tag: &[u8; TAG_LEN],
        out: &mut [u8],
    ) -> Result<(), Refused> {
        let opened = match self {
            LaneKey::AwsLc(key) => key
                .open_separate_gather(aws_nonce(nonce), aws_lc_rs::aead::Aad::from(aad), cipher, tag, out)
                .map_err(|_| Refused),
            LaneKey::Ring(key) => {
                copy_bytes(out, cipher);
                key.open_in_place_separate_tag(
                    ring_nonce(nonce),
                    ring::aead::Aad::from(aad),
                    ring::aead::Tag::from(*tag),
                    out,
                    0..,
                )
                .map(|_| ())
                .map_err(|_| Refused)
            }
            LaneKey::Aegis(key) => {
                let mut opening = Aegis::new(key, &aegis_nonce(nonce)).decryptor(aad, out);
                opening.update(cipher).and_then(|()| opening.finalize(tag)).map(|_| ()).map_err(|_| Refused)
            }
        };
        if opened.is_err() {
            out.fill(0);
        }
        opened
    }
}

fn aws_nonce(nonce: [u8; NONCE_LEN]) -> aws_lc_rs::aead::Nonce {
    aws_lc_rs::aead::Nonce::assume_unique_for_key(nonce)
}

/// AEGIS-128X2 with a 16-byte tag.
type Aegis = aegis::aegis128x2::Aegis128X2<TAG_LEN>;

/// The lane's 12-byte nonce as AEGIS-128X2's 16-byte one (zeros after it).
fn aegis_nonce(nonce: [u8; NONCE_LEN]) -> [u8; 16] {
    let mut wide = [0u8; 16];
    wide[..NONCE_LEN].copy_from_slice(&nonce);
    wide
}

fn ring_nonce(nonce: [u8; NONCE_LEN]) -> ring::aead::Nonce {
    ring::aead::Nonce::assume_unique_for_key(nonce)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; KEY_LEN] = [9; KEY_LEN];
    const NONCE: [u8; NONCE_LEN] = [3; NONCE_LEN];

    fn aes_gcm(aes: LaneAes) -> LaneKey {
        LaneKey::new(LaneAead::AesGcm(aes), &KEY).unwrap()
    }

    fn aegis() -> LaneKey {
        LaneKey::new(LaneAead::Aegis128X2, &KEY).unwrap()
    }

    /// Each way of sealing and opening: the AES-GCM of either engine opened by either, and
    /// AEGIS-128X2 by itself.
    fn pairs() -> [(LaneKey, LaneKey); 5] {
        let (aws, ring) = (LaneAes::AwsLc, LaneAes::Ring);
        [
            (aes_gcm(aws), aes_gcm(ring)),
            (aes_gcm(ring), aes_gcm(aws)),
            (aes_gcm(aws), aes_gcm(aws)),
            (aes_gcm(ring), aes_gcm(ring)),
            (aegis(), aegis()),
        ]
    }

    #[test]
    fn what_one_engine_seals_the_other_opens_and_a_changed_byte_fails_both() {
        let plain: Vec<u8> = (0..70_001u32).map(|i| (i * 7 % 251) as u8).collect();
        for (sealer, opener) in &pairs() {
            let mut body = vec![0u8; plain.len()];
            let mut tag = [0u8; TAG_LEN];
            sealer.seal_into(NONCE, b"head", &plain, &mut body, &mut tag).unwrap();
            let mut in_place = plain.clone();
            assert_eq!(sealer.seal_in_place(NONCE, b"head", &mut in_place).unwrap(), tag, "same record both ways");
            assert_eq!(in_place, body);

            let mut out = vec![0u8; plain.len()];
            opener.open_into(NONCE, b"head", &body, &tag, &mut out).unwrap();
            assert!(out == plain);
            let mut record = [body.as_slice(), tag.as_slice()].concat();
            assert!(opener.open_in_place(NONCE, b"head", &mut record).unwrap() == plain.as_slice());

            let mut forged = body.clone();
            forged[12_345] ^= 1;
            let mut out = vec![7u8; plain.len()];
            assert_eq!(opener.open_into(NONCE, b"head", &forged, &tag, &mut out), Err(Refused));
            assert!(out.iter().all(|&b| b == 0), "a forged record leaves zeros, never its decryption");
            assert_eq!(opener.open_into(NONCE, b"hea!", &body, &tag, &mut out), Err(Refused), "other associated data");
            let mut record = [forged.as_slice(), tag.as_slice()].concat();
            assert_eq!(opener.open_in_place(NONCE, b"head", &mut record), Err(Refused));
            let mut in_place = body.clone();
            opener.open_in_place_tagged(NONCE, b"head", &tag, &mut in_place).unwrap();
            assert!(in_place == plain);
            let mut in_place = forged.clone();
            assert_eq!(opener.open_in_place_tagged(NONCE, b"head", &tag, &mut in_place), Err(Refused));
            assert!(in_place.iter().all(|&b| b == 0), "a forged record opened in place leaves zeros");
        }
    }

    #[test]
    fn a_record_sealed_from_pieces_is_the_record_of_their_concatenation() {
        let plain: Vec<u8> = (0..50_000u32).map(|i| (i * 13 % 253) as u8).collect();
        let pieces = [&plain[..7], &plain[7..40_007], &plain[40_007..]];
        for (key, _) in &pairs() {
            let (mut whole, mut whole_tag) = (vec![0u8; plain.len()], [0u8; TAG_LEN]);
            key.seal_into(NONCE, b"head", &plain, &mut whole, &mut whole_tag).unwrap();
            let (mut body, mut tag) = (vec![0u8; plain.len()], [0u8; TAG_LEN]);
            key.seal_pieces(NONCE, b"head", &mut body, &mut tag, |each| pieces.iter().for_each(|p| each(p))).unwrap();
            assert!(body == whole && tag == whole_tag);
            let short = key.seal_pieces(NONCE, b"head", &mut body, &mut tag, |each| each(&plain[..100]));
            assert_eq!(short, Err(Refused), "pieces that do not fill the record");
        }
    }

    #[test]
    fn a_record_sealed_with_one_cipher_does_not_open_with_the_other() {
        let plain = vec![5u8; 4096];
        for (sealer, opener) in [(aegis(), aes_gcm(LaneAes::Ring)), (aes_gcm(LaneAes::AwsLc), aegis())] {
            let mut body = plain.clone();
            let tag = sealer.seal_in_place(NONCE, b"head", &mut body).unwrap();
            let mut out = vec![7u8; plain.len()];
            assert_eq!(opener.open_into(NONCE, b"head", &body, &tag, &mut out), Err(Refused));
            assert!(out.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn where_a_payload_lands_and_how_each_cipher_names_itself() {
        assert!(LaneAead::Aegis128X2.lands());
        assert!(LaneAead::AesGcm(LaneAes::Ring).lands());
        assert!(!LaneAead::AesGcm(LaneAes::AwsLc).lands());
        assert!(aegis().opens_out_of_place() && aes_gcm(LaneAes::AwsLc).opens_out_of_place());
        assert!(!aes_gcm(LaneAes::Ring).opens_out_of_place());
        assert_eq!(LaneAead::Aegis128X2.to_string(), "AEGIS-128X2");
        assert_eq!(LaneAead::AesGcm(LaneAes::Ring).to_string(), "AES-GCM from ring");
        assert_eq!(LaneAead::new(LaneCipher::Aes128Gcm, LaneAes::AwsLc), LaneAead::AesGcm(LaneAes::AwsLc));
        assert_eq!(LaneAead::new(LaneCipher::Aegis128X2, LaneAes::Ring), LaneAead::Aegis128X2);
        assert_ne!(LaneAead::Aegis128X2.context_byte(), LaneAead::AesGcm(LaneAes::Ring).context_byte());
    }
}
