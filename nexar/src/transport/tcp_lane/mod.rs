//! The TCP lane: collective payloads between two ranks over TLS 1.3 on TCP, with the
//! cluster's certificates, instead of QUIC.
//!
//! QUIC pays per 6.5 KB packet in user space (headers, acknowledgements, one AEAD call per
//! packet, a copy of what it must keep until acknowledged); TCP leaves that to the kernel, and
//! the lane seals 256 KiB AES-GCM records with keys exported from the TLS session, encrypting
//! from the sender's buffer and decrypting into the receiver's, so a pair of ranks moves about
//! twice the encrypted bytes per second both ways on the same cores. Small messages stay on
//! QUIC, whose latency path spins, unless the lane's I/O runs on the rank's runtime.
//!
//! A link whose ranks both do all the lane's I/O on their runtimes gets one connection that
//! carries records both ways, each way under keys of its own: the rank with the lower world
//! rank dials the peer's listener (TLS client), the other answers (TLS server), so
//! acknowledgements ride on the replies instead of costing a packet of their own. Any other
//! link gets one connection per direction (each rank dials to send), so that a reading and a
//! writing thread never take turns at one socket's lock. Both sides present certificates from
//! the cluster CA bound to their ranks, and the dialler proves which link a connection belongs
//! to with a token the peer sent it over the (already authenticated) QUIC link. See [`crate::NexarConfig::bulk_transport`].
//! The connections run the congestion control [`crate::NexarConfig::lane_congestion`] names.

mod channel;
mod cipher;
mod congestion;
mod connections;
mod handshake;
mod landing;
mod large_reads;
mod payload_records;
mod plain_write;
mod reader;
mod records;
mod runtime_reader;
mod sealed;
mod setup;
#[cfg(feature = "hostile-member")]
mod tamper;
#[cfg(test)]
mod test_groups;
mod writer;

pub(crate) use channel::{Connected, LaneIo, Pair, TcpLane};
pub(crate) use cipher::LaneAead;
pub(crate) use handshake::{LaneTls, answer, dial};
pub(crate) use reader::{PooledGroup, ReadLimits, RecvPool};
pub(crate) use records::{Deferred, GroupSink, Kept, SealedRecord};
pub(crate) use setup::{LaneOffer, TOKEN_LEN};
