//! Shared helpers for the examples.

pub mod spiral;
