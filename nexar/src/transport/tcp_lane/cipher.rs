//! The lane's AES-128-GCM key, from the implementation [`LaneAes`] picks: aws-lc's or ring's.
//! Both produce the same records (RFC 5116 AES-128-GCM, 12-byte nonce, 16-byte tag), so the
//! two ranks of a lane need not use the same one.
//!
//! aws-lc seals out of place and opens into a separate buffer; ring's API works in place only,
//! so its out-of-place calls copy first ([`copy_bytes`]; a record is at most 256 KiB, so the
//! copy stays in the core's L2 cache and the in-place pass reads it from there).

use crate::config::LaneAes;
use crate::transport::copy::copy_bytes;

/// Bytes of an AES-128 key.
pub(crate) const KEY_LEN: usize = 16;
/// Bytes of a nonce.
pub(crate) const NONCE_LEN: usize = 12;
/// Bytes of a tag.
const TAG_LEN: usize = 16;

/// A record failed authentication, or the implementation refused the call (a record longer
/// than AES-GCM allows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("AES-GCM refused the record")]
pub(crate) struct Refused;

/// Whether the AES-GCM `aes` resolves to on this CPU opens records in place only (ring's), so
/// that a payload read straight into its destination is opened there at no extra cost
/// ([`super::landing`]).
pub(crate) fn opens_in_place_only(aes: LaneAes) -> bool {
    aes.resolve() == LaneAes::Ring
}

/// An AES-128-GCM key of one implementation (ring's holds its expanded key and GHASH tables inline,
/// about 550 bytes, so it is boxed).
pub(crate) enum LaneKey {
    AwsLc(aws_lc_rs::aead::LessSafeKey),
    Ring(Box<ring::aead::LessSafeKey>),
}

impl LaneKey {
    /// The key `bytes` for the implementation `aes` resolves to on this CPU
    /// ([`LaneAes::resolve`]).
    pub fn new(aes: LaneAes, bytes: &[u8; KEY_LEN]) -> Result<LaneKey, Refused> {
        Ok(match aes.resolve() {
            LaneAes::Auto | LaneAes::AwsLc => LaneKey::AwsLc(aws_lc_rs::aead::LessSafeKey::new(
                aws_lc_rs::aead::UnboundKey::new(&aws_lc_rs::aead::AES_128_GCM, bytes).map_err(|_| Refused)?,
            )),
            LaneAes::Ring => LaneKey::Ring(Box::new(ring::aead::LessSafeKey::new(
                ring::aead::UnboundKey::new(&ring::aead::AES_128_GCM, bytes).map_err(|_| Refused)?,
            ))),
        })
    }

    /// Whether [`open_into`](Self::open_into) decrypts straight from one buffer into
    /// another (aws-lc), rather than copying the ciphertext over first (ring).
    pub fn opens_out_of_place(&self) -> bool {
        matches!(self, LaneKey::AwsLc(_))
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
        }
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

fn ring_nonce(nonce: [u8; NONCE_LEN]) -> ring::aead::Nonce {
    ring::aead::Nonce::assume_unique_for_key(nonce)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; KEY_LEN] = [9; KEY_LEN];
    const NONCE: [u8; NONCE_LEN] = [3; NONCE_LEN];

    fn keys() -> [LaneKey; 2] {
        [LaneKey::new(LaneAes::AwsLc, &KEY).unwrap(), LaneKey::new(LaneAes::Ring, &KEY).unwrap()]
    }

    #[test]
    fn what_one_engine_seals_the_other_opens_and_a_changed_byte_fails_both() {
        let plain: Vec<u8> = (0..70_001u32).map(|i| (i * 7 % 251) as u8).collect();
        for (sealer, opener) in [(0, 1), (1, 0), (0, 0), (1, 1)] {
            let (sealer, opener) = (&keys()[sealer], &keys()[opener]);
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
}
