//! A lane's writer task: it owns the lane's outgoing QUIC stream (or hands large collective
//! groups to the link's bulk channel) and writes each queued message whole.

use std::sync::Arc;

use bytes::Bytes;
use quinn::Connection;
use tokio::sync::mpsc;

use super::super::TransportError;
use super::super::bulk::BulkSlot;
use super::{Outgoing, peer_name};
use crate::telemetry::SentBytes;

/// Groups a link may have on its bulk channel at once before its writer waits for the oldest.
const BULK_IN_FLIGHT: usize = 16;

pub(super) async fn write_lane(
    conn: Connection,
    peer: u32,
    priority: i32,
    bulk: Option<Arc<BulkSlot>>,
    sent_bytes: Arc<SentBytes>,
    mut rx: mpsc::Receiver<Outgoing>,
) {
    let mut stream: Option<quinn::SendStream> = None;
    let mut broken: Option<TransportError> = None;
    // Groups handed to the bulk channel and not yet done, oldest first.
    let mut on_bulk: std::collections::VecDeque<tokio::task::JoinHandle<()>> = Default::default();
    while let Some(out) = rx.recv().await {
        let (mut chunks, done, coll) = match out {
            Outgoing::Frames { chunks, done, coll } => (chunks, done, coll),
            Outgoing::Flush { done } => {
                for sent in on_bulk.drain(..) {
                    let _ = sent.await;
                }
                if let Some(mut s) = stream.take() {
                    let _ = s.finish();
                    let _ = s.stopped().await;
                }
                let _ = done.send(());
                continue;
            }
        };
        if let Some(e) = &broken {
            let _ = done.send(Err(e.clone()));
            continue;
        }
        if let (Some(slot), Some(coll)) = (&bulk, coll) {
            let len = chunks.iter().map(Bytes::len).sum();
            match slot.route(coll, len) {
                Ok(channel) => {
                    while on_bulk.len() >= BULK_IN_FLIGHT {
                        if let Some(oldest) = on_bulk.pop_front() {
                            let _ = oldest.await;
                        }
                    }
                    sent_bytes.bulk(channel.name(), len);
                    let sent = channel.send(chunks);
                    let slot = Arc::downgrade(slot);
                    on_bulk.push_back(tokio::spawn(async move {
                        let result = sent.await;
                        if result.is_err()
                            && let Some(slot) = slot.upgrade()
                        {
                            slot.channel_stopped();
                        }
                        let _ = done.send(result);
                    }));
                    continue;
                }
                // The channel failed and may have lost earlier messages of this collective: a
                // later one over QUIC could be taken for them, so it is not sent.
                Err(true) => {
                    let _ = done.send(Err(slot.lost()));
                    continue;
                }
                Err(false) => {}
            }
        }
        let s = match &mut stream {
            Some(s) => s,
            None => match conn.open_uni().await {
                Ok(s) => {
                    let _ = s.set_priority(priority);
                    stream.insert(s)
                }
                Err(e) => {
                    let err = TransportError::ConnectionLost { peer: peer_name(peer), reason: e.to_string() };
                    broken = Some(err.clone());
                    let _ = done.send(Err(err));
                    continue;
                }
            },
        };
        let len = chunks.iter().map(Bytes::len).sum();
        let result = s
            .write_all_chunks(&mut chunks)
            .await
            .map_err(|e| TransportError::ConnectionLost { peer: peer_name(peer), reason: e.to_string() });
        match &result {
            Ok(()) => sent_bytes.quic(len),
            Err(e) => broken = Some(e.clone()),
        }
        let _ = done.send(result);
    }
    if let Some(mut s) = stream {
        let _ = s.finish();
    }
}
