//! RDMA transport for nexar's collective payloads, over ibverbs, with fallback to QUIC.
//!
//! [`attach`] is called by every rank of a communicator after it forms. Each pair of ranks
//! swaps queue-pair offers over nexar's control lane ([`setup`]); where both ends have a
//! device and their queue pairs connect, the link's raw lane (every collective payload) moves
//! to RDMA writes into a registered ring with credit-based flow control; everywhere else it
//! stays on QUIC, and the first rank without a device says so once in the log. Collectives do
//! not change: the executor hands the same messages to whichever transport the link has, and
//! what RDMA delivers goes through the same checks as what QUIC delivers.
//!
//! ```no_run
//! use nexar::prelude::*;
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let ranks = NexarClient::bootstrap_local(2).await?;
//! let cfg = nexar_rdma::RdmaConfig::default();
//! let (a, b) = tokio::join!(nexar_rdma::attach(&ranks[0], &cfg), nexar_rdma::attach(&ranks[1], &cfg));
//! println!("rank 0 to rank 1: {:?}", a?.links); // Rdma, or Quic with the reason
//! # b?; Ok(()) }
//! ```
//!
//! Without a NIC, [`Fabric::Emulated`] runs the same engine over an in-process emulation of
//! one (ranks of one process only), which is how the engine is tested on machines without
//! RDMA hardware.
#![deny(unsafe_code)]
#![warn(missing_docs)]
// docs.rs (`--cfg docsrs`, nightly) marks each item that needs a feature with that feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod attach;
mod emulated;
mod engine;
mod error;
#[cfg(feature = "gpudirect")]
mod gpudirect;
pub mod setup;
#[cfg(feature = "verbs")]
mod verbs;
#[cfg(not(feature = "verbs"))]
#[path = "no_verbs.rs"]
mod verbs;
mod wire;

pub use attach::{AttachReport, LinkTransport, attach};
pub use error::RdmaError;
#[cfg(feature = "gpudirect")]
pub use gpudirect::{GpuRegion, Refused, gpudirect_support};

/// A device ibverbs lists.
///
/// ```
/// let d = nexar_rdma::DeviceInfo { name: "mlx5_0".into(), guid: 0x1234 };
/// assert_eq!(d.name, "mlx5_0");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0`.
    pub name: String,
    /// Node GUID.
    pub guid: u64,
}

/// Which fabric carries the links.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fabric {
    /// RDMA NICs through ibverbs (falls back to QUIC where there is none, and everywhere in a
    /// build without the `verbs` feature).
    #[default]
    Verbs,
    /// The in-process emulation of a NIC: ranks of one process only. For tests, and for
    /// trying the transport on a host without RDMA hardware.
    Emulated,
}

/// Settings of the RDMA transport.
///
/// ```
/// let cfg = nexar_rdma::RdmaConfig { slots: 16, ..Default::default() };
/// assert_eq!(cfg.ring_bytes(), 16 << 20);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaConfig {
    /// The fabric (`NEXAR_RDMA_FABRIC`: `verbs` or `emulated`).
    pub fabric: Fabric,
    /// The device to use, e.g. `mlx5_0` (`NEXAR_RDMA_DEVICE`); the first one when unset.
    pub device: Option<String>,
    /// GID index for RoCE (`NEXAR_RDMA_GID_INDEX`; 0 by default, often 1 or 3 for RoCE v2).
    pub gid_index: u8,
    /// Slots in each link's send staging area and receive ring (`NEXAR_RDMA_SLOTS`, 8).
    pub slots: u16,
    /// Bytes per slot, a power of two ≥ 4 KiB (`NEXAR_RDMA_SLOT_BYTES`, 1 MiB).
    pub slot_size: u32,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig { fabric: Fabric::Verbs, device: None, gid_index: 0, slots: 8, slot_size: 1 << 20 }
    }
}

impl RdmaConfig {
    /// The defaults, overridden by the `NEXAR_RDMA_*` environment variables.
    ///
    /// ```
    /// let cfg = nexar_rdma::RdmaConfig::from_env().unwrap();
    /// assert!(cfg.slot_size.is_power_of_two());
    /// ```
    pub fn from_env() -> Result<RdmaConfig, RdmaError> {
        let mut cfg = RdmaConfig::default();
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let bad = |name: &str, v: &str| RdmaError::Config(format!("{name}={v:?} is not valid"));
        if let Some(v) = var("NEXAR_RDMA_FABRIC") {
            cfg.fabric = match v.as_str() {
                "verbs" => Fabric::Verbs,
                "emulated" => Fabric::Emulated,
                _ => return Err(bad("NEXAR_RDMA_FABRIC", &v)),
            };
        }
        cfg.device = var("NEXAR_RDMA_DEVICE");
        if let Some(v) = var("NEXAR_RDMA_GID_INDEX") {
            cfg.gid_index = v.parse().map_err(|_| bad("NEXAR_RDMA_GID_INDEX", &v))?;
        }
        if let Some(v) = var("NEXAR_RDMA_SLOTS") {
            cfg.slots = v.parse().map_err(|_| bad("NEXAR_RDMA_SLOTS", &v))?;
        }
        if let Some(v) = var("NEXAR_RDMA_SLOT_BYTES") {
            cfg.slot_size = v.parse().map_err(|_| bad("NEXAR_RDMA_SLOT_BYTES", &v))?;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Bytes of one ring (and of one staging area): `slots × slot_size`.
    pub fn ring_bytes(&self) -> u64 {
        u64::from(self.slots) * u64::from(self.slot_size)
    }

    /// Checks the ring geometry.
    ///
    /// ```
    /// let odd = nexar_rdma::RdmaConfig { slot_size: 5000, ..Default::default() };
    /// assert!(odd.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), RdmaError> {
        if self.slots == 0 || self.slots > 4096 {
            return Err(RdmaError::Config(format!("{} slots (1 to 4096)", self.slots)));
        }
        if !self.slot_size.is_power_of_two() || !(4096..=64 << 20).contains(&self.slot_size) {
            return Err(RdmaError::Config(format!("{}-byte slots (a power of two, 4 KiB to 64 MiB)", self.slot_size)));
        }
        if self.ring_bytes() > 1 << 30 {
            return Err(RdmaError::Config(format!("a {}-byte ring (at most 1 GiB)", self.ring_bytes())));
        }
        Ok(())
    }
}

/// The RDMA devices on this host, or [`RdmaError::NoDevice`] saying why there are none.
///
/// ```
/// match nexar_rdma::devices() {
///     Ok(devices) => println!("{devices:?}"),
///     Err(e) => println!("{e}"), // "no RDMA device: ..."
/// }
/// # #[cfg(not(feature = "verbs"))]
/// # assert!(nexar_rdma::devices().unwrap_err().to_string().contains("built without the verbs feature"));
/// ```
pub fn devices() -> Result<Vec<DeviceInfo>, RdmaError> {
    verbs::discover()
}

/// Makes every later write on the emulated fabric fail (`true`) or work again (`false`), as a
/// NIC or cable fault would: for testing how links fall back to QUIC. Real NICs are unaffected.
///
/// ```
/// nexar_rdma::inject_emulated_fault(false);
/// ```
#[doc(hidden)]
pub fn inject_emulated_fault(on: bool) {
    emulated::set_fault(on);
}
