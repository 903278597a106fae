//! Fault injection as a setting: what to do to one rank's datagrams ([`NetChaos`], also read
//! from `NEXAR_CHAOS_*`) and the switch a test turns to silence a rank ([`Silence`]). The socket
//! that carries them out is transport's (`transport/chaos.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A switch shared between a test and the sockets it controls: while on, the sockets send and
/// receive nothing, as if the host had lost power.
///
/// ```
/// let switch = nexar::Silence::default();
/// switch.set(true);
/// assert!(switch.is_on());
/// ```
#[derive(Clone, Debug, Default)]
pub struct Silence(Arc<AtomicBool>);

impl Silence {
    /// Turns the silence on or off.
    pub fn set(&self, on: bool) {
        self.0.store(on, Ordering::Relaxed);
    }

    /// Whether the silence is on.
    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl PartialEq for Silence {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Faults to inject into one rank's datagrams (see [`NexarConfig::chaos`]). Outgoing datagrams
/// are dropped with probability `loss`; with probability `reorder` one is held back for
/// `delay` so that later ones overtake it.
///
/// ```
/// let mut cfg = nexar::NexarConfig::default();
/// cfg.chaos = Some(nexar::NetChaos { loss: 0.01, ..Default::default() });
/// ```
///
/// [`NexarConfig::chaos`]: crate::NexarConfig::chaos
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NetChaos {
    /// Probability that an outgoing datagram is lost (`NEXAR_CHAOS_LOSS`, 0.0–1.0).
    pub loss: f64,
    /// Probability that an outgoing datagram is delayed behind later ones
    /// (`NEXAR_CHAOS_REORDER`, 0.0–1.0).
    pub reorder: f64,
    /// How long a reordered datagram is held (`NEXAR_CHAOS_DELAY_MS`, default 2 ms when
    /// reordering).
    pub delay: Duration,
    /// While on, nothing is sent or received.
    pub silence: Silence,
}
