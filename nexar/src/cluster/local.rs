//! In-process clusters: every rank in this process, each with its own endpoint on 127.0.0.1
//! and its own certificate from an in-memory CA, connected by real QUIC.

use std::net::SocketAddr;

use super::ClusterError;
use crate::comm::NexarClient;
use crate::comm::RankKeys;
use crate::config::NexarConfig;
use crate::transport::endpoint::{bind, server_with_transport};
use crate::transport::relay_seal::{RelaySeals, RelaySecret};
use crate::transport::tls::{ClusterCa, mesh_server, rank_server_name};

/// Forms a cluster inside this process with one rank per configuration.
pub(crate) async fn bootstrap_local(cfgs: Vec<NexarConfig>) -> Result<Vec<NexarClient>, ClusterError> {
    let n = cfgs.len();
    if n == 0 {
        return Err(ClusterError::InvalidWorldSize(0));
    }
    for (rank, cfg) in cfgs.iter().enumerate() {
        cfg.validate().map_err(|e| ClusterError::Mesh { rank, reason: e.to_string() })?;
    }
    let ca = ClusterCa::generate()?;
    let ca_der = ca.certificate();
    let mut ranks = Vec::with_capacity(n);
    for (rank, cfg) in cfgs.iter().enumerate() {
        let identity = ca.issue(&rank_server_name(rank as u32))?;
        let server = server_with_transport(mesh_server(&identity, &ca_der)?, cfg);
        let endpoint = bind(SocketAddr::from(([127, 0, 0, 1], 0)), cfg, Some(server))?;
        ranks.push((endpoint, identity));
    }
    let addrs: Vec<SocketAddr> = ranks
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
    let mut tasks = tokio::task::JoinSet::new();
    for (rank, (((endpoint, identity), cfg), secret)) in ranks.into_iter().zip(cfgs).zip(secrets).enumerate() {
        let (addrs, ca_der) = (addrs.clone(), ca_der.clone());
        let relay = Some(RelaySeals::new(rank as u32, secret, publics.clone()));
        tasks.spawn(async move {
            let keys = RankKeys { identity: &identity, ca: &ca_der, relay };
            NexarClient::from_parts(rank, endpoint, &addrs, keys, cfg, None).await.map(|c| (rank, c))
        });
    }
    let mut clients: Vec<Option<NexarClient>> = (0..n).map(|_| None).collect();
    while let Some(done) = tasks.join_next().await {
        let (rank, client) =
            done.map_err(|e| ClusterError::Mesh { rank: 0, reason: format!("a rank's task failed: {e}") })??;
        clients[rank] = Some(client);
    }
    Ok(clients.into_iter().flatten().collect())
}
