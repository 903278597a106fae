//! Which TCP congestion control the TCP lane's connections run.

use std::fmt;
use std::str::FromStr;

/// The algorithm the default asks for.
const CUBIC: &str = "cubic";
/// Longest name the kernel takes (`TCP_CA_NAME_MAX` less its terminating zero).
const MAX_NAME: usize = 15;

/// Which TCP congestion control the TCP lane's connections run (`NEXAR_LANE_CONGESTION`: an
/// algorithm's kernel name, or `system` for the kernel's default for new connections).
///
/// The default is CUBIC, the default of most Linux distributions, whatever the host's own
/// default. Some hosts default to BBR (`net.ipv4.tcp_congestion_control = bbr`, as on the
/// virtual machines nexar is benchmarked on), which is built for paths across the internet;
/// between two ranks there the sealed lane, whose writes come in bursts (a buffer sealed,
/// then written), moved 3–25 % less at 16–64 MiB and in broadcasts than under CUBIC (two
/// sittings, see the README's Performance section), and OpenMPI's TCP transport 35–45 % less
/// in a 64 MiB broadcast.
/// Where the kernel refuses the algorithm (not built, or not in
/// `net.ipv4.tcp_allowed_congestion_control` for a process without `CAP_NET_ADMIN`), the
/// connection keeps the host's default: the default choice says so in a debug line, a named
/// one in a warning. Set `system` where the host's choice is deliberate (a cluster spread
/// across sites, for instance). Each rank applies its own setting to the connections it dials
/// and answers; ranks need not agree.
///
/// ```
/// use nexar::LaneCongestion;
/// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_LANE_CONGESTION").then(|| "system".into())).unwrap();
/// assert_eq!(cfg.lane_congestion, LaneCongestion::System);
/// assert_eq!(nexar::NexarConfig::default().lane_congestion.name(), Some("cubic"));
/// assert!("not a name!".parse::<LaneCongestion>().is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LaneCongestion {
    /// The kernel's default for new connections.
    System,
    /// This algorithm, by its kernel name (`cubic`, `reno`, `bbr`, `dctcp`, ...).
    Named(String),
}

impl LaneCongestion {
    /// The algorithm asked for, or `None` for the kernel's default.
    ///
    /// ```
    /// assert_eq!(nexar::LaneCongestion::Named("reno".into()).name(), Some("reno"));
    /// assert_eq!(nexar::LaneCongestion::System.name(), None);
    /// ```
    pub fn name(&self) -> Option<&str> {
        match self {
            LaneCongestion::System => None,
            LaneCongestion::Named(name) => Some(name),
        }
    }

    /// Whether this is the default choice (so a kernel that refuses it is no surprise).
    pub(crate) fn is_default(&self) -> bool {
        *self == LaneCongestion::default()
    }
}

impl Default for LaneCongestion {
    fn default() -> Self {
        LaneCongestion::Named(CUBIC.into())
    }
}

impl FromStr for LaneCongestion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let name = s.trim().to_ascii_lowercase();
        let valid = (1..=MAX_NAME).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        match name.as_str() {
            "system" => Ok(LaneCongestion::System),
            _ if valid => Ok(LaneCongestion::Named(name)),
            _ => Err(format!(
                "expected system or an algorithm's kernel name (letters, digits, _ or -, at most {MAX_NAME})"
            )),
        }
    }
}

impl fmt::Display for LaneCongestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name().unwrap_or("system"))
    }
}
