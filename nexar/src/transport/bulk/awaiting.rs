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
}

impl std::fmt::Debug for Awaiting<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Awaiting").field("message", &self.message).finish_non_exhaustive()
    }
}

impl<'a> Awaiting<'a> {
    /// A receive waiting for `message`, which `take` consumes when a channel hands it over.
    pub fn new(message: Awaited, take: &'a mut dyn FnMut(Incoming)) -> Awaiting<'a> {
        Awaiting { message, take }
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
