//! The layer's background task: it reduces the buckets one after the other, in the order they
//! were sent (the same on every rank), on one communicator.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::flat::Flat;
use super::hook::{self, CommHook, HookState, MatrixPart};
use crate::comm::{CollectiveError, NexarClient};

/// A bucket sent to the background task.
pub(super) struct Job {
    pub(super) step: u64,
    pub(super) bucket: usize,
    pub(super) data: Flat,
    pub(super) state: HookState,
    pub(super) reply: oneshot::Sender<Done>,
}

/// A bucket back from the background task, with its memory whatever the outcome.
pub(super) struct Done {
    pub(super) data: Flat,
    pub(super) state: HookState,
    pub(super) result: Result<(), CollectiveError>,
}

/// The background task that reduces buckets one after the other, in the order they were
/// sent (the same on every rank), on one communicator.
pub(super) struct Driver;

impl Driver {
    pub(super) fn start(
        comm: &NexarClient,
        hook: CommHook,
        parts: Arc<[Vec<MatrixPart>]>,
    ) -> mpsc::UnboundedSender<Job> {
        let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
        let comm = comm.clone();
        tokio::spawn(async move {
            // Once a bucket of a step fails, the rest of that step fail with it at once
            // instead of each waiting out its own timeout on a broken communicator.
            let mut failed: Option<(u64, CollectiveError)> = None;
            while let Some(mut job) = rx.recv().await {
                let result = match &failed {
                    Some((step, e)) if *step == job.step => Err(e.clone()),
                    _ => {
                        let parts = &parts[job.bucket];
                        hook::reduce(&comm, &hook, &mut job.state, &mut job.data, parts, job.step).await
                    }
                };
                if let Err(e) = &result {
                    tracing::warn!(rank = comm.rank(), step = job.step, bucket = job.bucket, "ddp bucket failed: {e}");
                    failed = Some((job.step, e.clone()));
                }
                let _ = job.reply.send(Done { data: job.data, state: job.state, result });
            }
        });
        tx
    }
}
