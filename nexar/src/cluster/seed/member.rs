//! A joined worker's connection to the seed: progress notes while the cluster forms, the peer
//! table once it has, and the seed's last words when it closes first.

use quinn::{Connection, SendStream};
use tokio::sync::watch;

use super::slots::release_slot;
use super::{CLOSE_WITHIN, PROGRESS_EVERY, Shared};
use crate::proto::message::SeedResponse;
use crate::transport::framed::{ReadFrameError, write_message};

/// After the welcome: publish the table when it is complete, then stay connected until the
/// worker leaves. A worker that leaves before the cluster forms frees its rank. When the seed
/// closes first, the worker gets its last words.
pub(super) async fn serve_member(
    shared: &Shared,
    conn: &Connection,
    send: &mut SendStream,
    rank: usize,
) -> Result<(), String> {
    let mut table = shared.table.subscribe();
    let mut progress = shared.progress.subscribe();
    progress.mark_changed();
    let mut closing = shared.closing.subscribe();
    let addrs = loop {
        let note = tokio::select! {
            biased;
            reason = closing_reason(&mut closing) => return say_goodbye(shared, send, rank, reason).await,
            formed = async { table.wait_for(|t| t.is_some()).await.is_ok() } => {
                if !formed {
                    return Err("seed stopping".to_string());
                }
                None
            }
            changed = progress.changed() => {
                if changed.is_err() {
                    return Err("seed stopping".to_string());
                }
                Some(progress_note(shared))
            }
            reason = conn.closed() => {
                release_slot(shared, rank);
                return Err(format!("rank {rank} left before the cluster formed ({reason}); its rank is free again"));
            }
        };
        let Some(note) = note else {
            // A worker that joins the running cluster gets the table as it is now.
            break crate::sync::lock(&shared.slots).table();
        };
        write_message(send, &note).await.map_err(|e| format!("rank {rank} lost while waiting: {e}"))?;
        // Coalesce notes, but not at the table's or the last words' expense.
        let formed = async { table.wait_for(|t| t.is_some()).await.is_ok() };
        let _ = tokio::time::timeout(PROGRESS_EVERY, async {
            tokio::select! {
                _ = formed => {}
                _ = closing_reason(&mut closing) => {}
            }
        })
        .await;
    };
    let (keys, relay_keys) = crate::sync::lock(&shared.slots).keys(addrs.len());
    let msg = SeedResponse::PeerTable {
        cluster_id: shared.cluster_id,
        addrs: addrs.iter().map(|a| a.to_string()).collect(),
        keys,
        relay_keys,
    };
    write_message(send, &msg).await.map_err(|e| format!("rank {rank} lost before the peer table: {e}"))?;
    tokio::select! {
        _ = conn.closed() => {}
        // The seed's endpoint closes the connection after the last words.
        _ = closing_reason(&mut closing) => return Ok(()),
    }
    tracing::debug!(rank, "worker disconnected from the seed");
    release_slot(shared, rank);
    Ok(())
}

/// The note waiting workers get: how many have joined, and the last refusals.
fn progress_note(shared: &Shared) -> SeedResponse {
    let p = shared.progress.borrow();
    SeedResponse::Progress { joined: p.joined as u32, world_size: shared.world as u32, refused: p.refused.clone() }
}

/// Waits until the seed is closing, and says why.
async fn closing_reason(closing: &mut watch::Receiver<Option<String>>) -> String {
    let reason = closing.wait_for(|c| c.is_some()).await.map(|r| (*r).clone().unwrap_or_default());
    match reason {
        Ok(reason) => reason,
        // The seed itself is gone: nothing to wait for.
        Err(_) => std::future::pending().await,
    }
}

/// A waiting worker's last words from a closing seed: the last progress note, then why the
/// seed closes (as a refusal), and the end of the stream, which the worker acknowledges.
async fn say_goodbye(shared: &Shared, send: &mut SendStream, rank: usize, reason: String) -> Result<(), String> {
    let note = progress_note(shared);
    let said = async {
        write_message(send, &note).await?;
        write_message(send, &SeedResponse::Reject { reason: reason.clone() }).await?;
        let _ = send.finish();
        let _ = send.stopped().await;
        Ok::<_, ReadFrameError>(())
    };
    match tokio::time::timeout(CLOSE_WITHIN, said).await {
        Ok(Ok(())) => Err(format!("the seed closed before the cluster formed ({reason}); rank {rank} was told")),
        Ok(Err(e)) => Err(format!("rank {rank} lost while the seed closed: {e}")),
        Err(_) => Err(format!("rank {rank} did not acknowledge the seed's last words within {CLOSE_WITHIN:?}")),
    }
}
