//! The serving side: every client answers RPC requests by itself, one task per request (up to
//! a bound), so a slow or panicking handler never stops the others.

use std::sync::{Arc, Weak};

use bytes::Bytes;
use tokio::sync::mpsc;

use super::body::RpcBytes;
use super::{HandlerError, RpcContext, Status};
use crate::comm::Inner;
use crate::comm::NexarClient;
use crate::comm::state::CommState;
use crate::proto::message::PeerMsg;
use crate::transport::link::Incoming;

/// Text of a panic payload.
pub(crate) fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic".to_string()
    }
}

/// Runs the handler for `func` on `body`, for the call `ctx` describes: `(status, reply bytes)`.
pub(crate) async fn run_handler(
    registry: &super::Registry,
    func: u64,
    sig: u64,
    ctx: RpcContext,
    body: RpcBytes,
) -> (Status, Bytes) {
    match registry.get(func) {
        None => (Status::Unknown, Bytes::new()),
        Some(h) if h.sig_hash != sig => (Status::Signature, Bytes::from_static(h.signature.as_bytes())),
        Some(h) => match tokio::spawn((h.handle)(ctx, body)).await {
            Ok(Ok(bytes)) => (Status::Ok, bytes),
            Ok(Err(HandlerError::Codec(text))) => (Status::Codec, text.into()),
            Ok(Err(HandlerError::Refused(text))) => (Status::Refused, text.into()),
            Err(e) if e.is_panic() => (Status::Panicked, panic_text(e.into_panic()).into()),
            Err(e) => (Status::Panicked, e.to_string().into()),
        },
    }
}

/// Answers the requests that arrive on the `rpc_requests` lane, running at most
/// `max_handlers` at once: beyond that the lane stops being read, which holds up the callers
/// (and only them) instead of spawning without bound. Handlers that ask for a client get one
/// on the `world` communicator.
pub(crate) async fn serve_requests(
    inner: Weak<Inner>,
    world: Arc<CommState>,
    mut lane: mpsc::Receiver<Incoming>,
    max_handlers: usize,
) {
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(max_handlers.max(1)));
    while let Some(incoming) = lane.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let PeerMsg::RpcRequest { req, func, sig, .. } = incoming.msg else { continue };
        let Some(registry) = inner.upgrade().map(|i| i.rpc.registry().clone()) else { return };
        let body = match RpcBytes::of_payload(&incoming.payload) {
            Ok(body) => body,
            Err(e) => {
                tracing::warn!(peer = incoming.from, req, error = %e, "dropped an rpc request");
                continue;
            }
        };
        let (inner, from, world) = (inner.clone(), incoming.from as usize, world.clone());
        // The request's share of the RPC budget is held until its answer is sent.
        let held = incoming.budget;
        tokio::spawn(async move {
            let _permit = (permit, held);
            let Some(strong) = inner.upgrade() else { return };
            // Only while the program still holds the rank: a handler's client is one of its handles.
            let user = strong.user.get().and_then(Weak::upgrade);
            let (status, reply) = match user {
                Some(user) => {
                    let ctx = RpcContext::new(from, NexarClient { user, inner: strong, comm: world });
                    run_handler(&registry, func, sig, ctx, body).await
                }
                None => {
                    drop(strong);
                    (Status::Refused, Bytes::from_static(b"the rank is shutting down"))
                }
            };
            let Some(inner) = inner.upgrade() else { return };
            let limit = inner.cfg.max_rpc_bytes.min(inner.cfg.max_message_bytes);
            let (status, reply) = if reply.len() as u64 > limit {
                let why = format!(
                    "the answer of {} bytes is larger than rank {}'s RPC limit of {limit} bytes (NEXAR_MAX_RPC_BYTES)",
                    reply.len(),
                    inner.rank
                );
                (Status::Codec, why.into())
            } else {
                (status, reply)
            };
            let msg = PeerMsg::RpcResponse { req, status: status as u8, len: reply.len() as u64 };
            if let Some(link) = inner.route(from)
                && let Err(e) = link.send(&msg, Some(reply)).await
            {
                tracing::debug!(peer = from, error = %e, "could not answer an rpc");
            }
        });
    }
}

/// Hands the responses that arrive on the `rpc_responses` lane to the waiting calls.
pub(crate) async fn serve_responses(inner: Weak<Inner>, mut lane: mpsc::Receiver<Incoming>) {
    while let Some(incoming) = lane.recv().await {
        let PeerMsg::RpcResponse { req, status, .. } = incoming.msg else { continue };
        let Some(inner) = inner.upgrade() else { return };
        // Keyed by the responder: a rank can answer only the calls made to it.
        match inner.rpc.answer(incoming.from, req) {
            Some(tx) => {
                let _ = tx.send((status, incoming.payload));
            }
            None => tracing::warn!(
                peer = incoming.from,
                req,
                "dropped an rpc response: no call with this id is waiting for this rank (it was not asked, or the call \
                 already ended)"
            ),
        }
    }
}
