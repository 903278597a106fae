//! Point-to-point messages longer than a segment, sent in segments where the link's bulk
//! channel carries point-to-point messages (shared memory with a rank of this host, the TCP
//! lane with a rank of another).
//!
//! A ring lends a payload to the receiver in place only up to a quarter of its length, so one
//! 4 MiB message was copied four times (into a staging copy, into the ring, out of it into a
//! receive buffer, into the destination). In 1 MiB segments it is copied twice: from the
//! caller's buffer into the ring, and from the ring into the destination. On the TCP lane,
//! segments let the receiver open (decrypt) one into the destination while the next is on the
//! wire, where a whole message would be read to its end first.
//!
//! Segment 0 is matched as an unsegmented message with the same tag would be (so messages
//! with one tag keep their order, whichever way each went) and names the message's id; the
//! others are matched by that id. Both ends stay cancel-safe:
//! - a send dropped part-way copies the segments not yet sent and sends them from a task, so
//!   the receiver never holds half a message;
//! - a receive dropped part-way puts back what it has taken as the first segments of the
//!   message, so the next receive for the tag gets all of it.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use nexar_types::DType;

use crate::comm::client::NexarClient;
use crate::comm::matcher::{Held, Key, Segments};
use crate::comm::membership::route::Route;
use crate::comm::p2p::P2pError;
use crate::proto::message::PeerMsg;
use crate::transport::TransportError;
use crate::transport::framed::Payload;
use crate::transport::link::{PeerLink, SendDone};

/// Bytes of elements per segment: the collectives' 1 MiB segment, which the receiver reads
/// from a 4 MiB ring in place (and which fits the TCP lane's 2 MiB send queue twice over).
pub(crate) const SEGMENT_BYTES: usize = 1 << 20;

/// Ids of messages sent in segments, unique among those this process sends.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A message being sent in segments: what it is and the first segment not yet sent.
struct Outgoing<'a> {
    client: &'a NexarClient,
    dest: usize,
    comm: u64,
    tag: u64,
    dtype: DType,
    id: u64,
    /// Elements per segment.
    each: usize,
    bytes: &'a [u8],
    next: u32,
    /// Set once every segment is sent, or sending failed (nothing is sent after a failure).
    settled: bool,
}

impl Outgoing<'_> {
    fn total(&self) -> u64 {
        (self.bytes.len() / self.dtype.size()) as u64
    }

    /// Segment `index`: its message and its bytes (`None` past the last).
    fn segment(&self, index: u32) -> Option<(PeerMsg, &[u8])> {
        let step = self.each * self.dtype.size();
        let start = (index as usize).checked_mul(step).filter(|s| *s < self.bytes.len())?;
        let chunk = &self.bytes[start..(start + step).min(self.bytes.len())];
        let msg = PeerMsg::P2pSegment {
            comm: self.comm,
            tag: self.tag,
            dtype: self.dtype.to_wire(),
            count: (chunk.len() / self.dtype.size()) as u64,
            total: self.total(),
            id: self.id,
            index,
        };
        Some((msg, chunk))
    }
}

impl Drop for Outgoing<'_> {
    /// A send dropped part-way: the segments not yet sent are copied and sent from a task.
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let rest: Vec<(PeerMsg, Bytes)> =
            (self.next..).map_while(|i| self.segment(i)).map(|(m, b)| (m, Bytes::copy_from_slice(b))).collect();
        if rest.is_empty() {
            return;
        }
        let (client, dest) = (self.client.clone(), self.dest);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move {
                for (msg, bytes) in rest {
                    let Some(link) = client.link(dest) else { return };
                    if send_through_channel(&link, &msg, &bytes).await.is_some_and(|sent| sent.is_err()) {
                        return;
                    }
                }
            })),
            Err(_) => {
                tracing::warn!(dest, "a point-to-point send dropped outside a runtime left its message unfinished")
            }
        }
    }
}

/// Sends one message, its payload `bytes` lent for the call, through the link's bulk channel
/// and waits until it is written: `None` when the link does not take it there (the caller
/// goes another way).
pub(in crate::comm) async fn send_through_channel(
    link: &Route<'_>,
    msg: &PeerMsg,
    bytes: &[u8],
) -> Option<Result<(), TransportError>> {
    Some(match link.send_borrowed(msg, &[bytes]).await? {
        Ok(SendDone::Now(result)) => result,
        Ok(SendDone::Later(wait)) => wait.await.unwrap_or_else(|_| Err(channel_stopped(link.first_hop()))),
        Err(error) => Err(error),
    })
}

/// The error for a group whose channel stopped before it was written.
pub(crate) fn channel_stopped(link: &PeerLink) -> TransportError {
    TransportError::ConnectionLost {
        peer: format!("rank {}", link.peer()),
        reason: "its bulk channel stopped before the message was written".into(),
    }
}

impl NexarClient {
    /// Sends `bytes`, elements of `dtype`, to `dest` (reached by `link`) with `tag` in
    /// segments, where the message is longer than one and the direct link's bulk channel
    /// carries point-to-point messages; `None` otherwise (nothing was sent).
    pub(in crate::comm) async fn send_in_segments(
        &self,
        link: &Route<'_>,
        dest: usize,
        tag: u64,
        dtype: DType,
        bytes: &[u8],
    ) -> Option<Result<(), TransportError>> {
        let Route::Direct(direct) = *link else { return None };
        if bytes.len() <= SEGMENT_BYTES || !direct.bulk_carries_point_to_point() {
            return None;
        }
        let each = (SEGMENT_BYTES / dtype.size()).max(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut out =
            Outgoing { client: self, dest, comm: self.comm.id, tag, dtype, id, each, bytes, next: 0, settled: false };
        while let Some((msg, chunk)) = out.segment(out.next) {
            let done = match link.send_borrowed(&msg, &[chunk]).await {
                Some(Ok(done)) => done,
                Some(Err(error)) => {
                    out.settled = true;
                    return Some(Err(error));
                }
                // The channel stopped between two segments: those sent fail the peer's
                // receive (it hears the channel failed), so this one fails too.
                None => {
                    out.settled = true;
                    return Some(Err(channel_stopped(direct)));
                }
            };
            // In the ring, or copied and queued behind it: sent, even if this future is
            // dropped while it waits below (the drop must not send it again).
            out.next += 1;
            let written = match done {
                SendDone::Now(result) => result,
                SendDone::Later(wait) => wait.await.unwrap_or_else(|_| Err(channel_stopped(direct))),
            };
            if let Err(error) = written {
                out.settled = true;
                return Some(Err(error));
            }
        }
        out.settled = true;
        Some(Ok(()))
    }

    /// Copies into `out` (the whole message's bytes) the message that `head`, taken for `key`
    /// from rank `src`, begins, taking its later segments as they come. A receive dropped
    /// part-way puts back what it took (see the module's documentation).
    pub(in crate::comm) async fn receive_segments(
        &self,
        key: Key,
        src: usize,
        head: Held,
        segments: Segments,
        out: &mut [u8],
    ) -> Result<(), P2pError> {
        let (rank, tag) = (self.rank(), key.tag);
        let bad = |what: String| P2pError::BadSegments { rank, src, tag, what };
        // One limit for the whole message, not one per segment: a sender that trickles its
        // segments cannot hold the receive for more than the operation timeout.
        let after = self.config().op_timeout;
        let deadline = tokio::time::Instant::now() + after;
        let size = head.dtype.size();
        let total = head.count;
        let Segments { id, each, next } = segments;
        let parts = match (total, each) {
            (0, _) => 0,
            (_, 0) => return Err(bad("announces segments of no elements".into())),
            _ => total.div_ceil(each),
        };
        let held_bytes = (next as u64).saturating_mul(each).min(total).saturating_mul(size as u64);
        if parts > u32::MAX as u64 || next as u64 > parts || head.payload.len() as u64 != held_bytes {
            return Err(bad(format!(
                "of {total} elements in segments of {each} holds {} bytes in its first {next}",
                head.payload.len()
            )));
        }
        let Held { dtype, payload, .. } = head;
        let mut taking = Incoming { client: self, key, dtype, total, id, each, next, done: 0, out };
        payload.copy_to(&mut taking.out[..held_bytes as usize]).map_err(|error| P2pError::Unreadable {
            rank,
            src,
            tag,
            error,
        })?;
        // A payload lent from the ring holds its room back until it is dropped.
        drop(payload);
        taking.done = held_bytes as usize;
        while (taking.next as u64) < parts {
            let index = taking.next;
            let elems = each.min(total - index as u64 * each);
            let len = elems * size as u64;
            let part_key = Key { comm: key.comm, src: key.src, tag: id, part: index };
            let part = tokio::time::timeout_at(deadline, self.take(part_key, src, "recv", len))
                .await
                .map_err(|_| P2pError::Timeout { rank, op: "recv", peer: src, tag, after })??;
            if part.dtype != dtype || part.count != elems || part.segments.is_some() {
                return Err(bad(format!(
                    "sent segment {index} as {} {:?} elements where {elems} {dtype:?} were due",
                    part.count, part.dtype
                )));
            }
            let at = taking.done;
            part.payload.copy_to(&mut taking.out[at..at + len as usize]).map_err(|error| P2pError::Unreadable {
                rank,
                src,
                tag,
                error,
            })?;
            taking.done += len as usize;
            taking.next += 1;
        }
        taking.next = u32::MAX;
        Ok(())
    }
}

/// A message being received in segments: what is copied so far, put back if the receive is
/// dropped before the last segment.
struct Incoming<'a> {
    client: &'a NexarClient,
    key: Key,
    dtype: DType,
    total: u64,
    id: u64,
    each: u64,
    /// The next segment to take (`u32::MAX` once all are).
    next: u32,
    /// Bytes of `out` filled.
    done: usize,
    out: &'a mut [u8],
}

impl Drop for Incoming<'_> {
    fn drop(&mut self) {
        if self.next == u32::MAX {
            return;
        }
        let taken = Payload::from_bytes(Bytes::copy_from_slice(&self.out[..self.done]));
        let segments = Some(Segments { id: self.id, each: self.each, next: self.next });
        let held = Held { dtype: self.dtype, count: self.total, payload: taken, check: None, segments };
        self.client.inner.mailbox.put_back(self.key, held);
    }
}
