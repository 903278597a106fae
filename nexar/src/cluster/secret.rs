//! The job's shared secret: what ranks started by a launcher (SLURM, torchrun, mpirun, a
//! Kubernetes job, `nexar launch`) use to authenticate the seed and each other when nobody can
//! hand them a join token.
//!
//! The secret never crosses the wire. The seed and each joiner prove that they know it with an
//! HMAC keyed by the secret over a value exported from their TLS session (RFC 5705/8446
//! exporters), so a proof is worthless on any other connection. The seed proves first: a joiner
//! never sends its own proof to a seed that has not shown it knows the secret.

use std::fmt;
use std::path::Path;

use aws_lc_rs::hmac;

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// The longest secret accepted, in bytes (a file holding more is not a secret file).
const MAX_SECRET_LEN: usize = 4096;

/// The label of the TLS exporter the proofs are computed over.
pub(crate) const EXPORTER_LABEL: &[u8] = b"EXPORTER-nexar-join-secret";

/// Who a proof speaks for: the two directions use different messages, so that one side's
/// proof cannot be reflected back as the other's.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Role {
    Seed,
    Joiner,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Seed => b"nexar secret proof v1: seed",
            Role::Joiner => b"nexar secret proof v1: joiner",
        }
    }
}

/// Why a secret cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// Shorter than [`MIN_SECRET_LEN`].
    #[error(
        "{source_name} holds {len} bytes; a secret needs at least {MIN_SECRET_LEN} (such as 32 hex digits: `openssl rand -hex 16`)"
    )]
    TooShort {
        /// Where it came from (`NEXAR_SECRET`, or the file named by `NEXAR_SECRET_FILE`).
        source_name: String,
        /// Its length.
        len: usize,
    },
    /// A secret file that is longer than any secret.
    #[error("{source_name} is {len} bytes long; a secret file holds at most {MAX_SECRET_LEN}")]
    TooLong {
        /// The file.
        source_name: String,
        /// Its length.
        len: u64,
    },
    /// A secret file that users other than its owner can read.
    #[error(
        "{path} can be read by its group or by others (mode {mode:o}); a secret file must be readable by its owner only: `chmod 600 {path}`"
    )]
    Readable {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// A secret file that cannot be read.
    #[error("cannot read the secret file {path} (NEXAR_SECRET_FILE): {reason}")]
    Unreadable {
        /// The file.
        path: String,
        /// The error.
        reason: String,
    },
    /// Both variables are set: it is not clear which one is meant.
    #[error("both NEXAR_SECRET and NEXAR_SECRET_FILE are set; set only one")]
    Ambiguous,
}

/// A secret shared by every rank of a job, at least [`MIN_SECRET_LEN`] bytes.
///
/// It is never printed: `Debug` shows only its length.
///
/// ```
/// use nexar::cluster::SharedSecret;
/// let s = SharedSecret::new("0123456789abcdef0123456789abcdef").unwrap();
/// assert_eq!(format!("{s:?}"), "SharedSecret(32 bytes)");
/// assert!(SharedSecret::new("short").is_err());
/// ```
#[derive(Clone)]
pub struct SharedSecret {
    key: Vec<u8>,
}

impl SharedSecret {
    /// A secret from its text (or bytes), at least [`MIN_SECRET_LEN`] bytes long.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, SecretError> {
        Self::checked(secret.as_ref().to_vec(), "the secret")
    }

    fn checked(key: Vec<u8>, source_name: &str) -> Result<Self, SecretError> {
        if key.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort { source_name: source_name.to_string(), len: key.len() });
        }
        Ok(SharedSecret { key })
    }

    /// A fresh random secret, as 64 hex digits (what `nexar launch` generates for each job).
    ///
    /// ```
    /// let (text, _secret) = nexar::cluster::SharedSecret::generate();
    /// assert_eq!(text.len(), 64);
    /// ```
    pub fn generate() -> (String, Self) {
        let text = hex::encode(rand::random::<[u8; 32]>());
        let secret = SharedSecret { key: text.as_bytes().to_vec() };
        (text, secret)
    }

    /// Reads the secret from a file that only its owner can read. One trailing newline is
    /// not part of the secret.
    ///
    /// ```no_run
    /// let secret = nexar::cluster::SharedSecret::from_file("/run/secrets/nexar").unwrap();
    /// ```
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, SecretError> {
        use std::os::unix::fs::PermissionsExt;
        let path = path.as_ref();
        let shown = path.display().to_string();
        let unreadable = |e: std::io::Error| SecretError::Unreadable { path: shown.clone(), reason: e.to_string() };
        let meta = std::fs::metadata(path).map_err(unreadable)?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Readable { path: shown, mode });
        }
        if meta.len() > MAX_SECRET_LEN as u64 {
            return Err(SecretError::TooLong { source_name: shown, len: meta.len() });
        }
        let mut key = std::fs::read(path).map_err(unreadable)?;
        if key.last() == Some(&b'\n') {
            key.pop();
            if key.last() == Some(&b'\r') {
                key.pop();
            }
        }
        Self::checked(key, &shown)
    }

    /// The job's secret from `NEXAR_SECRET` or `NEXAR_SECRET_FILE`, read through `lookup`;
    /// `Ok(None)` when neither is set.
    ///
    /// ```
    /// use nexar::cluster::SharedSecret;
    /// let vars = [("NEXAR_SECRET", "0123456789abcdef0123456789abcdef")];
    /// let found = SharedSecret::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()));
    /// assert!(found.unwrap().is_some());
    /// assert!(SharedSecret::from_lookup(|_| None).unwrap().is_none());
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, SecretError> {
        let get = |var: &str| lookup(var).filter(|v| !v.is_empty());
        match (get("NEXAR_SECRET"), get("NEXAR_SECRET_FILE")) {
            (Some(_), Some(_)) => Err(SecretError::Ambiguous),
            (Some(text), None) => Self::checked(text.into_bytes(), "NEXAR_SECRET").map(Some),
            (None, Some(path)) => Self::from_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The proof that the holder of this secret speaks as `role` on the TLS session whose
    /// exporter value is `exported`.
    pub(crate) fn proof(&self, role: Role, exported: &[u8]) -> Vec<u8> {
        let key = hmac::Key::new(hmac::HMAC_SHA256, &self.key);
        let mut ctx = hmac::Context::with_key(&key);
        ctx.update(role.label());
        ctx.update(exported);
        ctx.sign().as_ref().to_vec()
    }

    /// Checks a proof in constant time.
    pub(crate) fn verify(&self, role: Role, exported: &[u8], proof: &[u8]) -> bool {
        let key = hmac::Key::new(hmac::HMAC_SHA256, &self.key);
        let mut msg = role.label().to_vec();
        msg.extend_from_slice(exported);
        hmac::verify(&key, &msg, proof).is_ok()
    }
}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedSecret({} bytes)", self.key.len())
    }
}

/// The value both ends of `conn` export from their TLS session for the secret proofs.
pub(crate) fn exported(conn: &quinn::Connection) -> Result<[u8; 32], String> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, EXPORTER_LABEL, b"")
        .map_err(|_| "the TLS session cannot export keying material".to_string())?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn proofs_bind_the_role_the_session_and_the_secret() {
        let a = SharedSecret::new("0123456789abcdef").unwrap();
        let b = SharedSecret::new("0123456789abcdeF").unwrap();
        let p = a.proof(Role::Seed, b"session one");
        assert!(a.verify(Role::Seed, b"session one", &p));
        assert!(!a.verify(Role::Joiner, b"session one", &p), "a seed's proof is not a joiner's");
        assert!(!a.verify(Role::Seed, b"session two", &p), "a proof is bound to its session");
        assert!(!b.verify(Role::Seed, b"session one", &p), "another secret refuses it");
        assert!(!a.verify(Role::Seed, b"session one", &p[..16]));
    }

    #[test]
    fn secret_files_must_be_private_and_long_enough() {
        let dir = std::env::temp_dir().join(format!("nexar-secret-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = SharedSecret::from_file(&file).unwrap_err();
        assert!(matches!(err, SecretError::Readable { mode: 0o644, .. }), "{err}");
        assert!(err.to_string().contains("chmod 600"), "{err}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let from_file = SharedSecret::from_file(&file).unwrap();
        assert_eq!(from_file.key, b"0123456789abcdef0123", "the trailing newline is not part of it");
        std::fs::write(&file, "short\n").unwrap();
        assert!(matches!(SharedSecret::from_file(&file), Err(SecretError::TooShort { len: 5, .. })));
        let path = file.display().to_string();
        let both = [("NEXAR_SECRET", "0123456789abcdef"), ("NEXAR_SECRET_FILE", path.as_str())];
        let lookup = |k: &str| both.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(SharedSecret::from_lookup(lookup).unwrap_err(), SecretError::Ambiguous);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
