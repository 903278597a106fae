//! What the reading tasks of bulk channels share, whatever the transport (shared memory, the
//! TCP lane on the runtime): how a channel stops, and the frame of the task. A task reads until
//! the peer says goodbye or something fails and stops its channel accordingly; it also stops
//! the channel when it ends any other way (its runtime shutting down included), so that nexar
//! and the peer hear of it.

use std::future::Future;
use std::io;
use std::sync::Arc;

use tokio::sync::Notify;

/// How a channel stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The peer said goodbye between groups: nothing was lost, nobody needs waking.
    Goodbye,
    /// nexar gave the channel up.
    GivenUp,
    /// It broke.
    Failed,
}

/// A channel's shared state, as its reading task sees it.
pub(crate) trait Stoppable: Send + Sync + 'static {
    /// Whether the channel has stopped.
    fn has_stopped(&self) -> bool;
    /// Stops the channel (once), saying why.
    fn stop_as(&self, why: &str, how: Stop);
    /// Resolves once the channel stops for a reason other than the peer's goodbye.
    fn wait_stopped(&self) -> impl Future<Output = ()> + Send + '_;
}

/// Resolves once `done()` holds, checked whenever `notify` is notified (armed before each
/// check, so no notification is missed).
pub(crate) async fn wait_notified(notify: &Notify, done: impl Fn() -> bool) {
    loop {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if done() {
            return;
        }
        notified.await;
    }
}

/// Runs `read` until it ends or the channel stops, then stops the channel as the way it ended
/// says: `None` is the peer's goodbye, an error a failure (unless the channel had stopped).
pub(crate) async fn read_until_stopped<S: Stoppable>(state: &S, read: impl Future<Output = Option<io::Error>>) {
    let why = tokio::select! {
        biased;
        () = state.wait_stopped() => Some(io::Error::other("the channel stopped")),
        why = read => why,
    };
    match why {
        None => state.stop_as("the peer said goodbye", Stop::Goodbye),
        Some(e) if !state.has_stopped() => state.stop_as(&format!("reading: {e}"), Stop::Failed),
        Some(_) => {}
    }
}

/// Stops the channel when the reading task ends, however it ends (not after the peer's
/// goodbye: that stop is final and fails nothing).
pub(crate) struct StopOnDrop<S: Stoppable>(pub Arc<S>);

impl<S: Stoppable> Drop for StopOnDrop<S> {
    fn drop(&mut self) {
        if !self.0.has_stopped() {
            self.0.stop_as("the reading task ended", Stop::GivenUp);
        }
    }
}
