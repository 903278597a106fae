//! The flight recorder's and the stall inspector's settings (`NEXAR_TRACE_*`,
//! `NEXAR_STALL_WARN_MS`); the recorder itself is [`crate::trace`]'s.

use std::path::PathBuf;
use std::time::Duration;

use super::{ConfigError, invalid, parse};

/// Settings of the flight recorder and the stall inspector.
///
/// ```
/// let trace = nexar::trace::TraceConfig::default();
/// assert_eq!(trace.entries, 2000);
/// assert_eq!(trace.stall_warn, std::time::Duration::from_secs(30));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceConfig {
    /// Finished operations each rank keeps (`NEXAR_TRACE_ENTRIES`, default 2,000; 0 keeps
    /// none, though the stall inspector still knows what is in flight).
    pub entries: usize,
    /// Where dumps go (`NEXAR_TRACE_DIR`, default `$TMPDIR/nexar-trace`; `off` writes none).
    pub dir: Option<PathBuf>,
    /// How long an operation waits for a peer before the stall inspector reports
    /// (`NEXAR_STALL_WARN_MS`, default 30 s). Keep it well below `NEXAR_OP_TIMEOUT_MS`.
    pub stall_warn: Duration,
    /// Whether `SIGUSR1` dumps every rank of the process (`NEXAR_TRACE_SIGNAL`, `on` by
    /// default; `off` leaves the signal to the program).
    pub on_signal: bool,
}

impl Default for TraceConfig {
    fn default() -> Self {
        TraceConfig {
            entries: 2000,
            dir: Some(std::env::temp_dir().join("nexar-trace")),
            stall_warn: Duration::from_secs(30),
            on_signal: true,
        }
    }
}

impl TraceConfig {
    /// Defaults, overridden by the `NEXAR_TRACE_*` and `NEXAR_STALL_WARN_MS` variables that
    /// `lookup` has.
    ///
    /// ```
    /// let trace = nexar::trace::TraceConfig::from_lookup(|v| (v == "NEXAR_TRACE_DIR").then(|| "off".into())).unwrap();
    /// assert_eq!(trace.dir, None);
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut c = TraceConfig::default();
        let get = |var: &'static str| lookup(var).map(|v| (var, v));
        if let Some((var, v)) = get("NEXAR_TRACE_ENTRIES") {
            c.entries = parse(var, &v)?;
            if c.entries > 1_000_000 {
                return Err(invalid(var, &v, "at most 1000000 entries"));
            }
        }
        if let Some((_, v)) = get("NEXAR_TRACE_DIR") {
            c.dir = match v.trim() {
                "off" | "" => None,
                dir => Some(PathBuf::from(dir)),
            };
        }
        if let Some((var, v)) = get("NEXAR_STALL_WARN_MS") {
            let ms: u64 = parse(var, &v)?;
            if ms == 0 {
                return Err(invalid(var, &v, "at least 1 ms"));
            }
            c.stall_warn = Duration::from_millis(ms);
        }
        if let Some((var, v)) = get("NEXAR_TRACE_SIGNAL") {
            c.on_signal = match v.trim() {
                "on" | "1" | "true" => true,
                "off" | "0" | "false" => false,
                _ => return Err(invalid(var, &v, "expected on or off")),
            };
        }
        Ok(c)
    }
}
