//! The matcher as a lane's store: what transport asks of it (`transport::inbox::Inbox`),
//! answered at once where it can.

use super::{Delivered, Mailbox, key_of};
use crate::proto::message::PeerMsg;
use crate::transport::inbox::{Admission, Delivery, Inbox};
use crate::transport::link::Incoming;

impl Inbox for Mailbox {
    fn admit(&self, msg: &PeerMsg, from: u32, len: u64) -> Option<Admission<'_>> {
        let key = key_of(msg, from)?;
        Some(match self.admit_or_wait(key, len) {
            Ok(admitted) => Admission::Now(admitted),
            Err(wait) => Admission::Wait(wait),
        })
    }

    fn deliver(&self, incoming: Incoming) -> Delivery<'_> {
        let Some((key, held)) = (self.entry)(incoming) else { return Delivery::Done };
        match self.try_deliver(key, held) {
            Delivered::Done => Delivery::Done,
            Delivered::Parked => Delivery::Wait(Box::pin(self.overflow_moved(key.src))),
            Delivered::Busy(back) => Delivery::Wait(Box::pin(self.deliver_held(key, back))),
        }
    }

    fn release(&self, from: u32, len: u64) {
        let mut st = self.lock();
        st.count_out(from, len);
        self.made_room(&mut st);
    }

    fn lost(&self, collectives: Vec<(u64, u64)>, reason: &str) {
        for (comm, seq) in collectives {
            self.fail_link(comm, seq, reason);
        }
    }

    fn link_failed(&self, carried: Vec<(u64, u64)>, reason: &str) {
        self.fail_link_all(carried, reason);
    }
}
