//! One rank's RPC service: the functions linked into this program, the state its handlers
//! get, what each peer said it serves, and the calls waiting for their answers. The client
//! owns one; calls, the request server and the control lane reach it only through these
//! methods.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::{Registry, StateMap};
use crate::transport::framed::Payload;

/// Where the answer to one call goes: its status and body.
pub(crate) type RpcReply = oneshot::Sender<(u8, Payload)>;

/// What a peer's registry says of one function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Served {
    /// The peer has not said what it serves (yet): only the call can tell.
    Unknown,
    /// It serves the function with this signature hash.
    With(u64),
    /// It does not serve it.
    No,
}

pub(crate) struct RpcService {
    registry: Arc<Registry>,
    state: StateMap,
    /// Calls waiting for their response, by (the world rank called, request id): only the
    /// rank a call went to can answer it.
    pending: Mutex<HashMap<(u32, u64), RpcReply>>,
    next_req: AtomicU64,
    /// What each world rank said it serves: function id → signature hash.
    peer_registries: Mutex<Vec<Option<HashMap<u64, u64>>>>,
}

impl RpcService {
    /// The service of a rank that serves `registry`, among at most `capacity` world ranks.
    pub(crate) fn new(registry: Arc<Registry>, capacity: usize) -> RpcService {
        RpcService {
            registry,
            state: StateMap::default(),
            pending: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(0),
            peer_registries: Mutex::new(vec![None; capacity]),
        }
    }

    /// The functions this rank serves.
    pub(crate) fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The state this rank's handlers get.
    pub(crate) fn state(&self) -> &StateMap {
        &self.state
    }

    /// A new call to world rank `to`: its request id, and where its answer will arrive.
    pub(crate) fn expect(&self, to: u32) -> (u64, oneshot::Receiver<(u8, Payload)>) {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        crate::sync::lock(&self.pending).insert((to, req), tx);
        (req, rx)
    }

    /// Stops waiting for the answer to call `req` to world rank `to` (it ended).
    pub(crate) fn forget(&self, to: u32, req: u64) {
        crate::sync::lock(&self.pending).remove(&(to, req));
    }

    /// Where the answer of world rank `from` to call `req` goes; `None` when no call with
    /// this id to this rank is waiting (it was not asked, or the call already ended).
    pub(crate) fn answer(&self, from: u32, req: u64) -> Option<RpcReply> {
        crate::sync::lock(&self.pending).remove(&(from, req))
    }

    /// Records what world rank `from` said it serves (ranks beyond the capacity are ignored).
    pub(crate) fn learn(&self, from: usize, entries: impl IntoIterator<Item = (u64, u64)>) {
        if let Some(slot) = crate::sync::lock(&self.peer_registries).get_mut(from) {
            *slot = Some(entries.into_iter().collect());
        }
    }

    /// What world rank `peer` said of function `func`.
    pub(crate) fn served_by(&self, peer: usize, func: u64) -> Served {
        match crate::sync::lock(&self.peer_registries).get(peer).and_then(Option::as_ref) {
            None => Served::Unknown,
            Some(known) => known.get(&func).map_or(Served::No, |sig| Served::With(*sig)),
        }
    }

    /// How many calls wait for an answer.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        crate::sync::lock(&self.pending).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service() -> RpcService {
        RpcService::new(Arc::new(Registry::default()), 4)
    }

    #[test]
    fn only_the_rank_called_can_answer_and_only_once() {
        let rpc = service();
        let (a, mut rx_a) = rpc.expect(1);
        let (b, _rx_b) = rpc.expect(2);
        assert_ne!(a, b, "request ids are unique");
        // Rank 2 cannot answer rank 1's call, even with its id.
        assert!(rpc.answer(2, a).is_none());
        let reply = rpc.answer(1, a).expect("rank 1 answers its call");
        reply.send((0, Payload::default())).unwrap();
        assert!(rx_a.try_recv().is_ok());
        assert!(rpc.answer(1, a).is_none(), "a second answer finds nobody");
        // A call that ended stops waiting.
        rpc.forget(2, b);
        assert_eq!(rpc.waiting(), 0);
    }

    #[test]
    fn peers_registries_say_what_they_serve() {
        let rpc = service();
        assert_eq!(rpc.served_by(1, 7), Served::Unknown);
        rpc.learn(1, [(7, 70), (8, 80)]);
        assert_eq!(rpc.served_by(1, 7), Served::With(70));
        assert_eq!(rpc.served_by(1, 9), Served::No);
        assert_eq!(rpc.served_by(2, 7), Served::Unknown);
        // A rank beyond the capacity is not recorded (and does not panic).
        rpc.learn(99, [(7, 70)]);
        assert_eq!(rpc.served_by(99, 7), Served::Unknown);
    }
}
