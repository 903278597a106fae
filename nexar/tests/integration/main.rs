//! nexar's integration tests, one module per area, in one test binary: each test binary links
//! all of nexar and its dependencies again, so thirty of them took most of a clean build's time.
//! A test that measures the process itself (its memory, its sockets, its threads) or installs
//! something once per process (the Prometheus exporter, a log subscriber that captures every
//! line) runs in a process of its own through [`common::alone`]. A module whose features are
//! off is not compiled (`cargo test --workspace` turns them all on).
//!
//! `cargo test -p nexar --test integration shm::` runs one area.

mod common;
#[cfg(feature = "hostile-member")]
mod hostile_common;

mod chaos;
mod collectives;
mod compressed;
mod cooperation;
mod ddp;
#[cfg(feature = "cli")]
mod ddp_elastic;
#[cfg(feature = "cli")]
mod ddp_launch;
mod device;
mod failures;
mod hierarchical;
#[cfg(feature = "unstable-internals")]
mod hostile;
#[cfg(feature = "hostile-member")]
mod hostile_lane;
#[cfg(feature = "hostile-member")]
mod hostile_member;
#[cfg(feature = "hostile-member")]
mod hostile_shm;
mod idle;
#[cfg(feature = "cli")]
mod launch;
mod local_cluster;
mod memory;
#[cfg(feature = "prometheus")]
mod metrics;
mod nccl;
#[cfg(feature = "cli")]
mod netns;
mod plan;
#[cfg(feature = "cli")]
mod processes;
mod recovery;
mod rooted;
mod rpc;
mod rpc_context;
mod segments;
mod shm;
#[cfg(feature = "cli")]
mod stall;
mod tcp_lane;
mod topk;
mod topology;
