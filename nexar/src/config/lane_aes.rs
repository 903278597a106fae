//! Which implementation of AES-128-GCM seals the TCP lane's records (with
//! `NEXAR_LANE_CIPHER=aes-128-gcm`).

use std::fmt;
use std::str::FromStr;

/// Which implementation of AES-128-GCM seals and opens the TCP lane's records where the lane's
/// cipher is AES-128-GCM ([`LaneCipher::Aes128Gcm`](crate::LaneCipher::Aes128Gcm); the default
/// is AEGIS-128X2) (`NEXAR_LANE_AES`: `auto`, the default, `aws-lc` or `ring`).
///
/// Both are linked in already (rustls uses aws-lc, quinn ring) and produce the same records,
/// so ranks need not agree; what differs is the vector code each has for the CPU. aws-lc's
/// AES-GCM has an AVX-512 path (VAES on 512-bit registers) and otherwise falls back to
/// 128-bit AES-NI; ring has a path for VAES on 256-bit AVX2 registers, which CPUs with VAES
/// but no AVX-512 have (AMD Zen 3, Intel client cores). On such a CPU, a Zen 3 at 2.45 GHz,
/// ring sealed 16 KiB records at 6.0 GB/s and aws-lc at 2.7. `auto` takes aws-lc where the
/// CPU has its AVX-512 path, ring where it has VAES and AVX2 without it, and aws-lc
/// elsewhere ([`resolve`](LaneAes::resolve) says which). The choice is a rank's own.
///
/// ```
/// use nexar::LaneAes;
/// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_LANE_AES").then(|| "ring".into())).unwrap();
/// assert_eq!(cfg.lane_aes, LaneAes::Ring);
/// assert_eq!(nexar::NexarConfig::default().lane_aes, LaneAes::Auto);
/// assert!("openssl".parse::<LaneAes>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LaneAes {
    /// The faster of the two on this CPU (see the type's documentation).
    #[default]
    Auto,
    /// aws-lc's AES-GCM.
    AwsLc,
    /// ring's AES-GCM.
    Ring,
}

impl LaneAes {
    /// The implementation this choice runs on this CPU: itself, or for [`LaneAes::Auto`]
    /// aws-lc where the CPU has AVX-512 with VAES (the same test as aws-lc's own dispatch),
    /// ring where it has VAES and AVX2 without it, and aws-lc elsewhere.
    ///
    /// ```
    /// use nexar::LaneAes;
    /// assert_ne!(LaneAes::Auto.resolve(), LaneAes::Auto);
    /// assert_eq!(LaneAes::Ring.resolve(), LaneAes::Ring);
    /// ```
    pub fn resolve(self) -> LaneAes {
        match self {
            LaneAes::Auto => fastest_here(),
            named => named,
        }
    }
}

/// See [`LaneAes::resolve`].
fn fastest_here() -> LaneAes {
    #[cfg(target_arch = "x86_64")]
    {
        let vaes = std::arch::is_x86_feature_detected!("vaes") && std::arch::is_x86_feature_detected!("vpclmulqdq");
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl");
        if vaes && !avx512 && std::arch::is_x86_feature_detected!("avx2") {
            return LaneAes::Ring;
        }
    }
    LaneAes::AwsLc
}

impl FromStr for LaneAes {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(LaneAes::Auto),
            "aws-lc" | "aws_lc" | "awslc" => Ok(LaneAes::AwsLc),
            "ring" => Ok(LaneAes::Ring),
            _ => Err("expected auto, aws-lc or ring".into()),
        }
    }
}

impl fmt::Display for LaneAes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaneAes::Auto => "auto",
            LaneAes::AwsLc => "aws-lc",
            LaneAes::Ring => "ring",
        })
    }
}
