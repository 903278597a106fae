//! [`NexarConfigBuilder`]: a configuration written in code, checked when it is built.
//!
//! [`NexarConfig`] is `#[non_exhaustive]`, so that a new setting is not a breaking change:
//! code outside nexar cannot write it as a struct literal. It starts from the defaults, from
//! the environment, or from a config in hand, and changes what it names.

use std::net::SocketAddr;
use std::time::Duration;

use super::NetChaos;
use super::{BulkTransport, ConfigError, NexarConfig, RecoveryPolicy};
use crate::proto::algo::Algorithm;
use crate::proto::topology::Topology;

/// Builds a [`NexarConfig`]: one method per setting, each documented on the field it sets,
/// and [`build`](Self::build) checks the settings against each other as
/// [`NexarConfig::from_env`] does.
///
/// ```
/// use std::time::Duration;
/// use nexar::NexarConfig;
///
/// let cfg = NexarConfig::builder()
///     .op_timeout(Duration::from_secs(30))
///     .heartbeat_interval(Duration::from_millis(200))
///     .heartbeat_timeout(Duration::from_secs(2))
///     .shared_memory(false)
///     .build()
///     .unwrap();
/// assert_eq!(cfg.op_timeout, Duration::from_secs(30));
///
/// // Settings that contradict each other are refused when built, not when the cluster forms.
/// let late = NexarConfig::builder().heartbeat_timeout(Duration::from_millis(100)).build();
/// assert!(late.unwrap_err().to_string().contains("NEXAR_HEARTBEAT_TIMEOUT_MS"));
///
/// // Start from the environment (`NexarConfig::from_env()`, here a stand-in for it) or any
/// // config, and override in code.
/// let env = NexarConfig::from_lookup(|v| (v == "NEXAR_SHM").then(|| "off".into())).unwrap();
/// let cfg = env.into_builder().listen_addr("127.0.0.1:0".parse().unwrap()).build().unwrap();
/// assert!(!cfg.shared_memory);
/// ```
#[derive(Clone, Debug, Default)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct NexarConfigBuilder {
    config: NexarConfig,
}

impl NexarConfig {
    /// A builder that starts from [`NexarConfig::default`]; see [`NexarConfigBuilder`].
    ///
    /// ```
    /// let cfg = nexar::NexarConfig::builder().world_size(4).build().unwrap();
    /// assert_eq!(cfg.world_size, Some(4));
    /// ```
    pub fn builder() -> NexarConfigBuilder {
        NexarConfigBuilder::default()
    }

    /// A builder that starts from this config, to change some of it in code.
    ///
    /// ```
    /// let base = nexar::NexarConfig::builder().shared_memory(false).build().unwrap();
    /// let cfg = base.clone().into_builder().bulk_encryption(false).build().unwrap();
    /// assert!(!cfg.shared_memory && !cfg.bulk_encryption);
    /// ```
    pub fn into_builder(self) -> NexarConfigBuilder {
        NexarConfigBuilder { config: self }
    }
}

impl From<NexarConfig> for NexarConfigBuilder {
    fn from(config: NexarConfig) -> Self {
        config.into_builder()
    }
}

/// One setter per field: `plain` ones take the field's type, `some` ones set an optional
/// field to the value given, `text` ones an optional string to anything that becomes one.
macro_rules! setters {
    ($(plain $field:ident: $ty:ty;)* $(some $opt:ident: $inner:ty;)* $(text $text:ident;)*) => {
        impl NexarConfigBuilder {
            $(
                #[doc = concat!("Sets [`NexarConfig::", stringify!($field), "`].")]
                pub fn $field(mut self, value: $ty) -> Self {
                    self.config.$field = value;
                    self
                }
            )*
            $(
                #[doc = concat!("Sets [`NexarConfig::", stringify!($opt), "`] (to `Some`).")]
                pub fn $opt(mut self, value: $inner) -> Self {
                    self.config.$opt = Some(value);
                    self
                }
            )*
            $(
                #[doc = concat!("Sets [`NexarConfig::", stringify!($text), "`] (to `Some`).")]
                pub fn $text(mut self, value: impl Into<String>) -> Self {
                    self.config.$text = Some(value.into());
                    self
                }
            )*
        }
    };
}

setters! {
    plain listen_addr: SocketAddr;
    plain connect_timeout: Duration;
    plain join_timeout: Duration;
    plain mesh_timeout: Duration;
    plain handshake_timeout: Duration;
    plain op_timeout: Duration;
    plain cert_lifetime: Duration;
    plain idle_timeout: Duration;
    plain max_message_bytes: u64;
    plain max_unmatched_messages: usize;
    plain max_unmatched_bytes: u64;
    plain lane_capacity: usize;
    plain max_rpc_handlers: usize;
    plain max_rpc_bytes: u64;
    plain socket_buffer_bytes: usize;
    plain heartbeat_interval: Duration;
    plain heartbeat_timeout: Duration;
    plain recovery_policy: RecoveryPolicy;
    plain min_world_size: usize;
    plain max_world_size: usize;
    plain topology: Topology;
    plain bulk_transport: BulkTransport;
    plain bulk_encryption: bool;
    plain lane_congestion: super::LaneCongestion;
    plain lane_cipher: super::LaneCipher;
    plain lane_aes: super::LaneAes;
    plain shared_memory: bool;
    plain bind_core: bool;
    plain nccl: bool;
    plain segment_bytes: usize;
    plain trace: super::TraceConfig;
    some world_size: usize;
    some seed_addr: SocketAddr;
    some spin: Duration;
    some spin_yield: bool;
    some allreduce_algorithm: Algorithm;
    some broadcast_algorithm: Algorithm;
    some barrier_algorithm: Algorithm;
    some chaos: NetChaos;
    some metrics_addr: SocketAddr;
    some lane_threads: bool;
    some bulk_min_bytes: usize;
    text token;
    text host_id;
}

impl NexarConfigBuilder {
    /// The config, once its settings are checked against each other (message and RPC
    /// limits, lane capacity, heartbeat timeout against interval, world size limits): an
    /// error names the setting by its `NEXAR_*` variable and says what it must be.
    ///
    /// ```
    /// let err = nexar::NexarConfig::builder().lane_capacity(0).build().unwrap_err();
    /// assert!(err.to_string().contains("NEXAR_LANE_CAPACITY"));
    /// ```
    pub fn build(self) -> Result<NexarConfig, ConfigError> {
        self.config.validate()?;
        Ok(self.config)
    }
}
