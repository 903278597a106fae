//! The umbrella error: every area's error converts into it, so `?` works across areas.

/// Any nexar failure.
///
/// Each area has its own enum ([`ConfigError`](crate::config::ConfigError),
/// [`TransportError`](crate::transport::TransportError), [`ClusterError`](crate::cluster::ClusterError),
/// [`P2pError`](crate::comm::P2pError), [`RpcError`](crate::RpcError), ...); this wraps them for code
/// that calls several. New areas may add variants, so a `match` needs a wildcard arm.
///
/// ```
/// fn check(e: nexar::NexarError) -> String { e.to_string() }
/// let e: nexar::NexarError = nexar::ConfigError::Missing { what: "the seed address", var: "NEXAR_SEED_ADDR" }.into();
/// assert!(check(e).contains("NEXAR_SEED_ADDR"));
/// ```
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NexarError {
    /// Configuration.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Transport.
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    /// Cluster formation.
    #[error(transparent)]
    Cluster(#[from] crate::cluster::ClusterError),
    /// Point-to-point messaging.
    #[error(transparent)]
    P2p(#[from] crate::comm::P2pError),
    /// Collectives.
    #[error(transparent)]
    Collective(#[from] crate::comm::CollectiveError),
    /// Remote procedure calls.
    #[error(transparent)]
    Rpc(#[from] crate::rpc::RpcError),
    /// Failure agreement and rebuilds.
    #[error(transparent)]
    Recovery(#[from] crate::comm::RecoveryError),
    /// Transport back-end hooks.
    #[error(transparent)]
    Backend(#[from] crate::comm::BackendError),
    /// Device memory outside an operation (making, filling or reading a `Buf<T, Cuda>`), so
    /// that `?` works on it in a program that returns `NexarError`.
    #[error(transparent)]
    Device(#[from] nexar_types::DeviceError),
}

/// The job's shared secret cannot be used (a cluster-formation error).
impl From<crate::cluster::SecretError> for NexarError {
    fn from(e: crate::cluster::SecretError) -> Self {
        NexarError::Cluster(e.into())
    }
}

/// The launcher's variables cannot be used (a cluster-formation error).
impl From<crate::cluster::launcher::LauncherError> for NexarError {
    fn from(e: crate::cluster::launcher::LauncherError) -> Self {
        NexarError::Cluster(e.into())
    }
}

#[cfg(test)]
mod tests {
    /// `?` takes an RPC failure into `NexarError` beside the others.
    #[test]
    fn rpc_errors_convert() {
        fn call() -> Result<(), crate::rpc::RpcError> {
            Err(crate::rpc::RpcError::InvalidPeer { rank: 0, name: "f", peer: 9, world: 2 })
        }
        fn job() -> Result<(), super::NexarError> {
            call()?;
            Ok(())
        }
        assert!(matches!(job(), Err(super::NexarError::Rpc(crate::rpc::RpcError::InvalidPeer { peer: 9, .. }))));
    }
}
