//! The router of a link: it accepts the peer's streams and reads each one, checking every
//! message and reading a payload only once its budget, and its mailbox, can take it.

use std::sync::Arc;

use quinn::{Connection, RecvStream};
use tracing::Instrument;

use super::super::byte_budget::ByteBudget;
use super::super::framed::{Payload, ReadFrameError, read_body, read_header};
use super::{Incoming, Lane, LaneSenders};
use crate::proto::announce::{announced_payload, raw_length_disagrees};
use crate::proto::close::CloseCode;
use crate::proto::frame::{FrameError, FrameKind, MAX_CONTROL_FRAME};
use crate::proto::message::{self, PeerMsg};
use crate::transport::inbox::Admission;

/// Payload bytes a peer may have on their way into this rank at once on one lane, over all
/// its streams: read but not yet handed to a mailbox or a collective. A message larger than
/// this still goes through, alone, so no size the message limit allows waits for ever. Each
/// lane has its own budget, so a lane that waits for its mailbox (unmatched messages) never
/// holds up another lane's messages, as before.
pub const INFLIGHT_BYTES_PER_LANE: u64 = 64 << 20;

pub(super) async fn route(
    conn: Connection,
    peer: u32,
    lanes: LaneSenders,
    max_payload: u64,
    violation: Arc<std::sync::OnceLock<String>>,
) {
    let budget: Arc<[ByteBudget; Lane::COUNT]> =
        Arc::new(std::array::from_fn(|_| ByteBudget::new(INFLIGHT_BYTES_PER_LANE)));
    loop {
        match conn.accept_uni().await {
            Ok(recv) => {
                let conn = conn.clone();
                let (lanes, budget, violation) = (lanes.clone(), budget.clone(), violation.clone());
                tokio::spawn(
                    async move {
                        if let Err(error) = read_stream(recv, &conn, peer, &lanes, max_payload, &budget).await {
                            tracing::error!(peer, %error, "closing the connection: the peer broke the wire protocol");
                            // Before the close, so that whoever sees the connection end finds it.
                            let _ = violation.set(error.to_string());
                            conn.close(CloseCode::ProtocolViolation.value().into(), error.to_string().as_bytes());
                        }
                    }
                    .in_current_span(),
                );
            }
            Err(e) => {
                tracing::debug!(peer, reason = %e, "connection closed");
                return;
            }
        }
    }
}

/// Reads frames from one stream until it ends. Only protocol violations are errors; a stream
/// that closes mid-frame because the connection went away ends quietly.
async fn read_stream(
    mut recv: RecvStream,
    conn: &Connection,
    peer: u32,
    lanes: &LaneSenders,
    max_payload: u64,
    budget: &[ByteBudget; Lane::COUNT],
) -> Result<(), FrameError> {
    loop {
        let msg: PeerMsg = match next_message(&mut recv).await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()),
            Err(ReadFrameError::Closed(_)) => return Ok(()),
            Err(ReadFrameError::Frame(e)) => return Err(e),
        };
        let (mut held, mut admitted, mut budget_held) = (None, None, None);
        let payload = match announced_payload(&msg, max_payload)? {
            None => Payload::default(),
            Some((expected, limit)) => match read_header(&mut recv, limit).await {
                Ok(Some(h)) => {
                    h.expect(FrameKind::Raw)?;
                    if h.len != expected {
                        return Err(raw_length_disagrees(expected, h.len));
                    }
                    // Until the budget has room, this stream is not read, and QUIC's flow
                    // control holds the peer.
                    match budget[Lane::of(&msg) as usize].take(h.len).await {
                        Some(permit) => held = Some(permit),
                        None => return Ok(()),
                    }
                    // RPC requests and answers, and relay envelopes, are read only once the
                    // rank's budget for them has room.
                    if let Some(budget) = lanes.byte_budget(&msg) {
                        if matches!(msg, PeerMsg::RpcRequest { .. } | PeerMsg::RpcResponse { .. })
                            && h.len > budget.limit()
                        {
                            return Err(FrameError::TooLong { len: h.len, limit: budget.limit() });
                        }
                        tokio::select! {
                            permit = budget.take(h.len) => match permit {
                                Some(p) => budget_held = Some(p),
                                None => return Ok(()),
                            },
                            _ = conn.closed() => return Ok(()),
                        }
                    }
                    // A message for a matching store is read only once the store can take it.
                    match lanes.admission(&msg, peer, h.len) {
                        Some(Admission::Now(a)) => admitted = Some(a),
                        Some(Admission::Wait(wait)) => tokio::select! {
                            a = wait => admitted = Some(a),
                            _ = conn.closed() => return Ok(()),
                        },
                        None => {}
                    }
                    match Payload::read(&mut recv, h.len).await {
                        Ok(p) => p,
                        Err(ReadFrameError::Frame(e)) => return Err(e),
                        Err(ReadFrameError::Closed(_)) => return Ok(()),
                    }
                }
                Ok(None) | Err(ReadFrameError::Closed(_)) => return Ok(()),
                Err(ReadFrameError::Frame(e)) => return Err(e),
            },
        };
        // The reservation ends as the message is counted as held.
        drop(admitted);
        let delivered = lanes.deliver(Incoming { from: peer, msg, payload, budget: budget_held }).await;
        drop(held);
        if delivered.is_err() {
            return Ok(());
        }
    }
}

async fn next_message(recv: &mut RecvStream) -> Result<Option<PeerMsg>, ReadFrameError> {
    let Some(header) = read_header(recv, MAX_CONTROL_FRAME).await? else {
        return Ok(None);
    };
    header.expect(FrameKind::Message)?;
    let body = read_body(recv, header.len).await?;
    Ok(Some(message::decode(&body)?))
}
