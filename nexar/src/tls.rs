//! Certificates for a cluster with static membership
//! ([`NexarClient::connect_static`](crate::NexarClient::connect_static)): a cluster CA, and an
//! identity per rank whose certificate is bound to that rank. A cluster that forms through a
//! seed needs none of this: the seed is its CA and certifies each rank as it joins.
//!
//! ```
//! use nexar::tls::{ClusterCa, key_pin, rank_server_name};
//! let ca = ClusterCa::generate()?;
//! // Issue once per rank and provision each identity (and the CA certificate) to its host.
//! let rank0 = ca.issue(&rank_server_name(0))?;
//! let pin = key_pin(rank0.cert())?;
//! assert_eq!(pin.len(), 32);
//! # Ok::<(), nexar::TransportError>(())
//! ```

pub use crate::config::DEFAULT_CERT_LIFETIME;
pub use crate::transport::tls::{ClusterCa, Identity, KeyPin, key_pin, rank_server_name};
