//! Where the data and raw lanes deliver: a store above transport (comm's matcher) that says
//! when a message's payload may be read and takes the message once it is.
//!
//! Transport knows nothing of tags, communicators or sequences. For each message a lane
//! delivers straight into a store, it asks the store whether the payload may be read yet (the
//! store may make it wait, and QUIC's flow control then holds the sender), reads it, and hands
//! the message over. A bulk channel that fails tells the store which collectives it lost.
//!
//! The common case costs no allocation: a store that can answer at once does
//! ([`Admission::Now`], [`Delivery::Done`]), and only a wait is a boxed future.

use std::future::Future;
use std::pin::Pin;

use super::incoming::Incoming;
use crate::proto::message::PeerMsg;

/// A wait on a store.
pub(crate) type InboxWait<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store that a lane's messages go straight into.
pub(crate) trait Inbox: Send + Sync {
    /// Whether the `len`-byte payload of `msg`, announced by rank `from`, may be read now,
    /// or a wait until it may; `None` when `msg` is not for this store (read it at once).
    fn admit(&self, msg: &PeerMsg, from: u32, len: u64) -> Option<Admission<'_>>;

    /// Takes a message whose payload was read. A store that cannot hold it yet returns a
    /// wait; the lane reads nothing more from that sender until it ends.
    fn deliver(&self, incoming: Incoming) -> Delivery<'_>;

    /// Takes a message whose payload was read if it can at once (its sender has room, or it
    /// is dropped as late); otherwise gives it back untouched (`Some`), for
    /// [`deliver`](Self::deliver) to take with a wait.
    fn deliver_now(&self, incoming: Incoming) -> Option<Incoming>;

    /// Returns what an admission reserved for `from`'s `len` bytes (see [`Admitted`]).
    fn release(&self, from: u32, len: u64);

    /// A bulk channel may have lost the messages of these collectives, `(communicator,
    /// sequence)` pairs: they fail here with `reason`. Only these: a collective that never
    /// used the channel on either side goes on over QUIC (each side names what it carried
    /// when it fails, see [`BulkSlot::fail`](super::bulk::BulkSlot::fail)).
    fn lost(&self, collectives: Vec<(u64, u64)>, reason: &str);

    /// A bulk channel that carried `from`'s point-to-point messages failed, so some may be
    /// lost and the order of later ones is no longer kept: receives from `from` fail here
    /// with `reason` (what arrived before is still received), as if it were gone.
    fn lost_from(&self, from: u32, reason: &str);
}

/// The answer to [`Inbox::admit`].
pub(crate) enum Admission<'a> {
    /// Read the payload now.
    Now(Admitted<'a>),
    /// Read it once this ends.
    Wait(InboxWait<'a, Admitted<'a>>),
}

impl<'a> Admission<'a> {
    /// Waits for the admission, if it is not there already.
    pub(crate) async fn ready(self) -> Admitted<'a> {
        match self {
            Admission::Now(admitted) => admitted,
            Admission::Wait(wait) => wait.await,
        }
    }
}

/// The answer to [`Inbox::deliver`].
pub(crate) enum Delivery<'a> {
    /// Taken.
    Done,
    /// Taken once this ends.
    Wait(InboxWait<'a, ()>),
}

impl Delivery<'_> {
    /// Waits until the store has taken the message.
    pub(crate) async fn finish(self) {
        if let Delivery::Wait(wait) = self {
            wait.await;
        }
    }
}

/// A message admitted to be read. While it is being read its bytes may count against its
/// sender's room in the store; dropping this, just before the message is delivered, gives
/// them back.
pub(crate) struct Admitted<'a> {
    reserved: Option<(&'a dyn Inbox, u32, u64)>,
}

impl<'a> Admitted<'a> {
    /// An admission that reserved nothing.
    pub(crate) fn unreserved() -> Self {
        Admitted { reserved: None }
    }

    /// An admission that reserved `len` bytes of `from`'s room in `inbox`.
    pub(crate) fn reserved(inbox: &'a dyn Inbox, from: u32, len: u64) -> Self {
        Admitted { reserved: Some((inbox, from, len)) }
    }

    /// The bytes this admission reserved, if any.
    #[cfg(test)]
    pub(crate) fn reserved_bytes(&self) -> Option<u64> {
        self.reserved.map(|(_, _, len)| len)
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if let Some((inbox, from, len)) = self.reserved.take() {
            inbox.release(from, len);
        }
    }
}
