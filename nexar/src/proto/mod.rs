//! The sans-IO layer: wire framing and messages, the schedule IR, the algorithm generators and
//! their simulator. No tokio, no sockets: everything here takes bytes or parameters in and
//! hands bytes, values or schedules out, so it is deterministic and fuzzable.

pub mod algo;
pub mod announce;
pub mod close;
pub mod compression;
pub mod frame;
pub mod lane;
pub mod message;
pub mod plan;
pub mod relay;
pub mod schedule;
#[cfg(any(test, feature = "unstable-internals"))]
pub mod sim;
pub mod token;
pub mod topology;

#[cfg(test)]
mod algo_tests;
