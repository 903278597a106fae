//! Typed, tagged point-to-point messages.
//!
//! A message is matched by `(source, tag)` on the receiving rank; messages between one pair of
//! ranks with the same tag arrive in the order they were sent (MPI's non-overtaking rule).

pub(in crate::comm) mod segments;

use std::time::Duration;

use crate::transport::pool::pooled_copy;
use nexar_types::{DType, Element, RecvBuf, SendBuf};

use tracing::Instrument;

use crate::comm::client::NexarClient;
use crate::comm::matcher::{Held, Key, Refusal};
use crate::comm::p2p::segments::send_through_channel;
use crate::proto::message::PeerMsg;
use crate::trace::{OpClass, OpDesc, OpTrace};
use crate::transport::TransportError;
use crate::transport::bulk::{Awaited, Awaiting};
use crate::transport::framed::{Payload, PayloadError};
use crate::transport::link::Incoming;

/// Failures of `send` and `recv`. Each names the rank that reports it, the operation and what
/// was expected.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum P2pError {
    /// The peer rank is outside the world.
    #[error("rank {rank} {op}: peer rank {peer} does not exist (world size {world})")]
    InvalidRank {
        /// The rank reporting.
        rank: usize,
        /// `"send"` or `"recv"`.
        op: &'static str,
        /// The rank asked for.
        peer: usize,
        /// The world size.
        world: usize,
    },
    /// The message has another number of elements than the receive buffer.
    #[error(
        "rank {rank} recv(src {src}, tag {tag}): the message holds {got} elements, the buffer {expected}; the message is kept for a matching recv"
    )]
    LengthMismatch {
        /// The rank reporting.
        rank: usize,
        /// The sender.
        src: usize,
        /// The tag.
        tag: u64,
        /// Elements the buffer holds.
        expected: u64,
        /// Elements the message holds.
        got: u64,
    },
    /// The message has another element type than the receive buffer.
    #[error(
        "rank {rank} recv(src {src}, tag {tag}): the message holds {got} elements, the buffer is {expected}; the message is kept for a matching recv"
    )]
    DTypeMismatch {
        /// The rank reporting.
        rank: usize,
        /// The sender.
        src: usize,
        /// The tag.
        tag: u64,
        /// The buffer's element type.
        expected: DType,
        /// The message's element type.
        got: DType,
    },
    /// The message's bytes could not be read as sent (altered on the way).
    #[error("rank {rank} recv(src {src}, tag {tag}): {error}")]
    Unreadable {
        /// The rank reporting.
        rank: usize,
        /// The sender.
        src: usize,
        /// The tag.
        tag: u64,
        /// What was wrong.
        error: PayloadError,
    },
    /// Too many received messages are waiting for a matching `recv`, and none matches this one:
    /// the sender has filled its share of the limits and the pool, so its link is paused.
    #[error(
        "rank {rank} recv(src {src}, tag {tag}): {held} unmatched messages ({held_bytes} bytes) are already held and rank {src} has filled its share of the limits (NEXAR_MAX_UNMATCHED_MESSAGES {limit}, NEXAR_MAX_UNMATCHED_BYTES {limit_bytes}) and the shared pool, so its link is paused; receive them or raise the limits"
    )]
    TooManyUnmatched {
        /// The rank reporting.
        rank: usize,
        /// The sender asked for.
        src: usize,
        /// The tag asked for.
        tag: u64,
        /// Messages held.
        held: usize,
        /// Bytes held.
        held_bytes: u64,
        /// The message-count limit.
        limit: usize,
        /// The byte limit.
        limit_bytes: u64,
    },
    /// A message sent in segments did not hold together (a segment of another type or
    /// length than announced): its sender broke the protocol.
    #[error("rank {rank} recv(src {src}, tag {tag}): a message sent in segments {what}")]
    BadSegments {
        /// The rank reporting.
        rank: usize,
        /// The sender.
        src: usize,
        /// The tag.
        tag: u64,
        /// What did not hold together.
        what: String,
    },
    /// The message is larger than the configured maximum.
    #[error(
        "rank {rank} send(dest {dest}, tag {tag}): {bytes} bytes exceed the {limit}-byte message limit (NEXAR_MAX_MESSAGE_BYTES)"
    )]
    TooLarge {
        /// The rank reporting.
        rank: usize,
        /// The destination.
        dest: usize,
        /// The tag.
        tag: u64,
        /// Message size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// The operation did not complete within the configured time.
    #[error("rank {rank} {op}(peer {peer}, tag {tag}) timed out after {after:?}")]
    Timeout {
        /// The rank reporting.
        rank: usize,
        /// `"send"`, `"recv"` or `"ping"`.
        op: &'static str,
        /// The peer.
        peer: usize,
        /// The tag.
        tag: u64,
        /// The limit (NEXAR_OP_TIMEOUT_MS).
        after: Duration,
    },
    /// The connection to the peer failed.
    #[error("rank {rank} {op}(peer {peer}): {source}")]
    Transport {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The peer.
        peer: usize,
        /// What the transport reported.
        source: TransportError,
    },
    /// The peer is gone (crashed, aborted or left); messages it sent before are still received.
    #[error("rank {rank} {op}: rank {peer} is gone: {reason}")]
    PeerGone {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The rank that is gone.
        peer: usize,
        /// How its connection ended.
        reason: String,
    },
    /// The buffer is in device memory that could not be read or written.
    #[error("rank {rank} {op}: {source}")]
    Device {
        /// The rank reporting.
        rank: usize,
        /// `"send"` or `"recv"`.
        op: &'static str,
        /// What the device reported.
        source: nexar_types::DeviceError,
    },
    /// This rank is shutting down.
    #[error("rank {rank} {op}: the client is shut down")]
    Closed {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
    },
}

impl PartialEq for TransportError {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl NexarClient {
    fn check_peer(&self, op: &'static str, peer: usize) -> Result<(), P2pError> {
        if peer >= self.world_size() {
            return Err(P2pError::InvalidRank { rank: self.rank(), op, peer, world: self.world_size() });
        }
        Ok(())
    }

    /// Sends `data` to rank `dest` with `tag`.
    ///
    /// Accepts a `Buf<T>`, `Vec<T>`, `[T]` or `[T; N]` of any [`Element`] type. The data is
    /// copied before this returns, so the buffer is free again at once; the future completes
    /// when the message is handed to the transport (the ring of a rank on this host, the TCP
    /// lane of one on another, QUIC where neither is up). Sending to oneself works.
    ///
    /// ```no_run
    /// # async fn run(client: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// client.send(&vec![1.5f64, 2.5], 1, 42).await?;
    /// client.send(&[7u8; 16], 1, 43).await?;
    /// # Ok(()) }
    /// ```
    pub async fn send<B: SendBuf + ?Sized>(&self, data: &B, dest: usize, tag: u64) -> Result<(), P2pError> {
        let trace = self.p2p_trace(OpClass::Send, dest, tag, <B::Elem as Element>::DTYPE, data.elems());
        let span = tracing::debug_span!("send", comm = self.comm.id, peer = dest, tag);
        let result = self.send_untraced(data, dest, tag).instrument(span).await;
        trace.end(&result);
        self.dump_if_peers_failed(&result);
        result
    }

    async fn send_untraced<B: SendBuf + ?Sized>(&self, data: &B, dest: usize, tag: u64) -> Result<(), P2pError> {
        crate::sync::take_a_turn().await;
        self.check_peer("send", dest)?;
        let view = data.host_view().map_err(|source| P2pError::Device { rank: self.rank(), op: "send", source })?;
        let elements: &[B::Elem] = &view;
        let bytes = std::mem::size_of_val(elements) as u64;
        let limit = self.config().max_message_bytes;
        if bytes > limit {
            return Err(P2pError::TooLarge { rank: self.rank(), dest, tag, bytes, limit });
        }
        let msg = PeerMsg::P2p {
            comm: self.comm.id,
            tag,
            dtype: <B::Elem as Element>::DTYPE.to_wire(),
            count: elements.len() as u64,
        };
        let after = self.config().op_timeout;
        let rank = self.rank();
        let timeout = || P2pError::Timeout { rank, op: "send", peer: dest, tag, after };
        let transport = |source| P2pError::Transport { rank, op: "send", peer: dest, source };
        if dest != rank {
            let link = self.link(dest).ok_or(P2pError::Closed { rank, op: "send" })?;
            let bytes: &[u8] = bytemuck::cast_slice(elements);
            // Shared memory with a peer of this host (the TCP lane with one of another) takes
            // the message in order, written into its ring (sealed into records) straight from
            // `data`, or copied when the ring (the lane's queue) is full; a message longer than
            // a segment goes in segments, which the peer reads from the ring in place (opens
            // into its buffer while the next is on the wire).
            let through_channel = async {
                let dtype = <B::Elem as Element>::DTYPE;
                match self.send_in_segments(&link, dest, tag, dtype, bytes).await {
                    Some(sent) => Some(sent),
                    None => send_through_channel(&link, &msg, bytes).await,
                }
            };
            match tokio::time::timeout(after, through_channel).await {
                Ok(Some(result)) => return result.map_err(transport),
                Ok(None) => {}
                Err(_) => return Err(timeout()),
            }
        }
        let payload = pooled_copy(&self.inner.pool, bytemuck::cast_slice(elements));
        if dest == rank {
            let incoming = Incoming::new(self.world_rank() as u32, msg, Payload::from_bytes(payload));
            return match tokio::time::timeout(after, self.inner.self_lanes.deliver(incoming)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) => Err(P2pError::Closed { rank, op: "send" }),
                Err(_) => Err(timeout()),
            };
        }
        let link = self.link(dest).ok_or(P2pError::Closed { rank, op: "send" })?;
        match tokio::time::timeout(after, link.send(&msg, Some(payload))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(transport(source)),
            Err(_) => Err(timeout()),
        }
    }

    /// Receives the oldest message from rank `src` with `tag` into `buf`.
    ///
    /// The message must hold exactly `buf.len()` elements of `buf`'s element type; otherwise
    /// this returns [`P2pError::LengthMismatch`] or [`P2pError::DTypeMismatch`] and the message
    /// stays queued for a `recv` that matches it. Messages with other tags are kept for their
    /// own `recv`s. Waits at most `op_timeout`. Cancelling the future loses nothing.
    ///
    /// ```no_run
    /// # async fn run(client: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let mut buf = nexar::Buf::<f64>::zeros(2);
    /// client.recv(&mut buf, 0, 42).await?;
    /// # Ok(()) }
    /// ```
    pub async fn recv<B: RecvBuf + ?Sized>(&self, buf: &mut B, src: usize, tag: u64) -> Result<(), P2pError> {
        let trace = self.p2p_trace(OpClass::Recv, src, tag, <B::Elem as Element>::DTYPE, buf.elems());
        let span = tracing::debug_span!("recv", comm = self.comm.id, peer = src, tag);
        let result = self.recv_untraced(buf, src, tag).instrument(span).await;
        trace.end(&result);
        self.dump_if_peers_failed(&result);
        result
    }

    async fn recv_untraced<B: RecvBuf + ?Sized>(&self, buf: &mut B, src: usize, tag: u64) -> Result<(), P2pError> {
        let device = |source| P2pError::Device { rank: self.rank(), op: "recv", source };
        let mut out = buf.host_stage().map_err(device)?;
        let expected = out.len() as u64;
        let key = self.p2p_key(src, tag)?;
        let max_len = expected.saturating_mul(std::mem::size_of::<B::Elem>() as u64);
        let held = self.take(key, src, "recv", max_len).await?;
        let rank = self.rank();
        let want = <B::Elem as Element>::DTYPE;
        if held.dtype != want {
            let got = held.dtype;
            self.inner.mailbox.put_back(key, held);
            return Err(P2pError::DTypeMismatch { rank, src, tag, expected: want, got });
        }
        if held.count != expected {
            let got = held.count;
            self.inner.mailbox.put_back(key, held);
            return Err(P2pError::LengthMismatch { rank, src, tag, expected, got });
        }
        if let Some(segments) = held.segments {
            self.receive_segments(key, src, held, segments, bytemuck::cast_slice_mut(&mut out)).await?;
            return out.commit().map_err(device);
        }
        held.payload.copy_to(bytemuck::cast_slice_mut(&mut out)).map_err(|error| P2pError::Unreadable {
            rank,
            src,
            tag,
            error,
        })?;
        out.commit().map_err(device)
    }

    /// Receives the oldest message from `src` with `tag`, whatever its length, into a new
    /// vector. The element type must match.
    ///
    /// ```no_run
    /// # async fn run(client: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let words: Vec<u32> = client.recv_vec(0, 9).await?;
    /// # Ok(()) }
    /// ```
    pub async fn recv_vec<T: Element>(&self, src: usize, tag: u64) -> Result<Vec<T>, P2pError> {
        let trace = self.p2p_trace(OpClass::Recv, src, tag, T::DTYPE, 0);
        let span = tracing::debug_span!("recv", comm = self.comm.id, peer = src, tag);
        let result = self.recv_vec_untraced(src, tag).instrument(span).await;
        if let Ok(v) = &result {
            trace.sized(v.len(), std::mem::size_of_val(v.as_slice()));
        }
        trace.end(&result);
        self.dump_if_peers_failed(&result);
        result
    }

    async fn recv_vec_untraced<T: Element>(&self, src: usize, tag: u64) -> Result<Vec<T>, P2pError> {
        let key = self.p2p_key(src, tag)?;
        let held = self.take(key, src, "recv", u64::MAX).await?;
        if held.dtype != T::DTYPE {
            let got = held.dtype;
            self.inner.mailbox.put_back(key, held);
            return Err(P2pError::DTypeMismatch { rank: self.rank(), src, tag, expected: T::DTYPE, got });
        }
        if let Some(segments) = held.segments {
            // The count is the sender's word, not a length the router checked: bounded first.
            let bytes = held.count.checked_mul(std::mem::size_of::<T>() as u64);
            let limit = self.config().max_message_bytes;
            if bytes.is_none_or(|b| b > limit) {
                let what = format!("announces {} elements, more than the {limit}-byte message limit", held.count);
                return Err(P2pError::BadSegments { rank: self.rank(), src, tag, what });
            }
            let mut out = vec![T::zeroed(); held.count as usize];
            self.receive_segments(key, src, held, segments, bytemuck::cast_slice_mut(&mut out)).await?;
            return Ok(out);
        }
        // The router checked `count * size == payload length` before delivering.
        let mut out = vec![T::zeroed(); held.count as usize];
        held.payload.copy_to(bytemuck::cast_slice_mut(&mut out)).map_err(|error| P2pError::Unreadable {
            rank: self.rank(),
            src,
            tag,
            error,
        })?;
        Ok(out)
    }

    /// Measures a round trip to `peer` on the control lane.
    ///
    /// ```no_run
    /// # async fn run(client: nexar::NexarClient) -> Result<(), nexar::NexarError> {
    /// let rtt = client.ping(1).await?;
    /// println!("rank 1 is {rtt:?} away");
    /// # Ok(()) }
    /// ```
    pub async fn ping(&self, peer: usize) -> Result<Duration, P2pError> {
        self.check_peer("ping", peer)?;
        let rank = self.rank();
        let link = self.link(peer).ok_or(P2pError::Closed { rank, op: "ping" })?;
        let nonce: u64 = rand::random();
        let (tx, rx) = tokio::sync::oneshot::channel();
        crate::sync::lock(&self.inner.pings).insert(nonce, tx);
        let start = std::time::Instant::now();
        let after = self.config().op_timeout;
        let result = tokio::time::timeout(after, async {
            link.send(&PeerMsg::Ping { nonce }, None).await.map_err(|source| P2pError::Transport {
                rank,
                op: "ping",
                peer,
                source,
            })?;
            rx.await.map_err(|_| P2pError::Closed { rank, op: "ping" })
        })
        .await;
        crate::sync::lock(&self.inner.pings).remove(&nonce);
        match result {
            Ok(Ok(())) => Ok(start.elapsed()),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(P2pError::Timeout { rank, op: "ping", peer, tag: 0, after }),
        }
    }

    fn p2p_key(&self, src: usize, tag: u64) -> Result<Key, P2pError> {
        self.check_peer("recv", src)?;
        Ok(Key { comm: self.comm.id, src: self.comm.members[src] as u32, tag, part: 0 })
    }

    /// Dumps the flight recorder when a point-to-point operation timed out or lost its peer.
    fn dump_if_peers_failed<T>(&self, result: &Result<T, P2pError>) {
        if let Err(e @ (P2pError::Timeout { .. } | P2pError::PeerGone { .. } | P2pError::Transport { .. })) = result {
            self.inner.trace.dump_after_failure(&e.to_string());
        }
    }

    /// Starts the flight-recorder entry of a point-to-point operation with communicator rank
    /// `peer`.
    fn p2p_trace(&self, class: OpClass, peer: usize, tag: u64, dtype: DType, count: usize) -> OpTrace<'_> {
        self.inner.trace.recorder.start(OpDesc {
            class,
            comm: self.comm.id,
            seq: tag,
            op: class.name(),
            kind: 0,
            dtype: Some(dtype),
            count: count as u64,
            root: None,
            peer: self.comm.members.get(peer).map(|&w| w as u32),
            algorithm: "",
            bytes: (count * dtype.size()) as u64,
        })
    }

    /// Takes the message for `key`, a payload of at most `max_len` bytes (a larger one is not
    /// read for this receive while the unmatched-message limits have no room for it).
    pub(super) async fn take(&self, key: Key, src: usize, op: &'static str, max_len: u64) -> Result<Held, P2pError> {
        crate::sync::take_a_turn().await;
        let rank = self.rank();
        let tag = key.tag;
        let refused = |r: Refusal| match r {
            Refusal::Full { held, held_bytes } => P2pError::TooManyUnmatched {
                rank,
                src,
                tag,
                held,
                held_bytes,
                limit: self.config().max_unmatched_messages,
                limit_bytes: self.config().max_unmatched_bytes,
            },
            Refusal::Closed | Refusal::Aborted(_) | Refusal::LinkFailed(_) => P2pError::Closed { rank, op },
            Refusal::SourceGone(reason) => P2pError::PeerGone { rank, op, peer: src, reason },
        };
        // Shared memory with a peer of this host is read on this task while it spins.
        let link = self.inner.links.get(key.src as usize);
        // A message sent whole comes straight back where the link's channel has it whole.
        let awaited = (key.part == 0).then_some(Awaited::PointToPoint { comm: key.comm, tag: key.tag });
        let read_link = |awaiting: Option<Awaiting<'_>>| link.and_then(|l| l.bulk_deliver_ready(awaiting));
        let spin = Some(&self.inner.spin);
        if let Some(held) = crate::comm::exec::spin::spin_take(&self.inner.mailbox, key, spin, awaited, None, read_link)
            .await
            .map_err(refused)?
        {
            return Ok(held);
        }
        let pending = match self.inner.mailbox.take_or_wait_for(key, max_len).map_err(refused)? {
            Ok(held) => return Ok(held),
            Err(pending) => pending,
        };
        let after = self.config().op_timeout;
        match tokio::time::timeout(after, pending.wait()).await {
            Ok(Ok(held)) => Ok(held),
            Ok(Err(r)) => Err(refused(r)),
            Err(_) => Err(P2pError::Timeout { rank, op, peer: src, tag, after }),
        }
    }
}
