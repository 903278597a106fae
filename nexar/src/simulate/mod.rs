//! Models of a cluster far larger than a test machine holds, for sizing a job before it runs:
//! [`simulate_liveness`] runs the real failure detector (`cluster::detector`) of every rank in
//! a discrete-event model of heartbeats, probes, refutations and failure reports, and
//! [`simulate_formation`] replays the seed's joins and the mesh's connections on modelled
//! hosts. Both are deterministic for a given seed, and need no network.
//!
//! ```
//! use std::time::Duration;
//! use nexar::simulate::{LivenessScenario, simulate_liveness};
//!
//! let mut s = LivenessScenario::new(64);
//! s.run_for = Duration::from_secs(20);
//! s.kill = Some((17, Duration::from_secs(10)));
//! let out = simulate_liveness(&s);
//! assert_eq!(out.false_deaths, 0);
//! assert!(out.first_detection.unwrap() <= s.heartbeat_timeout + Duration::from_secs(1));
//! ```

mod events;
mod formation;
mod liveness;

pub use formation::{FormationOutcome, FormationScenario, simulate_formation};
pub use liveness::{LivenessOutcome, LivenessScenario, simulate_liveness};
