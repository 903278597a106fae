//! Reading the configuration from `NEXAR_*` environment variables: every variable, its
//! parsing, and the error that names a variable set to something nexar cannot use.

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use super::NetChaos;
use super::{ConfigError, NexarConfig};

impl NexarConfig {
    /// Defaults, overridden by every `NEXAR_*` variable that is set.
    ///
    /// A variable that is set but invalid is an error naming it; it is never silently ignored.
    ///
    /// ```
    /// // With no NEXAR_* variables set this equals the defaults.
    /// let cfg = nexar::NexarConfig::from_env().unwrap();
    /// assert!(cfg.op_timeout.as_secs() > 0);
    /// ```
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`from_env`](Self::from_env), reading variables through `lookup` (for tests and
    /// for programs that keep settings elsewhere).
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_WORLD_SIZE").then(|| "4".into())).unwrap();
    /// assert_eq!(cfg.world_size, Some(4));
    /// let err = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_OP_TIMEOUT_MS").then(|| "soon".into()));
    /// assert!(err.unwrap_err().to_string().contains("NEXAR_OP_TIMEOUT_MS"));
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut c = NexarConfig::default();
        let get = |var: &'static str| lookup(var).map(|v| (var, v));
        if let Some((var, v)) = get("NEXAR_WORLD_SIZE") {
            let n: usize = parse(var, &v)?;
            if n == 0 {
                return Err(invalid(var, &v, "the world size must be at least 1"));
            }
            c.world_size = Some(n);
        }
        if let Some((var, v)) = get("NEXAR_SEED_ADDR") {
            match v.parse::<SocketAddr>() {
                Ok(addr) => c.seed_addr = Some(addr),
                // A host name and port (a pod's DNS name): resolved when joining.
                Err(_) if is_host_and_port(&v) => {}
                Err(_) => return Err(invalid(var, &v, "host:port, such as 10.0.0.1:7000 or head-0.train:7000")),
            }
        }
        if let Some((var, v)) = get("NEXAR_TOKEN") {
            crate::proto::token::JoinToken::from_str(&v).map_err(|e| invalid(var, "<redacted>", &e.to_string()))?;
            c.token = Some(v);
        }
        if let Some((var, v)) = get("NEXAR_LISTEN_ADDR") {
            c.listen_addr = parse(var, &v)?;
        }
        for (var, slot) in [
            ("NEXAR_CONNECT_TIMEOUT_MS", &mut c.connect_timeout),
            ("NEXAR_JOIN_TIMEOUT_MS", &mut c.join_timeout),
            ("NEXAR_MESH_TIMEOUT_MS", &mut c.mesh_timeout),
            ("NEXAR_HANDSHAKE_TIMEOUT_MS", &mut c.handshake_timeout),
            ("NEXAR_OP_TIMEOUT_MS", &mut c.op_timeout),
            ("NEXAR_IDLE_TIMEOUT_MS", &mut c.idle_timeout),
            ("NEXAR_HEARTBEAT_INTERVAL_MS", &mut c.heartbeat_interval),
            ("NEXAR_HEARTBEAT_TIMEOUT_MS", &mut c.heartbeat_timeout),
        ] {
            if let Some(v) = lookup(var) {
                let ms: u64 = parse(var, &v)?;
                if ms == 0 {
                    return Err(invalid(var, &v, "a timeout must be at least 1 ms"));
                }
                *slot = Duration::from_millis(ms);
            }
        }
        if let Some((var, v)) = get("NEXAR_MAX_MESSAGE_BYTES") {
            let n = parse_size(var, &v)?;
            if n == 0 || n > crate::proto::frame::MAX_FRAME_LEN {
                return Err(invalid(var, &v, "expected 1 byte to 4 GiB"));
            }
            c.max_message_bytes = n;
        }
        if let Some((var, v)) = get("NEXAR_CERT_LIFETIME_HOURS") {
            let hours: u64 = parse(var, &v)?;
            if hours == 0 || hours > 24 * 365 * 100 {
                return Err(invalid(var, &v, "expected 1 hour to 100 years"));
            }
            c.cert_lifetime = Duration::from_secs(hours * 3600);
        }
        if let Some((var, v)) = get("NEXAR_MAX_UNMATCHED_MESSAGES") {
            c.max_unmatched_messages = positive(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_MAX_UNMATCHED_BYTES") {
            c.max_unmatched_bytes = parse_size(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_LANE_CAPACITY") {
            c.lane_capacity = positive(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_MAX_RPC_HANDLERS") {
            c.max_rpc_handlers = positive(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_MAX_RPC_BYTES") {
            c.max_rpc_bytes = parse_size(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_SOCKET_BUFFER_BYTES") {
            c.socket_buffer_bytes =
                usize::try_from(parse_size(var, &v)?).map_err(|_| invalid(var, &v, "too large for this platform"))?;
        }
        if let Some((var, v)) = get("NEXAR_SPIN_US") {
            let us: u64 = parse(var, &v)?;
            if us > 1_000_000 {
                return Err(invalid(var, &v, "at most 1000000 (one second)"));
            }
            c.spin = Some(Duration::from_micros(us));
        }
        if let Some((var, v)) = get("NEXAR_SPIN_YIELD") {
            c.spin_yield = Some(on_off(var, &v)?);
        }
        for (var, slot, allowed) in [
            (
                "NEXAR_ALLREDUCE_ALGORITHM",
                &mut c.allreduce_algorithm,
                &["ring", "pipelined_ring", "halving_doubling", "recursive_doubling", "hierarchical"][..],
            ),
            (
                "NEXAR_BROADCAST_ALGORITHM",
                &mut c.broadcast_algorithm,
                &["binomial_tree", "pipelined_chain", "hierarchical"][..],
            ),
            ("NEXAR_BARRIER_ALGORITHM", &mut c.barrier_algorithm, &["dissemination", "two_phase"][..]),
        ] {
            if let Some(v) = lookup(var) {
                if !allowed.contains(&v.trim()) {
                    return Err(invalid(var, &v, &format!("expected one of {}", allowed.join(", "))));
                }
                *slot = Some(parse(var, &v)?);
            }
        }
        if let Some((var, v)) = get("NEXAR_RECOVERY_POLICY") {
            c.recovery_policy = parse(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_TOPOLOGY") {
            c.topology = parse(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_BULK_TRANSPORT") {
            c.bulk_transport = parse(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_BULK_MIN_BYTES") {
            c.bulk_min_bytes = Some(
                usize::try_from(parse_size(var, &v)?).map_err(|_| invalid(var, &v, "too large for this platform"))?,
            );
        }
        if let Some((var, v)) = get("NEXAR_BULK_ENCRYPTION") {
            c.bulk_encryption = on_off(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_LANE_THREADS") {
            c.lane_threads = Some(on_off(var, &v)?);
        }
        if let Some((var, v)) = get("NEXAR_LANE_CONGESTION") {
            c.lane_congestion = parse(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_LANE_CIPHER") {
            c.lane_cipher = parse(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_LANE_AES") {
            c.lane_aes = parse(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_SHM") {
            c.shared_memory = on_off(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_BIND") {
            c.bind_core = match v.trim().to_ascii_lowercase().as_str() {
                "core" => true,
                "none" => false,
                _ => return Err(invalid(var, &v, "expected core or none")),
            };
        }
        if let Some((var, v)) = get("NEXAR_NCCL") {
            c.nccl = on_off(var, &v)?;
        }
        if let Some((_, v)) = get("NEXAR_HOST_ID") {
            c.host_id = Some(v.trim().to_string());
        }
        if let Some((var, v)) = get("NEXAR_SEGMENT_BYTES") {
            c.segment_bytes =
                usize::try_from(parse_size(var, &v)?).map_err(|_| invalid(var, &v, "too large for this platform"))?;
        }
        if let Some((var, v)) = get("NEXAR_MIN_WORLD_SIZE") {
            c.min_world_size = positive(var, &v)?;
        }
        if let Some((var, v)) = get("NEXAR_MAX_WORLD_SIZE") {
            c.max_world_size = positive(var, &v)?;
        }
        let mut chaos = NetChaos::default();
        for (var, slot) in [("NEXAR_CHAOS_LOSS", &mut chaos.loss), ("NEXAR_CHAOS_REORDER", &mut chaos.reorder)] {
            if let Some(v) = lookup(var) {
                let p: f64 = parse(var, &v)?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(invalid(var, &v, "expected a probability from 0.0 to 1.0"));
                }
                *slot = p;
            }
        }
        if let Some((var, v)) = get("NEXAR_CHAOS_DELAY_MS") {
            chaos.delay = Duration::from_millis(parse(var, &v)?);
        }
        // Only when a variable asked for a fault: the wrapper sends one datagram per system
        // call, which costs bulk bandwidth.
        if chaos.loss > 0.0 || chaos.reorder > 0.0 || !chaos.delay.is_zero() {
            c.chaos = Some(chaos);
        }
        c.trace = super::TraceConfig::from_lookup(&lookup)?;
        if let Some((var, v)) = get("NEXAR_METRICS_ADDR") {
            let addr: SocketAddr = parse(var, &v)?;
            if addr.port() == 0 {
                return Err(invalid(var, &v, "a fixed port, for Prometheus to scrape"));
            }
            c.metrics_addr = Some(addr);
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks the relations between fields that `from_env` cannot see one by one.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_message_bytes == 0 || self.max_message_bytes > crate::proto::frame::MAX_FRAME_LEN {
            return Err(ConfigError::InvalidVar {
                var: "NEXAR_MAX_MESSAGE_BYTES",
                value: self.max_message_bytes.to_string(),
                reason: "expected 1 byte to 4 GiB".into(),
            });
        }
        if self.max_rpc_bytes == 0 {
            return Err(ConfigError::InvalidVar {
                var: "NEXAR_MAX_RPC_BYTES",
                value: "0".into(),
                reason: "a call needs room for its arguments".into(),
            });
        }
        if self.lane_capacity == 0 {
            return Err(ConfigError::InvalidVar {
                var: "NEXAR_LANE_CAPACITY",
                value: "0".into(),
                reason: "a lane needs room for at least one message".into(),
            });
        }
        if self.heartbeat_timeout <= self.heartbeat_interval || self.heartbeat_interval.is_zero() {
            return Err(ConfigError::InvalidVar {
                var: "NEXAR_HEARTBEAT_TIMEOUT_MS",
                value: self.heartbeat_timeout.as_millis().to_string(),
                reason: format!(
                    "must be longer than the heartbeat interval ({} ms, NEXAR_HEARTBEAT_INTERVAL_MS), which must be positive",
                    self.heartbeat_interval.as_millis()
                ),
            });
        }
        if self.max_world_size < self.min_world_size.max(self.world_size.unwrap_or(1)) {
            return Err(ConfigError::InvalidVar {
                var: "NEXAR_MAX_WORLD_SIZE",
                value: self.max_world_size.to_string(),
                reason: format!(
                    "smaller than the minimum world size {} (NEXAR_MIN_WORLD_SIZE) or the world size {:?}",
                    self.min_world_size, self.world_size
                ),
            });
        }
        Ok(())
    }
}

pub(crate) fn invalid(var: &'static str, value: &str, reason: &str) -> ConfigError {
    ConfigError::InvalidVar { var, value: value.to_string(), reason: reason.to_string() }
}

pub(crate) fn parse<T: FromStr>(var: &'static str, value: &str) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    value.trim().parse::<T>().map_err(|e| invalid(var, value, &e.to_string()))
}

/// `on`/`off` (also `1`/`0`, `true`/`false`).
fn on_off(var: &'static str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" => Ok(true),
        "off" | "0" | "false" => Ok(false),
        _ => Err(invalid(var, value, "expected on or off")),
    }
}

fn positive(var: &'static str, value: &str) -> Result<usize, ConfigError> {
    let n: usize = parse(var, value)?;
    if n == 0 {
        return Err(invalid(var, value, "expected a positive number"));
    }
    Ok(n)
}

/// Parses `1234`, `64K`, `16M`, `4G` (binary multiples, optional `iB`/`B` suffix).
fn parse_size(var: &'static str, value: &str) -> Result<u64, ConfigError> {
    let v = value.trim();
    let v = v.strip_suffix("iB").or_else(|| v.strip_suffix('B')).unwrap_or(v);
    let (digits, shift) = match v.char_indices().last() {
        Some((i, 'K' | 'k')) => (&v[..i], 10),
        Some((i, 'M' | 'm')) => (&v[..i], 20),
        Some((i, 'G' | 'g')) => (&v[..i], 30),
        _ => (v, 0),
    };
    let n: u64 =
        digits.trim().parse().map_err(|_| invalid(var, value, "expected a size such as 1048576, 64K, 16M or 4G"))?;
    n.checked_mul(1 << shift).ok_or_else(|| invalid(var, value, "size overflows 64 bits"))
}

/// `name:port` with a plausible host name and a port from 1 to 65535.
fn is_host_and_port(text: &str) -> bool {
    let Some((host, port)) = text.rsplit_once(':') else { return false };
    let host_ok = !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    host_ok && port.parse::<u16>().is_ok_and(|p| p > 0)
}
