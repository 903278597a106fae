//! How a rank leaves: `shutdown()` (goodbyes, flush, close), `abort`, the program's last
//! handle dropped without `shutdown()` (the peers are told at once, with the reason), and the
//! last reference to the rank dropped.

use std::sync::Arc;
use std::time::Duration;

use quinn::{Connection, Endpoint};

use crate::comm::client::{Inner, NexarClient};
use crate::proto::close::CloseCode;
use crate::proto::message::PeerMsg;
use crate::transport::links::Links;

/// How long closing waits for peers to acknowledge what was sent.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// How long dropping a client without `shutdown()` blocks, at most, so that its close reaches
/// the peers before the process exits.
const DROP_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// On that path, how long each of the flush and the bulk goodbyes may take: together well
/// inside [`DROP_CLOSE_WAIT`], so that the connection close (which carries the reason) is sent
/// before the process exits even when the peers are slow to acknowledge (a busy machine).
/// With [`FLUSH_LIMIT`] there, a slow flush outlasted the wait and the peers learnt of the
/// departure only from the idle timeout.
const DROP_FLUSH_LIMIT: Duration = Duration::from_millis(300);

/// On that path, how long the connections' drivers get to send the close frames once queued.
const DROP_SEND_CLOSE: Duration = Duration::from_millis(200);

impl NexarClient {
    /// Leaves the cluster cleanly, like `MPI_Finalize`: flushes everything this rank has sent
    /// (until each peer has acknowledged it), tells every peer goodbye, and keeps serving them
    /// until each has said goodbye too (or its connection is gone, or `op_timeout` passes);
    /// then closes the connections. Every rank calls it before its process exits. Other clones
    /// of this client stop working too.
    pub async fn shutdown(&self) {
        // The last rooted collectives' confirmations, which the peers collect here too.
        self.settle_before_leaving(FLUSH_LIMIT).await;
        let inner = &self.inner;
        inner.health.begin_shutdown();
        // Goodbyes first, to everyone, so no peer takes the quiet that follows for a failure;
        // then wait (all links at once) until peers have acknowledged everything sent.
        for link in inner.links.iter() {
            if let Err(e) = link.send_queued(&PeerMsg::Goodbye, None).await {
                tracing::debug!(peer = link.peer(), error = %e, "could not say goodbye");
            }
        }
        flush_all(&inner.links, FLUSH_LIMIT).await;
        let all_gone = async {
            loop {
                let notified = inner.goodbyes.notified();
                let waiting = inner
                    .links
                    .iter()
                    .any(|l| !inner.health.has_left(l.peer() as usize) && l.connection().close_reason().is_none());
                if !waiting {
                    return;
                }
                // Re-check now and then: a peer whose connection dies sends no goodbye.
                let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
            }
        };
        // A peer that never calls shutdown() is not waited for longer than it would take to
        // declare it dead.
        let limit = inner.cfg.heartbeat_timeout.min(inner.cfg.op_timeout);
        if tokio::time::timeout(limit, all_gone).await.is_err() {
            let missing: Vec<usize> =
                inner.links.iter().map(|l| l.peer() as usize).filter(|&p| !inner.health.has_left(p)).collect();
            tracing::warn!(
                rank = inner.rank,
                ?missing,
                "shutdown: ranks {missing:?} did not say goodbye within {limit:?} (they never called shutdown()); \
                 closing anyway"
            );
        }
        close_all(&inner.links, inner.seed.as_ref(), &inner.endpoint, "shutdown", FLUSH_LIMIT, false).await;
        inner.mailbox.close();
        inner.coll.close();
        let _ = tokio::time::timeout(Duration::from_secs(1), inner.endpoint.wait_idle()).await;
    }
}

/// Flushes every link at once, for at most `limit` in all.
async fn flush_all(links: &Links, limit: Duration) {
    let all = async {
        let mut waits = Vec::new();
        for link in links.iter() {
            waits.extend(link.begin_flush().await);
        }
        for wait in waits {
            let _ = wait.await;
        }
    };
    let _ = tokio::time::timeout(limit, all).await;
}

/// Waits for every future, one after the other.
async fn wait_all(all: Vec<crate::transport::bulk::BulkClosed>) {
    for f in all {
        f.await;
    }
}

/// Closes every link with `reason` (each flushed and told goodbye for at most `limit`), then
/// the seed's connection and the endpoint. When `send_close`, waits (briefly) until the
/// connections' drivers have sent the close frames, which `close` only queues.
async fn close_all(
    links: &Links,
    seed: Option<&Connection>,
    endpoint: &Endpoint,
    reason: &str,
    limit: Duration,
    send_close: bool,
) {
    flush_all(links, limit).await;
    let goodbyes: Vec<_> = links.iter().map(|link| link.bulk_slot().goodbye()).collect();
    let _ = tokio::time::timeout(limit, wait_all(goodbyes)).await;
    for link in links.iter() {
        link.close(CloseCode::Shutdown, reason);
    }
    if let Some(seed) = seed {
        seed.close(CloseCode::Shutdown.value().into(), b"shutdown");
    }
    endpoint.close(CloseCode::Shutdown.value().into(), reason.as_bytes());
    if send_close {
        let _ = tokio::time::timeout(DROP_SEND_CLOSE, endpoint.wait_idle()).await;
    }
}

/// Runs `close` in the background on the current runtime, or, without one, closes `endpoint`
/// at once. When the rank leaves `unannounced` (the process may be about to exit: `main`
/// returned) on a runtime whose other threads can run the close, waits up to
/// [`DROP_CLOSE_WAIT`] for it to reach the peers.
fn run_close(close: impl Future<Output = ()> + Send + 'static, endpoint: &Endpoint, unannounced: bool) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        endpoint.close(CloseCode::Shutdown.value().into(), b"shutdown");
        return;
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    handle.spawn(async move {
        close.await;
        let _ = done_tx.send(());
    });
    if unannounced && handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
        let _ = done_rx.recv_timeout(DROP_CLOSE_WAIT);
    }
}

impl Inner {
    /// The program dropped its last handle without `shutdown()` (an error returned with `?`,
    /// a panic): close every link now with the reason, so the peers fail at once naming this
    /// rank, and give the close a moment to leave before the process may exit. Done here and
    /// not only when `Inner` drops, because a task of nexar's may hold `Inner` a little longer,
    /// until the runtime itself is torn down, when nothing can be sent any more.
    pub(in crate::comm) fn leave_unannounced(self: Arc<Self>) {
        if self.health.is_shutting_down() || self.left.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let reason = unannounced_reason(self.rank);
        let endpoint = self.endpoint.clone();
        let inner = self;
        let close = async move {
            close_all(&inner.links, inner.seed.as_ref(), &inner.endpoint, &reason, DROP_FLUSH_LIMIT, true).await;
        };
        run_close(close, &endpoint, true);
    }

    /// Closes every connection at once with `reason` (see [`NexarClient::abort`]).
    pub(crate) fn abort_all(&self, reason: &str) {
        self.health.begin_shutdown();
        for link in self.links.iter() {
            link.close(CloseCode::Abort, reason);
        }
        self.endpoint.close(CloseCode::Abort.value().into(), reason.as_bytes());
        self.mailbox.close();
        self.coll.close();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in self.tasks.get_mut().map(std::mem::take).unwrap_or_default() {
            task.abort();
        }
        if *self.left.get_mut() {
            return;
        }
        let links = std::mem::take(&mut self.links);
        let endpoint = self.endpoint.clone();
        let seed = self.seed.take();
        // Without `shutdown()`, peers learn at once that this rank left, and why, rather than
        // from a heartbeat timeout: the way a program that returns an error with `?` ends.
        let clean = self.health.is_shutting_down();
        let reason = if clean { "shutdown".to_string() } else { unannounced_reason(self.rank) };
        let limit = if clean { FLUSH_LIMIT } else { DROP_FLUSH_LIMIT };
        let close = async move { close_all(&links, seed.as_ref(), &endpoint, &reason, limit, !clean).await };
        run_close(close, &self.endpoint, !clean);
    }
}

/// Why a rank that dropped its client without `shutdown()` left, as its peers are told.
fn unannounced_reason(rank: usize) -> String {
    format!("rank {rank} dropped its client without calling shutdown() (its program ended or failed)")
}
