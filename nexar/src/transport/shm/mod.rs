//! The same-host transport: collective payloads between two ranks of one host through a pair
//! of rings in shared memory, instead of through the kernel's network stack and AES-GCM.
//!
//! Ranks learn that they share a host from the host identity each offers over its QUIC link
//! (machine id, boot id, network namespace, user; `NEXAR_HOST_ID` overrides it). The pair then
//! meets on an abstract Unix socket, proves the link (a token sent over QUIC, and each side's
//! process credentials), and each side passes the other a sealed memfd segment holding the
//! ring it writes. The rings are private to the two processes: a memfd has no name in any file
//! system, and only a process of the same user (which could read either rank's memory anyway)
//! could reach it through `/proc`. That is why the payloads are not encrypted here, and why
//! the TLS promise (a rank's messages come only from that rank) holds.
//!
//! The peer writes into the segment at any time, so its bytes are untrusted input: they are
//! copied out before use, with every index and length checked ([`ring`]), and the only
//! `unsafe` of the crate is the mapping itself ([`mapping`]). A segment needs no cleanup: it
//! lives exactly as long as the two processes hold it.

mod channel;
mod lease;
pub(crate) mod mapping;
mod receive;
pub(crate) mod ring;
#[cfg(test)]
mod ring_model_tests;
pub(crate) mod setup;

pub(crate) use channel::{ShmChannel, ShmLimits};
