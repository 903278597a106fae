//! What the rest of a program sees of failures: [`FailureWatch`], which reports each peer
//! declared dead (and, under automatic recovery, the rebuilt communicator), and the
//! communicator's `failure_watch`, `failed_ranks` and `report_failure`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::watch;

use crate::cluster::health::PeerFailure;
use crate::comm::client::Rebuilds;
use crate::comm::client::{Inner, NexarClient};
use crate::comm::membership::recovery::RecoveryError;

/// The failures a rank has seen, in the order it saw them, and (under the automatic recovery
/// policy) the communicators rebuilt after them. Made by
/// [`NexarClient::failure_watch`].
///
/// ```no_run
/// # async fn run(comm: nexar::NexarClient) {
/// let mut watch = comm.failure_watch();
/// tokio::spawn(async move {
///     while let Some(f) = watch.next().await {
///         eprintln!("lost rank {}: {}", f.rank, f.reason);
///     }
/// });
/// # }
/// ```
pub struct FailureWatch {
    /// Weak, so a forgotten watch does not keep the rank alive.
    inner: Weak<Inner>,
    rank: usize,
    events: watch::Receiver<Vec<PeerFailure>>,
    seen: usize,
    rebuilt: watch::Receiver<Rebuilds>,
    rebuilds_seen: u64,
}

impl std::fmt::Debug for FailureWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailureWatch").field("seen", &self.seen).finish_non_exhaustive()
    }
}

impl FailureWatch {
    /// The next failure this watch has not reported yet, waiting for one. `None` once this
    /// rank has shut down or been excluded by the others (see
    /// [`excluded`](Self::excluded)).
    pub async fn next(&mut self) -> Option<PeerFailure> {
        loop {
            {
                let all = self.events.borrow_and_update();
                if let Some(f) = all.get(self.seen) {
                    self.seen += 1;
                    return Some(f.clone());
                }
            }
            let inner = self.inner.upgrade()?;
            if inner.health.excluded().is_some() || inner.mailbox.is_closed() {
                return None;
            }
            drop(inner);
            // Re-check now and then: shutting down sends no event.
            let woke = tokio::time::timeout(Duration::from_millis(500), self.events.changed()).await;
            if matches!(woke, Ok(Err(_))) {
                return None;
            }
        }
    }

    /// Every failure seen so far, oldest first.
    pub fn failures(&self) -> Vec<PeerFailure> {
        self.events.borrow().clone()
    }

    /// Why the other ranks excluded this one, if they did.
    pub fn excluded(&self) -> Option<String> {
        self.inner.upgrade().and_then(|i| i.health.excluded())
    }

    /// Under [`RecoveryPolicy::Automatic`](crate::RecoveryPolicy::Automatic): waits for the next communicator the runtime
    /// rebuilds after a failure (one finished after the previous call, or after this watch
    /// was made), and returns it or why the rebuild failed. Under the other policies nothing
    /// is rebuilt automatically, so this waits until the rank shuts down.
    pub async fn rebuilt(&mut self) -> Result<NexarClient, RecoveryError> {
        loop {
            {
                let latest = self.rebuilt.borrow_and_update();
                if latest.0 > self.rebuilds_seen
                    && let Some(result) = latest.1.clone()
                {
                    self.rebuilds_seen = latest.0;
                    let inner = self.inner.upgrade().ok_or(RecoveryError::Closed { rank: self.rank })?;
                    let user = inner
                        .user
                        .get()
                        .and_then(std::sync::Weak::upgrade)
                        .ok_or(RecoveryError::Closed { rank: self.rank })?;
                    return result.map(|comm| NexarClient { user, inner, comm });
                }
            }
            if self.inner.upgrade().is_none_or(|i| i.mailbox.is_closed()) {
                return Err(RecoveryError::Closed { rank: self.rank });
            }
            let woke = tokio::time::timeout(Duration::from_millis(500), self.rebuilt.changed()).await;
            if matches!(woke, Ok(Err(_))) {
                return Err(RecoveryError::Closed { rank: self.rank });
            }
        }
    }
}

impl NexarClient {
    /// A watch on the failures this rank sees from now on (and those it already saw).
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// let watch = comm.failure_watch();
    /// for f in watch.failures() {
    ///     println!("rank {} is dead: {}", f.rank, f.reason);
    /// }
    /// # }
    /// ```
    pub fn failure_watch(&self) -> FailureWatch {
        let rebuilt = self.inner.rebuilt.subscribe();
        let rebuilds_seen = rebuilt.borrow().0;
        FailureWatch {
            inner: Arc::downgrade(&self.inner),
            rank: self.inner.rank,
            events: self.inner.health.subscribe(),
            seen: 0,
            rebuilt,
            rebuilds_seen,
        }
    }

    /// Ranks of this communicator that this rank has declared dead.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// if !comm.failed_ranks().is_empty() {
    ///     eprintln!("lost {:?}; call recover()", comm.failed_ranks());
    /// }
    /// # }
    /// ```
    pub fn failed_ranks(&self) -> Vec<usize> {
        let dead = self.inner.health.dead();
        self.comm.members.iter().enumerate().filter(|(_, w)| dead.contains(w)).map(|(r, _)| r).collect()
    }

    /// Declares rank `peer` of this communicator dead on the application's word (say, it
    /// stopped making progress): its connection is cut, the other ranks are told and do the
    /// same, and operations involving it fail. The next [`recover`](Self::recover) leaves it
    /// out.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// comm.report_failure(3, "no progress for 10 minutes")?;
    /// let survivors = comm.recover().await?;
    /// # Ok(()) }
    /// ```
    pub fn report_failure(&self, peer: usize, reason: &str) -> Result<(), RecoveryError> {
        let invalid =
            |reason: String| RecoveryError::InvalidArgument { rank: self.rank(), op: "report_failure", reason };
        let world_peer =
            *self.comm.members.get(peer).ok_or_else(|| {
                invalid(format!("rank {peer} is outside this {}-rank communicator", self.world_size()))
            })?;
        if world_peer == self.inner.rank {
            return Err(invalid("a rank cannot report itself failed; call abort() to leave".into()));
        }
        self.inner.peer_failed(
            world_peer,
            format!("reported by the application on rank {}: {reason}", self.inner.rank),
            true,
            true,
        );
        Ok(())
    }
}
