//! Cluster formation: join tokens, the seed node, workers joining through it, in-process
//! clusters, and the direct peer mesh; and finding out how the job was launched ([`launcher`],
//! with SLURM host lists parsed by [`hostlist`]).

pub(crate) mod detector;
mod growth;
pub(crate) mod health;
pub mod hostlist;
mod join;
pub mod launcher;
mod local;
mod mesh;
mod routes;
mod secret;
mod seed;

use std::net::SocketAddr;
use std::time::Duration;

pub use crate::proto::token::{JoinToken, TokenError};
pub(crate) use growth::Growth;
pub(crate) use join::{Credentials, Joined, join};
pub(crate) use local::{LocalMesh, LocalRank, local_mesh};
pub(crate) use mesh::{MeshSetup, form_mesh};
pub(crate) use routes::Routes;
pub use secret::{MIN_SECRET_LEN, SecretError, SharedSecret};
pub use seed::SeedNode;

use crate::transport::TransportError;

/// Failures while forming or joining a cluster.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// A join token does not parse.
    #[error("invalid join token: {0}")]
    InvalidToken(String),
    /// A cluster of this size cannot be formed.
    #[error("invalid world size {0}: a cluster needs at least one rank")]
    InvalidWorldSize(usize),
    /// The seed refused the join.
    #[error("the seed at {seed} refused the join: {reason}")]
    JoinRejected {
        /// The seed's address.
        seed: SocketAddr,
        /// Its reason.
        reason: String,
    },
    /// The two ends of a join hold different shared secrets (`NEXAR_SECRET`), or one of them is
    /// not part of this job.
    #[error("{}", mismatch_text(*seed, *side))]
    SecretMismatch {
        /// The seed's address.
        seed: SocketAddr,
        /// Which side found the other's proof wrong.
        side: MismatchSide,
    },
    /// The job's shared secret cannot be used.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The launcher's variables cannot be used.
    #[error(transparent)]
    Launcher(#[from] launcher::LauncherError),
    /// `NEXAR_METRICS_ADDR` is set and the metrics endpoint could not be started.
    #[error(transparent)]
    Metrics(#[from] crate::telemetry::MetricsError),
    /// Started by a launcher, but no shared secret is set.
    #[error(
        "{launcher} launch detected, but neither NEXAR_SECRET nor NEXAR_SECRET_FILE is set: every rank of the job \
         must hold the same secret of at least 16 bytes so that ranks can authenticate each other. Add one line:\n  \
         sbatch script:   export NEXAR_SECRET=$(openssl rand -hex 16)   (srun passes it to every task)\n  \
         torchrun:        NEXAR_SECRET=<32 hex digits, the same on every node> torchrun ...\n  \
         mpirun:          NEXAR_SECRET=$(openssl rand -hex 16) mpirun -x NEXAR_SECRET ...\n  \
         Kubernetes:      env: [{{name: NEXAR_SECRET, valueFrom: {{secretKeyRef: {{name: nexar-job, key: secret}}}}}}]\n\
         (`nexar launch` generates one for you)"
    )]
    NoSecret {
        /// The launcher recognised.
        launcher: launcher::Launcher,
    },
    /// Joined, but the other workers did not all join before the join timeout.
    #[error("{}", incomplete_text(*seed, *after, *joined, *world, refused))]
    JoinIncomplete {
        /// The seed's address.
        seed: SocketAddr,
        /// How long this rank waited.
        after: Duration,
        /// Workers joined, as the seed last said.
        joined: u32,
        /// Workers the cluster waits for.
        world: u32,
        /// The seed's last refusals, "address: reason".
        refused: Vec<String>,
    },
    /// Joined, but the seed went away before every worker had joined (under a launcher, the
    /// seed lives in rank 0: it ended).
    #[error("the seed at {seed} went away before the cluster formed ({reason}): {}", progress_text(*joined, *world, refused))]
    SeedLost {
        /// The seed's address.
        seed: SocketAddr,
        /// How the connection ended.
        reason: String,
        /// Workers joined, as the seed last said.
        joined: u32,
        /// Workers the cluster waits for.
        world: u32,
        /// The seed's last refusals, "address: reason".
        refused: Vec<String>,
    },
    /// The seed could not be reached before the join deadline.
    #[error(
        "could not reach the seed at {seed} (from {source_vars}) within {after:?} (NEXAR_JOIN_TIMEOUT_MS); \
         {attempts} attempts, the last: {last}"
    )]
    SeedUnreachable {
        /// The seed's location, as the launcher gave it.
        seed: String,
        /// The variables it came from.
        source_vars: String,
        /// How long this rank tried.
        after: Duration,
        /// How many times.
        attempts: u32,
        /// The last attempt's error.
        last: String,
    },
    /// The seed answered something the join protocol does not allow.
    #[error("the seed at {seed} broke the join protocol: {reason}")]
    SeedProtocol {
        /// The seed's address.
        seed: SocketAddr,
        /// What was wrong.
        reason: String,
    },
    /// The mesh did not form.
    #[error("rank {rank} could not form the mesh: {reason}")]
    Mesh {
        /// The rank reporting.
        rank: usize,
        /// What went wrong, naming the peers concerned.
        reason: String,
    },
    /// A wait ran past its limit.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The limit.
        after: Duration,
    },
    /// Two `#[nexar::rpc]` functions share an id (or the registry is otherwise unusable).
    #[error("the rpc registry is invalid: {0}")]
    RpcRegistry(String),
    /// The transport failed underneath.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl From<TokenError> for ClusterError {
    fn from(e: TokenError) -> Self {
        ClusterError::InvalidToken(e.reason().to_string())
    }
}

/// Which end of a join refused the other's proof of the shared secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MismatchSide {
    /// This worker found the seed's proof wrong: the seed is not this job's, or holds another
    /// secret.
    Seed,
    /// The seed found this worker's proof wrong.
    Worker,
}

fn mismatch_text(seed: SocketAddr, side: MismatchSide) -> String {
    match side {
        MismatchSide::Seed => format!(
            "the seed at {seed} could not prove it knows this job's secret: either this rank's NEXAR_SECRET \
             (or NEXAR_SECRET_FILE) differs from the one the seed was started with, or the process at {seed} is \
             not this job's seed; this rank refused it and sent nothing secret"
        ),
        MismatchSide::Worker => format!(
            "the seed at {seed} refused this rank's proof of the secret: this rank's NEXAR_SECRET (or \
             NEXAR_SECRET_FILE) differs from the seed's; every rank of a job must hold the same secret"
        ),
    }
}

fn incomplete_text(seed: SocketAddr, after: Duration, joined: u32, world: u32, refused: &[String]) -> String {
    format!(
        "the cluster did not form within {after:?} (NEXAR_JOIN_TIMEOUT_MS) at the seed at {seed}: {}",
        progress_text(joined, world, refused)
    )
}

/// How far the cluster got, and whom the seed refused.
fn progress_text(joined: u32, world: u32, refused: &[String]) -> String {
    let mut text = format!("{joined} of {world} ranks had joined; ");
    if refused.is_empty() {
        text += "the seed refused nobody, so the missing ranks never reached it (not started, crashed, or given \
                 another seed address)";
    } else {
        text += &format!("the seed refused: {}", refused.join("; "));
    }
    text
}
