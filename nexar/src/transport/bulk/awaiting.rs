//! The message a receive waits for, named to a channel that the receive reads itself
//! ([`BulkChannel::deliver_ready`](super::BulkChannel::deliver_ready)), and the hand-over of
//! that message straight to the receive.

use super::super::lanes::Incoming;
use crate::proto::message::PeerMsg;

/// The message a receive waits for, named to a channel it reads itself
/// ([`BulkChannel::deliver_ready`]).
///
/// ```
/// use nexar::backend::Awaited;
/// let awaited = Awaited::Collective { comm: 0, seq: 7, part: 0 };
/// assert!(matches!(awaited, Awaited::Collective { seq: 7, .. }));
/// ```
///
/// [`BulkChannel::deliver_ready`]: super::BulkChannel::deliver_ready
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Awaited {
    /// A collective's message.
    Collective {
        /// The communicator's id.
        comm: u64,
        /// The collective's sequence number on that communicator.
        seq: u64,
        /// The message's segment of the collective.
        part: u32,
    },
    /// A point-to-point message sent whole (not in segments).
    PointToPoint {
        /// The communicator's id.
        comm: u64,
        /// The message's tag.
        tag: u64,
    },
}

impl Awaited {
    /// Whether `msg` is the awaited message (its sender is the channel's peer).
    pub fn is(&self, msg: &PeerMsg) -> bool {
        match (*self, msg) {
            (Awaited::Collective { comm, seq, part }, PeerMsg::Coll { comm: c, seq: s, part: p, .. }) => {
                (comm, seq, part) == (*c, *s, *p)
            }
            (Awaited::PointToPoint { comm, tag }, PeerMsg::P2p { comm: c, tag: t, .. }) => (comm, tag) == (*c, *t),
            _ => false,
        }
    }
}

/// A receive that waits for one message and reads its sender's channel itself
/// ([`BulkChannel::deliver_ready`]): the message it waits for, and where the channel hands
/// that message when it has it whole.
///
/// ```
/// use nexar::backend::{Awaited, Awaiting};
/// let mut got = None;
/// let mut take = |incoming| got = Some(incoming);
/// let awaiting = Awaiting::new(Awaited::PointToPoint { comm: 0, tag: 3 }, &mut take);
/// assert!(matches!(awaiting.message(), Awaited::PointToPoint { tag: 3, .. }));
/// ```
///
/// [`BulkChannel::deliver_ready`]: super::BulkChannel::deliver_ready
pub struct Awaiting<'a> {
    message: Awaited,
    take: &'a mut dyn FnMut(Incoming),
    /// Where the message's payload goes, for a channel that can read it straight there, and
    /// whether the next such message the channel delivers is the one this receive takes.
    destination: Option<(&'a mut [u8], &'a dyn Fn() -> bool)>,
}

impl std::fmt::Debug for Awaiting<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Awaiting").field("message", &self.message).finish_non_exhaustive()
    }
}

impl<'a> Awaiting<'a> {
    /// A receive waiting for `message`, which `take` consumes when a channel hands it over.
    pub fn new(message: Awaited, take: &'a mut dyn FnMut(Incoming)) -> Awaiting<'a> {
        Awaiting { message, take, destination: None }
    }

    /// The same receive, whose message's payload belongs in `destination` (exactly as long as
    /// that payload): a channel that reads the message while this receive polls it may read
    /// the payload straight there (see [`take_destination`](Self::take_destination)), as long
    /// as `ours` says that the next message of its kind to arrive is the one this receive
    /// takes (none older is held for it, no earlier receive waits for one).
    ///
    /// ```
    /// use nexar::backend::{Awaited, Awaiting};
    /// let (mut take, mut buf, ours) = (|_| {}, [0u8; 16], || true);
    /// let mut awaiting = Awaiting::new(Awaited::Collective { comm: 0, seq: 1, part: 0 }, &mut take)
    ///     .with_destination(&mut buf, &ours);
    /// let (dst, ours) = awaiting.take_destination().expect("lent");
    /// assert_eq!((dst.len(), ours()), (16, true));
    /// ```
    pub fn with_destination(self, destination: &'a mut [u8], ours: &'a dyn Fn() -> bool) -> Awaiting<'a> {
        Awaiting { destination: Some((destination, ours)), ..self }
    }

    /// The destination the receive lends for its message's payload, if it lends one, and
    /// whether the next message of its kind is the receive's (ask right before writing there).
    /// A channel that writes payload bytes there delivers the message saying how many.
    pub fn take_destination(&mut self) -> Option<(&mut [u8], &dyn Fn() -> bool)> {
        self.destination.take()
    }

    /// The message the receive waits for.
    pub fn message(&self) -> Awaited {
        self.message
    }

    /// Hands the awaited message (checked as any group is, and taken off the channel) to its
    /// receive. A channel calls this before it lets anything it received later be delivered
    /// (under its read lock): a later message of the same key must not reach the rank's store
    /// before the receive has taken this one, or the two would be taken in the wrong order.
    pub fn hand(self, incoming: Incoming) {
        (self.take)(incoming)
    }
}
