//! In-process clusters: every rank in this process, each with its own endpoint on 127.0.0.1
//! and its own certificate from an in-memory CA, connected by real QUIC. This module hands
//! out what each rank proves itself with; `comm` builds the clients from it.

use std::net::SocketAddr;

use quinn::Endpoint;
use rustls::pki_types::CertificateDer;

use super::ClusterError;
use crate::config::NexarConfig;
use crate::transport::endpoint::{bind, server_with_transport};
use crate::transport::relay_seal::{RelaySeals, RelaySecret};
use crate::transport::tls::{ClusterCa, Identity, mesh_server, rank_server_name};

/// One rank of an in-process cluster: its bound endpoint, its certificate and key, and the
/// relay keys that seal its relayed messages.
pub(crate) struct LocalRank {
    pub endpoint: Endpoint,
    pub identity: Identity,
    pub relay: RelaySeals,
}

/// What every rank of an in-process cluster is started from: the ranks (index = rank), every
/// rank's address, and the cluster CA.
pub(crate) struct LocalMesh {
    pub ranks: Vec<LocalRank>,
    pub addrs: Vec<SocketAddr>,
    pub ca: CertificateDer<'static>,
}

/// Issues a certificate and relay keys to one rank per configuration and binds its endpoint
/// on 127.0.0.1, as a seed would for ranks on many hosts.
pub(crate) fn local_mesh(cfgs: &[NexarConfig]) -> Result<LocalMesh, ClusterError> {
    let n = cfgs.len();
    if n == 0 {
        return Err(ClusterError::InvalidWorldSize(0));
    }
    for (rank, cfg) in cfgs.iter().enumerate() {
        cfg.validate().map_err(|e| ClusterError::Mesh { rank, reason: e.to_string() })?;
    }
    let ca = ClusterCa::generate()?;
    let ca_der = ca.certificate();
    let mut bound = Vec::with_capacity(n);
    for (rank, cfg) in cfgs.iter().enumerate() {
        let identity = ca.issue(&rank_server_name(rank as u32))?;
        let server = server_with_transport(mesh_server(&identity, &ca_der)?, cfg);
        let endpoint = bind(SocketAddr::from(([127, 0, 0, 1], 0)), cfg, Some(server))?;
        bound.push((endpoint, identity));
    }
    let addrs: Vec<SocketAddr> = bound
        .iter()
        .map(|(e, _)| e.local_addr())
        .collect::<Result<_, _>>()
        .map_err(|e| ClusterError::Mesh { rank: 0, reason: e.to_string() })?;
    // Each rank's relay key pair; the public halves are handed to all, as the seed's peer table
    // would.
    let secrets = (0..n)
        .map(|_| RelaySecret::generate())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|reason| ClusterError::Mesh { rank: 0, reason })?;
    let publics: Vec<_> = secrets.iter().map(|s| Some(s.public())).collect();
    let ranks = bound
        .into_iter()
        .zip(secrets)
        .enumerate()
        .map(|(rank, ((endpoint, identity), secret))| LocalRank {
            endpoint,
            identity,
            relay: RelaySeals::new(rank as u32, secret, publics.clone()),
        })
        .collect();
    Ok(LocalMesh { ranks, addrs, ca: ca_der })
}
