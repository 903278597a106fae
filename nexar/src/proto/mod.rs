//! The sans-IO layer: wire framing and messages. No tokio, no sockets: everything here takes
//! bytes in and hands bytes or values out, so it is deterministic and fuzzable.

pub mod frame;
pub mod message;
