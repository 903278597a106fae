//! Other transports for collective payloads. A [`BulkChannel`] (RDMA, for example) takes over
//! the raw lane of one peer link; what such a transport receives goes through a
//! [`BulkInbound`] into the same router the QUIC streams feed, with the same checks. The
//! executor does not know which transport carried a collective.
//!
//! A channel carries *message groups*: the frames of one collective message exactly as they
//! would go on a QUIC stream (a message frame, then a raw frame with the payload). The
//! receiving side hands each whole group to [`BulkInbound::deliver`].
//!
//! When a channel fails, messages it held may be lost. A later message of the same collective
//! sent over QUIC could then be taken for a lost one, so the link remembers which collectives
//! crossed the channel (on either side): those fail on this rank at once (and this rank tells
//! the others, as for any local failure), later ones go over QUIC.

use std::collections::VecDeque;

use foldhash::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;

use super::TransportError;
use super::lanes::{DirectSink, LaneSenders};

mod awaiting;
mod inbound;
#[cfg(feature = "hostile-member")]
mod tamper;

pub use awaiting::{Awaited, Awaiting};
pub use inbound::BulkInbound;
#[cfg(any(test, feature = "unstable-internals"))]
pub use inbound::decode_group;
#[cfg(test)]
pub(crate) use inbound::decode_sealed_group;
#[cfg(feature = "hostile-member")]
pub use tamper::LaneTamper;

/// The future of one [`BulkChannel::send`].
pub type BulkSend = Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send + 'static>>;

/// How a [`BulkChannel::send_borrowed`] finishes: at once (the group went into the ring or
/// onto the socket within the call, the common case for small groups, which then cost no
/// task, channel or allocation), or when a future resolves (the group was queued).
///
/// ```
/// use nexar::backend::Sent;
/// let sent = Sent::Done(Ok(()));
/// assert!(matches!(sent, Sent::Done(Ok(()))));
/// ```
pub enum Sent {
    /// The group is sent, or failed to be.
    Done(Result<(), TransportError>),
    /// The group is queued; the future resolves once it is sent.
    Later(BulkSend),
}

/// The future of [`BulkChannel::closed`].
pub type BulkClosed = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Runs when a bulk channel stopped, before the collectives it carried fail.
pub(crate) type Settle = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Collectives remembered per link as having crossed its bulk channel.
const RECENT_COLLECTIVES: usize = 1024;

/// A transport that carries one peer's raw lane (collective payloads) instead of QUIC.
///
/// Attach one with [`NexarClient::attach_bulk`](crate::NexarClient::attach_bulk); the peer
/// feeds what it receives to its [`BulkInbound`].
///
/// ```
/// use bytes::Bytes;
/// use nexar::backend::{BulkChannel, BulkSend};
///
/// /// Counts the bytes it is asked to carry and drops them (a real channel moves them).
/// struct Counting(std::sync::atomic::AtomicU64);
///
/// impl BulkChannel for Counting {
///     fn name(&self) -> &'static str {
///         "counting"
///     }
///     fn send(&self, frames: Vec<Bytes>) -> BulkSend {
///         let n: usize = frames.iter().map(Bytes::len).sum();
///         self.0.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
///         Box::pin(async { Ok(()) })
///     }
/// }
/// ```
pub trait BulkChannel: Send + Sync + 'static {
    /// A short name for logs and [`NexarClient::bulk_transport`](crate::NexarClient::bulk_transport).
    fn name(&self) -> &'static str;

    /// Carries one message group (its frames, in order) to the peer, where it must reach
    /// [`BulkInbound::deliver`] whole. Groups sent one after another arrive in that order.
    /// The future resolves once the bytes no longer need `frames`; the channel owns them until
    /// then, so a dropped caller never leaves a transfer reading freed memory.
    fn send(&self, frames: Vec<Bytes>) -> BulkSend;

    /// Whether the channel has room for another group now (always, by default). Where it
    /// has not, nexar waits on [`room`](Self::room) before
    /// [`send_borrowed`](Self::send_borrowed), so a fast sender does not queue unbounded
    /// copies ahead of the wire.
    fn has_room(&self) -> bool {
        true
    }

    /// Resolves when the channel has room for another group (at once, by default).
    fn room(&self) -> BulkClosed {
        Box::pin(std::future::ready(()))
    }

    /// Carries a group, the concatenation of `parts` (its frames, then its payload), whose
    /// bytes are lent for the duration of this call: a channel that can must be done reading
    /// them when it returns (it copies or encrypts them now), so that nothing reads the
    /// caller's memory later. `None` (the default) makes nexar copy the payload and call
    /// [`send`](Self::send).
    fn send_borrowed(&self, parts: &[&[u8]]) -> Option<Sent> {
        let _ = parts;
        None
    }

    /// Whether a group of `len` bytes given to [`send_borrowed`](Self::send_borrowed) now
    /// would be sent within the call rather than copied and queued (`true` by default). Every
    /// lent send, collective or point-to-point, waits up to a few hundred microseconds for it
    /// before its payload is copied.
    fn fits_now(&self, len: usize) -> bool {
        let _ = len;
        true
    }

    /// Whether the channel still works. Once it says no, the link sends over QUIC again:
    /// collectives that had messages on the channel fail on this rank (which tells the
    /// others), because the channel may have lost some; later collectives go over QUIC.
    fn usable(&self) -> bool {
        true
    }

    /// What else a log or [`NexarClient::bulk_transport_details`] should say about the
    /// channel (how it protects and paces its bytes, say); `None` (the default) for nothing.
    ///
    /// [`NexarClient::bulk_transport_details`]: crate::NexarClient::bulk_transport_details
    fn describe(&self) -> Option<String> {
        None
    }

    /// Resolves when the channel stops working (never, by default), so that collectives
    /// waiting on messages it lost fail at once instead of at their timeout.
    fn closed(&self) -> BulkClosed {
        Box::pin(std::future::pending())
    }

    /// Resolves once the channel has delivered everything the peer sent before its goodbye
    /// (it read the goodbye), or stopped. A peer that leaves says goodbye on its channel
    /// before it closes its connection, so the departure is judged only after this (bounded):
    /// what the peer sent just before it left is not lost. At once, by default.
    fn drained(&self) -> BulkClosed {
        Box::pin(std::future::ready(()))
    }

    /// The link gave the channel up (it failed, or the peer is gone): fail what it still
    /// holds and stop. Sends that have not finished must resolve (with an error).
    fn close(&self) {}

    /// This rank is shutting down: tell the peer so (if the transport can) and stop, without
    /// it being taken for a failure; the future resolves once the peer was told. By default
    /// the same as [`close`](Self::close).
    fn goodbye(&self) -> BulkClosed {
        self.close();
        Box::pin(std::future::ready(()))
    }

    /// Whether the channel delivers what it receives from a task on the rank's runtime (as
    /// QUIC does), so that a receive polling its mailbox sees a message without any thread
    /// being woken; `false` (the default) where a thread of the channel's own delivers.
    fn delivers_on_runtime(&self) -> bool {
        false
    }

    /// Delivers, on the calling task, what the channel has received whole and nexar takes at
    /// once, instead of leaving it to the channel's own reader. `Some(hold)` if it read the
    /// channel itself: it may have delivered something (the caller then looks at its mailbox
    /// again), and a caller that spins may keep its thread from the runtime's other tasks for
    /// up to `hold` since it last let them run (so return it only where what is left needs no
    /// other task for that long). A receive spinning on its mailbox calls this between its
    /// polls (nothing, by default: `None`). It must never wait.
    ///
    /// `awaiting` names the message the caller waits for: a channel may hand it straight to
    /// the caller ([`Awaiting::hand`]) when it is the next group it has whole, rather than
    /// deliver it into the store the caller then takes it from.
    fn deliver_ready(&self, awaiting: Option<Awaiting<'_>>) -> Option<Duration> {
        let _ = awaiting;
        None
    }

    /// A receive that spun on [`deliver_ready`](Self::deliver_ready), lending its buffer,
    /// stops and waits to be woken: a channel that reads the awaited payload into that buffer
    /// only while it is lent goes on without it at once, rather than wait for another loan
    /// (nothing, by default).
    fn receive_parks(&self) {}

    /// Whether the channel also carries typed point-to-point messages (`send` and `recv`),
    /// `false` by default. Those must keep their order between a pair of ranks, so a channel
    /// that says yes takes every one of them while it works, whatever its size (ignoring
    /// [`min_bytes`](Self::min_bytes)), and delivers its groups in the order they were sent.
    /// When it fails, receives of the peer's point-to-point messages fail on this rank
    /// (some may be lost), and so do sends to it.
    fn carries_point_to_point(&self) -> bool {
        false
    }

    /// The smallest message group worth this channel: a collective whose first message to
    /// the peer is smaller stays on QUIC (whose latency path spins), 0 (the default) sends
    /// every collective here.
    fn min_bytes(&self) -> usize {
        0
    }

    /// Alters the next group this channel sends as `tamper` says (a hostile member's lane, for
    /// the tests of what its peers refuse); `false` where the channel cannot.
    #[cfg(feature = "hostile-member")]
    fn tamper_next(&self, tamper: LaneTamper) -> bool {
        let _ = tamper;
        false
    }
}

/// Tag of the setup message that tells a peer this rank's bulk channel to it failed; its body
/// lists the collectives the channel carried ([`encode_keys`]).
pub(crate) const BULK_DOWN_TAG: u64 = u64::MAX;

/// `(comm, seq)` pairs as 16 little-endian bytes each.
pub(crate) fn encode_keys(keys: &[(u64, u64)]) -> Vec<u8> {
    keys.iter().flat_map(|(c, s)| c.to_le_bytes().into_iter().chain(s.to_le_bytes())).collect()
}

/// The pairs of [`encode_keys`], from untrusted bytes (at most [`RECENT_COLLECTIVES`]).
pub(crate) fn decode_keys(body: &[u8]) -> Vec<(u64, u64)> {
    body.chunks_exact(16)
        .take(RECENT_COLLECTIVES)
        .map(|k| {
            let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
            (word(&k[..8]), word(&k[8..]))
        })
        .collect()
}

/// A bounded memory of collectives `(comm, seq)`: the newest [`RECENT_COLLECTIVES`].
#[derive(Default)]
struct Recent {
    order: VecDeque<(u64, u64)>,
    set: HashSet<(u64, u64)>,
}

impl Recent {
    fn insert(&mut self, key: (u64, u64)) {
        if self.set.insert(key) {
            self.order.push_back(key);
            if self.order.len() > RECENT_COLLECTIVES
                && let Some(old) = self.order.pop_front()
            {
                self.set.remove(&old);
            }
        }
    }
}

/// What a link remembers of the collectives it carried.
#[derive(Default)]
struct Carried {
    /// The channel failed (set under this lock, so no collective is recorded after).
    failed: bool,
    /// Collectives with a message on the channel, either way.
    bulk: Recent,
    /// Collectives with a message sent over QUIC: they stay there, so that no collective is
    /// split between transports (messages of one collective are matched in order).
    quic: Recent,
}

/// One link's bulk channel, if any, and the collectives that crossed it.
pub(crate) struct BulkSlot {
    peer: u32,
    channel: OnceLock<Arc<dyn BulkChannel>>,
    carried: Mutex<Carried>,
    /// The rank's store of collective messages, told which collectives a failed channel lost.
    coll: Option<DirectSink>,
    /// The rank's store of point-to-point messages, told when a failed channel that carried
    /// them may have lost some.
    p2p: Option<DirectSink>,
    /// Tells the peer that this side's channel failed, with the collectives it carried (a
    /// setup message on the control lane).
    tell_peer: OnceLock<Box<dyn Fn(Vec<u8>) + Send + Sync>>,
    /// What runs between the channel stopping and its collectives failing.
    settle: Mutex<Settling>,
}

/// The settle hook of a slot, and whether it runs.
enum Settling {
    /// None was given: fail at once.
    None,
    /// Given, not yet run.
    Hook(Settle),
    /// Running or done.
    Running,
}

impl std::fmt::Debug for BulkSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BulkSlot").field("peer", &self.peer).field("channel", &self.attached()).finish_non_exhaustive()
    }
}

impl BulkSlot {
    pub fn new(peer: u32, lanes: &LaneSenders) -> BulkSlot {
        BulkSlot {
            peer,
            channel: OnceLock::new(),
            carried: Mutex::default(),
            coll: lanes.coll_inbox(),
            p2p: lanes.p2p_inbox(),
            tell_peer: OnceLock::new(),
            settle: Mutex::new(Settling::None),
        }
    }

    /// Sets how a failure is announced to the peer.
    pub fn on_failure_tell_peer(&self, tell: Box<dyn Fn(Vec<u8>) + Send + Sync>) {
        let _ = self.tell_peer.set(tell);
    }

    /// Attaches `channel` (needs a Tokio runtime), and fails the collectives it carried once
    /// it stops and `settle` has run (it waits to learn whether the peer itself died, so that
    /// collectives then fail for that reason rather than for the channel).
    pub fn attach(
        self: &Arc<Self>,
        channel: Arc<dyn BulkChannel>,
        settle: Option<Settle>,
    ) -> Result<(), Arc<dyn BulkChannel>> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return Err(channel) };
        if crate::sync::lock(&self.carried).failed {
            // The peer said its side is gone before this side attached.
            return Err(channel);
        }
        let closed = channel.closed();
        self.channel.set(channel)?;
        *crate::sync::lock(&self.settle) = match settle {
            Some(settle) => Settling::Hook(settle),
            None => Settling::None,
        };
        let slot = Arc::downgrade(self);
        runtime.spawn(async move {
            closed.await;
            if let Some(slot) = slot.upgrade() {
                slot.channel_stopped();
            }
        });
        Ok(())
    }

    /// The channel stopped working (it says so, or a send through it failed): once the
    /// settle hook has run, the collectives it carried fail. Meanwhile nothing new takes it.
    pub fn channel_stopped(self: &Arc<Self>) {
        let hook = std::mem::replace(&mut *crate::sync::lock(&self.settle), Settling::Running);
        match hook {
            Settling::Hook(settle) => {
                let slot = self.clone();
                let settled = async move {
                    settle().await;
                    slot.fail(Vec::new());
                };
                match tokio::runtime::Handle::try_current() {
                    Ok(runtime) => drop(runtime.spawn(settled)),
                    Err(_) => self.fail(Vec::new()),
                }
            }
            Settling::None => self.fail(Vec::new()),
            Settling::Running => {}
        }
    }

    /// Resolves once the attached channel has delivered what the peer sent before its goodbye,
    /// or stopped ([`BulkChannel::drained`]); at once without a channel.
    pub fn drained(&self) -> BulkClosed {
        match self.channel.get() {
            Some(channel) => channel.drained(),
            None => Box::pin(std::future::ready(())),
        }
    }

    /// The attached channel (what it says of itself; tests that send through it as a peer
    /// would).
    pub(crate) fn channel(&self) -> Option<Arc<dyn BulkChannel>> {
        self.channel.get().cloned()
    }

    /// The attached channel's name, working or not.
    pub fn attached(&self) -> Option<&'static str> {
        self.channel.get().map(|c| c.name())
    }

    /// Whether the channel is attached, has not stopped, and no failure of it was handled.
    /// A channel that stopped is not working even while its settle hook still runs, so a
    /// send that failed on it is never followed by a report that it still carries the link.
    pub fn working(&self) -> bool {
        self.channel.get().is_some_and(|c| c.usable()) && !crate::sync::lock(&self.carried).failed
    }

    /// Makes the attached channel stop as if its network failed (for fault tests).
    pub fn break_channel(&self) -> bool {
        self.channel.get().map(|c| c.close()).is_some()
    }

    /// Whether the attached channel carries point-to-point messages (working or not).
    pub fn carries_point_to_point(&self) -> bool {
        self.channel.get().is_some_and(|c| c.carries_point_to_point())
    }

    /// How to send a point-to-point message: `Ok` the channel; `Err(false)` over QUIC (no
    /// channel that carries them is attached); `Err(true)` not at all, because the channel
    /// that carried them failed and the peer no longer takes this rank's messages in order.
    pub fn route_point_to_point(self: &Arc<Self>) -> Result<Arc<dyn BulkChannel>, bool> {
        let Some(channel) = self.channel.get().filter(|c| c.carries_point_to_point()) else { return Err(false) };
        if !channel.usable() {
            self.channel_stopped();
            return Err(true);
        }
        if crate::sync::lock(&self.carried).failed {
            return Err(true);
        }
        Ok(channel.clone())
    }

    /// Whether a new collective's `len`-byte message would take the channel.
    pub fn takes(&self, len: usize) -> bool {
        self.working() && self.channel.get().is_some_and(|c| len >= c.min_bytes())
    }

    /// Delivers on the calling task what the attached channel received whole
    /// ([`BulkChannel::deliver_ready`]); `Some` if anything may have been.
    pub fn deliver_ready(&self, awaiting: Option<Awaiting<'_>>) -> Option<Duration> {
        self.channel.get().and_then(|c| c.deliver_ready(awaiting))
    }

    /// A receive that lent its buffer stops spinning ([`BulkChannel::receive_parks`]).
    pub fn receive_parks(&self) {
        if let Some(c) = self.channel.get() {
            c.receive_parks();
        }
    }

    /// Whether a new collective's `len`-byte message would arrive through a thread of the
    /// channel's own (so that a receive polling for it holds a core the thread may need).
    pub fn takes_on_thread(&self, len: usize) -> bool {
        self.channel.get().is_some_and(|c| !c.delivers_on_runtime()) && self.takes(len)
    }

    /// How to send a `len`-byte message of collective `key`: `Ok` the channel (the collective
    /// is recorded as carried); `Err(false)` over QUIC (recorded as such); `Err(true)` not at
    /// all, because the failed channel carried this collective and may have lost its messages.
    /// A collective's first message decides, by its size, for all its messages on this link.
    pub fn route(self: &Arc<Self>, key: (u64, u64), len: usize) -> Result<Arc<dyn BulkChannel>, bool> {
        let channel = self.channel.get();
        let stopped = channel.is_some_and(|c| !c.usable());
        if stopped {
            self.channel_stopped();
        }
        let mut carried = crate::sync::lock(&self.carried);
        let down = carried.failed || stopped;
        match channel {
            Some(channel)
                if !down
                    && !carried.quic.set.contains(&key)
                    && (len >= channel.min_bytes() || carried.bulk.set.contains(&key)) =>
            {
                carried.bulk.insert(key);
                Ok(channel.clone())
            }
            _ if down && carried.bulk.set.contains(&key) => Err(true),
            _ => {
                carried.quic.insert(key);
                Err(false)
            }
        }
    }

    /// Remembers that a message of collective `key` arrived over the channel.
    pub fn received(&self, key: (u64, u64)) {
        let mut carried = crate::sync::lock(&self.carried);
        if !carried.failed {
            carried.bulk.insert(key);
        }
    }

    /// The channel stopped (or the peer says its side stopped): it is closed, every
    /// collective it carried and `theirs` (what the peer says it carried) fail here, and the
    /// peer hears which collectives this side carried. Later channels are refused.
    ///
    /// Each side names what it carried once, when it fails first, so a message lost in the
    /// channel fails its collective on both sides; a collective that never used the channel
    /// (one started after it stopped, say) goes on over QUIC.
    pub fn fail(&self, theirs: Vec<(u64, u64)>) {
        let ours: Option<Vec<(u64, u64)>> = {
            let mut carried = crate::sync::lock(&self.carried);
            if carried.failed {
                None
            } else {
                carried.failed = true;
                Some(carried.bulk.order.iter().copied().collect())
            }
        };
        let Some(channel) = self.channel.get() else { return };
        let name = channel.name();
        let reason = format!("the {name} link to rank {} failed during this operation", self.peer);
        if channel.carries_point_to_point()
            && let Some(p2p) = &self.p2p
        {
            p2p.lost_from(
                self.peer,
                &format!(
                    "the {name} link to rank {} failed; point-to-point messages it carried may be lost",
                    self.peer
                ),
            );
        }
        let Some(ours) = ours else {
            // Failed already: only what the peer says it carried is news.
            if let Some(coll) = &self.coll {
                coll.lost(theirs, &reason);
            }
            return;
        };
        if let Some(coll) = &self.coll {
            coll.lost(ours.iter().copied().chain(theirs).collect(), &reason);
        }
        tracing::warn!(
            peer = self.peer,
            transport = name,
            "bulk channel failed; the link carries payloads over QUIC again"
        );
        channel.close();
        if let Some(tell_peer) = self.tell_peer.get() {
            tell_peer(encode_keys(&ours));
        }
    }

    /// The peer is dead: its channel is closed and carries nothing more. Collectives are left
    /// to the death itself (they fail naming the dead peer where they need it), and the peer
    /// is not told.
    pub fn retire(&self) {
        {
            let mut carried = crate::sync::lock(&self.carried);
            if carried.failed {
                return;
            }
            carried.failed = true;
        }
        if let Some(channel) = self.channel.get() {
            tracing::debug!(peer = self.peer, transport = channel.name(), "bulk channel of a dead peer closed");
            channel.close();
        }
    }

    /// This rank shuts down: the channel says goodbye and carries nothing more; the future
    /// resolves once the peer was told.
    pub fn goodbye(&self) -> BulkClosed {
        {
            let mut carried = crate::sync::lock(&self.carried);
            if carried.failed {
                return Box::pin(std::future::ready(()));
            }
            carried.failed = true;
        }
        match self.channel.get() {
            Some(channel) => channel.goodbye(),
            None => Box::pin(std::future::ready(())),
        }
    }

    /// The error for a message of a collective the failed channel carried.
    pub fn lost(&self) -> TransportError {
        TransportError::ConnectionLost {
            peer: format!("rank {}", self.peer),
            reason: format!("its {} link failed during this operation", self.attached().unwrap_or("bulk")),
        }
    }
}

impl std::fmt::Debug for dyn BulkChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BulkChannel({})", self.name())
    }
}

#[cfg(test)]
pub(crate) mod tests;
