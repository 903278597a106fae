//! How agreeing on failures and rebuilding a communicator can fail.

use std::time::Duration;

/// Failures of agreement and rebuild. Each names the reporting rank.
///
/// ```no_run
/// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
/// match comm.recover().await {
///     Ok(survivors) => println!("{} ranks left", survivors.world_size()),
///     Err(nexar::RecoveryError::Excluded { reason, .. }) => eprintln!("left out: {reason}"),
///     Err(e) => return Err(e.into()),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecoveryError {
    /// The caller's arguments are wrong.
    #[error("rank {rank} {op}: {reason}")]
    InvalidArgument {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The survivors left this rank out (another rank declared it dead, or it was named in
    /// `rebuild_excluding`). It is no longer a member; it should exit.
    #[error("rank {rank} was excluded from the rebuilt communicator: {reason}")]
    Excluded {
        /// The rank reporting (the excluded one).
        rank: usize,
        /// Why.
        reason: String,
    },
    /// Fewer ranks survive than `min_world_size` allows.
    #[error("rank {rank} rebuild: only {survivors} ranks survive, fewer than the minimum {min} (NEXAR_MIN_WORLD_SIZE)")]
    TooFew {
        /// The rank reporting.
        rank: usize,
        /// Ranks left after the failures.
        survivors: usize,
        /// The configured minimum.
        min: usize,
    },
    /// A peer sent an agreement message that breaks the protocol.
    #[error("rank {rank} agreement: rank {peer} sent an invalid failure set: {what}")]
    Protocol {
        /// The rank reporting.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What was wrong.
        what: String,
    },
    /// A wait ran past its limit.
    #[error("rank {rank} {op}: {what} did not happen within {after:?}")]
    Timeout {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What was waited for.
        what: String,
        /// The limit.
        after: Duration,
    },
    /// This rank is shutting down.
    #[error("rank {rank} agreement: the client is shut down")]
    Closed {
        /// The rank reporting.
        rank: usize,
    },
}
