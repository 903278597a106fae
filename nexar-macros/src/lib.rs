//! Procedural macros of nexar.
//!
//! `#[nexar::rpc]` and `#[nexar::collective_plan]` arrive with the typed-DSL work; this crate is a
//! member of the workspace now so that the layout is fixed and the re-exports in `nexar` exist.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
