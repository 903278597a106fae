//! QUIC endpoints with the settings that make quinn fast on loopback and LAN links.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use quinn::{AckFrequencyConfig, IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};
use socket2::{Domain, Protocol, Socket, Type};

use super::TransportError;
use crate::config::NexarConfig;

/// Largest UDP payload nexar sends; GSO batches of 10 such datagrams stay under 64 KiB.
pub const MAX_UDP_PAYLOAD: u16 = 6500;
/// Unidirectional streams a peer may open towards us at once. A link keeps one per lane and
/// direction for its life; twice that leaves room for a stream that is being replaced, and no
/// more, since each open stream may be carrying a message of up to `max_message_bytes` into
/// this rank's memory. A link opens no bidirectional streams.
const MAX_UNI_STREAMS: u32 = 2 * crate::transport::link::Lane::COUNT as u32;
/// The round trip a connection assumes before its first sample.
const INITIAL_RTT: std::time::Duration = std::time::Duration::from_millis(10);
/// Initial congestion window in bytes.
const INITIAL_WINDOW: u64 = 1 << 20;
/// Acknowledge every 16 ack-eliciting packets instead of every 2.
const ACK_ELICITING_THRESHOLD: u32 = 16;

/// Transport parameters shared by every connection: datagrams start at 1200 bytes and grow by
/// path-MTU discovery up to [`MAX_UDP_PAYLOAD`].
pub fn transport_config(cfg: &NexarConfig) -> Arc<TransportConfig> {
    Arc::new(peer_transport(cfg))
}

/// Transport parameters of a connection to a process on this very host ([`same_host`]): the
/// kernel carries it over loopback, whose MTU is 64 KiB, so datagrams start at
/// [`MAX_UDP_PAYLOAD`] and no path-MTU discovery runs. quinn reads a probe's padding one byte
/// at a time, and the probes of 64 ranks forming their mesh on one host took a quarter of its
/// CPU time (`perf record -a` over the formation).
pub fn same_host_transport_config(cfg: &NexarConfig) -> Arc<TransportConfig> {
    let mut t = peer_transport(cfg);
    t.initial_mtu(MAX_UDP_PAYLOAD);
    t.mtu_discovery_config(None);
    Arc::new(t)
}

/// Whether a peer at `there` runs on the host whose own address is `here`: the same address,
/// or both on loopback. The kernel routes packets to its own addresses over loopback.
pub(crate) fn same_host(here: IpAddr, there: IpAddr) -> bool {
    here == there || (here.is_loopback() && there.is_loopback())
}

fn peer_transport(cfg: &NexarConfig) -> TransportConfig {
    let mut t = TransportConfig::default();
    let idle = IdleTimeout::try_from(cfg.idle_timeout).unwrap_or(IdleTimeout::from(VarInt::MAX));
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some(cfg.idle_timeout / 5));
    t.max_concurrent_uni_streams(VarInt::from_u32(MAX_UNI_STREAMS));
    t.max_concurrent_bidi_streams(VarInt::from_u32(0));
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_UDP_PAYLOAD);
    t.mtu_discovery_config(Some(mtu));
    // Before its first sample, quinn assumes a 333 ms round trip, so a first packet that is
    // lost is sent again only after a second: one sent to a seed whose process has not bound
    // its port yet (under `nexar launch` rank 0 hosts it), or to a rank that has not set up
    // its server yet. 8-rank formations took 1.2 s one time in four. Cluster links are LAN or
    // loopback: 10 ms sends it again within about 30 ms, and the first sample replaces it.
    t.initial_rtt(INITIAL_RTT);
    // Cluster links are LAN or loopback: start with a window that covers a typical collective
    // message instead of ramping up from 14 KB for every new connection.
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window(INITIAL_WINDOW);
    t.congestion_controller_factory(Arc::new(cubic));
    let mut ack = AckFrequencyConfig::default();
    ack.ack_eliciting_threshold(VarInt::from_u32(ACK_ELICITING_THRESHOLD));
    t.ack_frequency_config(Some(ack));
    t
}

/// Flow-control window of the seed's one join stream, and of a whole connection to it: the
/// join frames are at most a few KiB ([`crate::proto::frame::MAX_JOIN_FRAME`]).
const SEED_WINDOW: u32 = 16 << 10;

/// Transport parameters of the seed's connections. Anyone who can reach the seed's port gets
/// this far before proving anything, so they allow only what a join needs: one bidirectional
/// stream opened by the worker, no unidirectional ones, no datagrams, and windows of a few KiB,
/// so a connection that never completes its join holds next to nothing. What the seed sends
/// (the peer table) is governed by the worker's own windows.
pub fn seed_transport_config(cfg: &NexarConfig) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    let idle = IdleTimeout::try_from(cfg.idle_timeout).unwrap_or(IdleTimeout::from(VarInt::MAX));
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some(cfg.idle_timeout / 5));
    t.max_concurrent_bidi_streams(VarInt::from_u32(1));
    t.max_concurrent_uni_streams(VarInt::from_u32(0));
    t.stream_receive_window(VarInt::from_u32(SEED_WINDOW));
    t.receive_window(VarInt::from_u32(SEED_WINDOW));
    t.datagram_receive_buffer_size(None);
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_UDP_PAYLOAD);
    t.mtu_discovery_config(Some(mtu));
    Arc::new(t)
}

/// Binds a UDP socket with large buffers and wraps it in a quinn endpoint. A `server`
/// keeps the transport parameters it was given ([`server_with_transport`] for the mesh's).
pub fn bind(
    addr: SocketAddr,
    cfg: &NexarConfig,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, TransportError> {
    let fail = |reason: String| TransportError::Bind { addr, reason };
    let socket =
        Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(|e| fail(e.to_string()))?;
    if addr.is_ipv6() {
        let _ = socket.set_only_v6(false);
    }
    // The kernel may cap these at net.core.[rw]mem_max; a smaller buffer still works.
    if let Err(e) = socket.set_recv_buffer_size(cfg.socket_buffer_bytes) {
        tracing::debug!(%addr, error = %e, "could not enlarge the receive buffer");
    }
    if let Err(e) = socket.set_send_buffer_size(cfg.socket_buffer_bytes) {
        tracing::debug!(%addr, error = %e, "could not enlarge the send buffer");
    }
    socket.bind(&addr.into()).map_err(|e| fail(e.to_string()))?;
    let mut endpoint_config = quinn::EndpointConfig::default();
    endpoint_config.max_udp_payload_size(MAX_UDP_PAYLOAD).map_err(|e| fail(e.to_string()))?;
    let runtime = Arc::new(quinn::TokioRuntime);
    let socket = quinn::Runtime::wrap_udp_socket(&*runtime, socket.into()).map_err(|e| fail(e.to_string()))?;
    let socket = match &cfg.chaos {
        Some(chaos) => super::chaos::ChaosSocket::wrap(socket, chaos.clone()),
        None => socket,
    };
    quinn::Endpoint::new_with_abstract_socket(endpoint_config, server, socket, runtime).map_err(|e| fail(e.to_string()))
}

/// Attaches the shared transport parameters to a client configuration.
pub fn with_transport(mut client: quinn::ClientConfig, cfg: &NexarConfig) -> quinn::ClientConfig {
    client.transport_config(transport_config(cfg));
    client
}

/// Attaches the shared transport parameters to a server configuration.
pub fn server_with_transport(mut server: quinn::ServerConfig, cfg: &NexarConfig) -> quinn::ServerConfig {
    server.transport_config(transport_config(cfg));
    server
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_seed_transport_config_builds() {
        let t = crate::transport::endpoint::seed_transport_config(&crate::config::NexarConfig::default());
        drop(t);
    }

    #[test]
    fn ranks_on_one_address_or_on_loopback_share_a_host() {
        use super::same_host;
        let ip = |s: &str| s.parse().unwrap();
        assert!(same_host(ip("10.0.0.1"), ip("10.0.0.1")));
        assert!(same_host(ip("127.0.0.1"), ip("127.0.0.2")));
        assert!(same_host(ip("::1"), ip("127.0.0.1")));
        assert!(!same_host(ip("10.0.0.1"), ip("10.0.0.2")));
        assert!(!same_host(ip("127.0.0.1"), ip("10.0.0.1")));
    }
}
