//! One rank's view of elastic growth: which ranks joined the running cluster and connected
//! to this one, which of them became members of a communicator here, and the communicator
//! this rank itself was admitted to after joining. The client owns one; `comm::grow` (the
//! members' and joiners' protocol), the joiner acceptor, the control lane and health reach it
//! only through these methods.

use std::collections::BTreeSet;
use std::sync::Mutex;

use tokio::sync::{Notify, futures::Notified, watch};

/// What a rank was admitted to: the communicator's id and its members' world ranks.
pub(crate) type Admission = Option<(u64, Vec<usize>)>;

pub(crate) struct Growth {
    /// World ranks that joined the running cluster and connected to this rank, in order.
    late_joiners: Mutex<Vec<usize>>,
    /// Woken whenever one connects.
    joined: Notify,
    /// Late joiners that became members of a communicator of this rank.
    admitted: Mutex<BTreeSet<usize>>,
    /// The communicator this rank was admitted to after joining a running cluster, if any.
    admission: watch::Sender<Admission>,
}

impl Default for Growth {
    fn default() -> Growth {
        Growth {
            late_joiners: Mutex::default(),
            joined: Notify::new(),
            admitted: Mutex::default(),
            admission: watch::channel(None).0,
        }
    }
}

impl Growth {
    /// World rank `peer`, which joined the running cluster, connected to this rank.
    pub(crate) fn connected(&self, peer: usize) {
        crate::sync::lock(&self.late_joiners).push(peer);
        self.joined.notify_waiters();
    }

    /// Resolves at the next connection of a late joiner (arm it before looking).
    pub(crate) fn next_connection(&self) -> Notified<'_> {
        self.joined.notified()
    }

    /// The late joiners connected so far, in order, each once.
    pub(crate) fn joiners(&self) -> Vec<usize> {
        let mut seen = BTreeSet::new();
        crate::sync::lock(&self.late_joiners).iter().copied().filter(|j| seen.insert(*j)).collect()
    }

    /// How many late joiners connected (for the membership metrics).
    pub(crate) fn joined_count(&self) -> usize {
        crate::sync::lock(&self.late_joiners).len()
    }

    /// `members` (world ranks) are now members of a communicator of this rank.
    pub(crate) fn admit(&self, members: &[usize]) {
        crate::sync::lock(&self.admitted).extend(members.iter().copied());
    }

    /// Whether world rank `peer`, a late joiner, became a member here.
    pub(crate) fn is_admitted(&self, peer: usize) -> bool {
        crate::sync::lock(&self.admitted).contains(&peer)
    }

    /// The members admitted this rank (a late joiner) to communicator `comm` of `members`.
    pub(crate) fn admitted_to(&self, comm: u64, members: Vec<usize>) {
        self.admission.send_replace(Some((comm, members)));
    }

    /// Watches for this rank's admission.
    pub(crate) fn admission(&self) -> watch::Receiver<Admission> {
        self.admission.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joiners_are_listed_once_in_order_and_admission_is_remembered() {
        let growth = Growth::default();
        let woken = growth.next_connection();
        tokio::pin!(woken);
        woken.as_mut().enable();
        growth.connected(9);
        growth.connected(7);
        growth.connected(9);
        assert_eq!(growth.joiners(), vec![9, 7]);
        assert_eq!(growth.joined_count(), 3);
        // The waiter armed before the connection is woken.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(woken.as_mut().poll(&mut cx).is_ready());
        assert!(!growth.is_admitted(7));
        growth.admit(&[0, 1, 7]);
        assert!(growth.is_admitted(7) && !growth.is_admitted(9));
        let rx = growth.admission();
        assert!(rx.borrow().is_none());
        growth.admitted_to(42, vec![0, 1, 7]);
        assert_eq!(*rx.borrow(), Some((42, vec![0, 1, 7])));
    }
}
