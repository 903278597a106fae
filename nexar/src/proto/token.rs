//! Join tokens: a secret that proves a worker may join, and the fingerprint of the cluster CA
//! that lets the worker verify the seed before it sends that secret.

use std::fmt;
use std::str::FromStr;

use subtle::ConstantTimeEq;

const PREFIX: &str = "nexar1";
/// Bytes of secret in a token.
pub const SECRET_LEN: usize = 16;

/// A join token, as printed by the seed: `nexar1.<secret, 32 hex>.<CA SHA-256, 64 hex>`.
///
/// ```
/// use nexar::JoinToken;
/// let t: JoinToken = "nexar1.000102030405060708090a0b0c0d0e0f.\
///     1111111111111111111111111111111111111111111111111111111111111111".parse().unwrap();
/// assert_eq!(t.to_string().len(), 6 + 1 + 32 + 1 + 64);
/// assert!("nexar1.abc.def".parse::<JoinToken>().is_err());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    secret: [u8; SECRET_LEN],
    ca_fingerprint: [u8; 32],
}

impl JoinToken {
    /// Generates a token with a fresh random secret for the CA with this fingerprint.
    pub(crate) fn generate(ca_fingerprint: [u8; 32]) -> Self {
        JoinToken { secret: rand::random(), ca_fingerprint }
    }

    pub(crate) fn secret(&self) -> &[u8; SECRET_LEN] {
        &self.secret
    }

    /// The SHA-256 fingerprint of the cluster CA's certificate.
    pub fn ca_fingerprint(&self) -> [u8; 32] {
        self.ca_fingerprint
    }

    /// Compares a presented secret with this token's, in constant time.
    pub(crate) fn secret_matches(&self, presented: &[u8]) -> bool {
        presented.len() == SECRET_LEN && bool::from(self.secret.ct_eq(presented))
    }
}

impl fmt::Display for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PREFIX}.{}.{}", hex::encode(self.secret), hex::encode(self.ca_fingerprint))
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret in logs.
        write!(f, "JoinToken(ca {}…)", &hex::encode(self.ca_fingerprint)[..16])
    }
}

/// Why a join token does not parse: the reason, never the token itself.
///
/// ```
/// let err = "nexar2.00.00".parse::<nexar::JoinToken>().unwrap_err();
/// assert!(err.to_string().contains("nexar1."), "{err}");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid join token: {0}")]
pub struct TokenError(String);

impl TokenError {
    /// The reason, without the words "invalid join token".
    pub fn reason(&self) -> &str {
        &self.0
    }
}

impl FromStr for JoinToken {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<Self, TokenError> {
        let bad = |why: &str| TokenError(why.to_string());
        let mut parts = s.trim().split('.');
        if parts.next() != Some(PREFIX) {
            return Err(bad("expected it to start with \"nexar1.\""));
        }
        let (Some(secret), Some(fp), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad("expected three dot-separated parts: nexar1.<secret>.<ca fingerprint>"));
        };
        let mut out = JoinToken { secret: [0; SECRET_LEN], ca_fingerprint: [0; 32] };
        hex::decode_to_slice(secret, &mut out.secret).map_err(|_| bad("the secret must be 32 hexadecimal digits"))?;
        hex::decode_to_slice(fp, &mut out.ca_fingerprint)
            .map_err(|_| bad("the ca fingerprint must be 64 hexadecimal digits"))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_compare_secrets() {
        let t = JoinToken::generate([7; 32]);
        let back: JoinToken = t.to_string().parse().unwrap();
        assert_eq!(back, t);
        assert!(t.secret_matches(t.secret()));
        assert!(!t.secret_matches(&[0; SECRET_LEN]));
        assert!(!t.secret_matches(&t.secret()[..8]));
        assert!(!format!("{t:?}").contains(&hex::encode(t.secret())));
        for bad in ["", "nexar2.00.00", "nexar1.zz.00", "nexar1.00112233445566778899aabbccddeeff", "nexar1.a.b.c"] {
            assert!(bad.parse::<JoinToken>().is_err(), "{bad}");
        }
    }
}
