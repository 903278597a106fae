//! The umbrella error: every area's error converts into it, so `?` works across areas.

/// Any nexar failure.
///
/// Each area has its own enum ([`ConfigError`](crate::ConfigError),
/// [`TransportError`](crate::TransportError), [`ClusterError`](crate::ClusterError),
/// [`P2pError`](crate::P2pError)); this wraps them for code that calls several.
///
/// ```
/// fn check(e: nexar::NexarError) -> String { e.to_string() }
/// let e: nexar::NexarError = nexar::ConfigError::Missing { what: "the seed address", var: "NEXAR_SEED_ADDR" }.into();
/// assert!(check(e).contains("NEXAR_SEED_ADDR"));
/// ```
#[derive(Clone, Debug, thiserror::Error)]
pub enum NexarError {
    /// Configuration.
    #[error(transparent)]
    Config(#[from] crate::ConfigError),
    /// Transport.
    #[error(transparent)]
    Transport(#[from] crate::TransportError),
    /// Cluster formation.
    #[error(transparent)]
    Cluster(#[from] crate::ClusterError),
    /// Point-to-point messaging.
    #[error(transparent)]
    P2p(#[from] crate::P2pError),
    /// Collectives.
    #[error(transparent)]
    Collective(#[from] crate::CollectiveError),
    /// Failure agreement and rebuilds.
    #[error(transparent)]
    Recovery(#[from] crate::RecoveryError),
    /// Transport back-end hooks.
    #[error(transparent)]
    Backend(#[from] crate::BackendError),
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
