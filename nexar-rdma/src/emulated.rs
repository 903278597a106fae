//! An in-process emulation of an RDMA NIC, for tests and for trying the transport on a host
//! without one: queue pairs of ranks in one process (`NexarClient::bootstrap_local`) find each
//! other by number, and a write copies from the writer's staging slot into the peer's ring.
//!
//! It keeps the rules a real reliable-connected queue pair enforces, so the engine is tested
//! against them: a write needs the right remote key, lands in a slot inside the ring, and
//! consumes a receive the peer posted (a write without one is an error here, where a NIC
//! would stall on "receiver not ready"); completions come in posting order.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use crate::RdmaError;
use crate::setup::{FabricKind, QpOffer};
use crate::wire::{Completion, Wire};

/// The emulated fabric: queue pairs by number.
static PORTS: LazyLock<Mutex<HashMap<u32, Arc<Port>>>> = LazyLock::new(Default::default);
static NEXT_QPN: AtomicU32 = AtomicU32::new(1);
/// When set, every emulated write fails (see [`crate::inject_emulated_fault`]).
static FAULT: AtomicBool = AtomicBool::new(false);

/// Makes every later write on the emulated fabric fail, as a NIC or cable fault would.
pub(crate) fn set_fault(on: bool) {
    FAULT.store(on, Ordering::Release);
}

/// One queue pair's receiving side: its ring, its remote key, the receives it has posted and
/// what arrived.
struct Port {
    /// The queue pair is gone; writes to it fail.
    closed: AtomicBool,
    rkey: u32,
    ring: Vec<Mutex<Vec<u8>>>,
    posted: AtomicUsize,
    arrivals: Mutex<VecDeque<Completion>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A queue pair made but not connected yet.
pub(crate) struct Endpoint {
    qpn: u32,
    port: Arc<Port>,
    slot_size: usize,
    connected: bool,
}

/// Makes a queue pair with a ring of `slots` × `slot_size` bytes and `2 × slots` receives
/// posted; returns it and the offer that describes it.
pub(crate) fn open(slots: u16, slot_size: u32) -> (Endpoint, QpOffer) {
    let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
    let rkey = rand::random();
    let ring = (0..slots).map(|_| Mutex::new(vec![0; slot_size as usize])).collect();
    let port = Arc::new(Port {
        closed: AtomicBool::new(false),
        rkey,
        ring,
        posted: AtomicUsize::new(2 * usize::from(slots)),
        arrivals: Mutex::new(VecDeque::new()),
    });
    lock(&PORTS).insert(qpn, port.clone());
    let offer = QpOffer {
        fabric: FabricKind::Emulated,
        lid: 0,
        gid: None,
        qpn,
        psn: rand::random::<u32>() & 0xff_ffff,
        mtu: 5,
        ring_addr: 0,
        rkey,
        slots,
        slot_size,
    };
    (Endpoint { qpn, port, slot_size: slot_size as usize, connected: false }, offer)
}

impl Endpoint {
    /// Connects to the queue pair `remote` describes.
    pub(crate) fn connect(mut self, remote: &QpOffer) -> Result<EmulatedWire, RdmaError> {
        let peer = lock(&PORTS).get(&remote.qpn).cloned().ok_or_else(|| RdmaError::Verbs {
            call: "connect",
            reason: format!("no emulated queue pair {:#x} in this process", remote.qpn),
        })?;
        let slots = self.port.ring.len();
        self.connected = true;
        Ok(EmulatedWire {
            staging: vec![vec![0; self.slot_size]; slots],
            me: self.port.clone(),
            qpn: self.qpn,
            peer,
            peer_rkey: remote.rkey,
            slot_size: self.slot_size,
            written: VecDeque::new(),
        })
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // A connected wire unregisters itself when it goes.
        if !self.connected {
            lock(&PORTS).remove(&self.qpn);
        }
    }
}

/// A connected emulated queue pair.
pub(crate) struct EmulatedWire {
    me: Arc<Port>,
    qpn: u32,
    peer: Arc<Port>,
    peer_rkey: u32,
    slot_size: usize,
    staging: Vec<Vec<u8>>,
    written: VecDeque<Completion>,
}

impl Drop for EmulatedWire {
    fn drop(&mut self) {
        self.me.closed.store(true, Ordering::Release);
        lock(&PORTS).remove(&self.qpn);
    }
}

impl Wire for EmulatedWire {
    fn slots(&self) -> usize {
        self.staging.len()
    }

    fn slot_size(&self) -> usize {
        self.slot_size
    }

    fn staging(&mut self, slot: usize) -> &mut [u8] {
        &mut self.staging[slot]
    }

    fn read_ring(&self, slot: usize, len: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(&lock(&self.me.ring[slot])[..len]);
    }

    fn write(&mut self, slot: Option<usize>, len: usize, imm: u32) -> Result<(), RdmaError> {
        let fail = |reason: String| RdmaError::Verbs { call: "post_send (emulated)", reason };
        if FAULT.load(Ordering::Acquire) {
            return Err(fail("injected fault".into()));
        }
        if self.peer.closed.load(Ordering::Acquire) {
            return Err(fail("the peer's queue pair is gone".into()));
        }
        if self.peer_rkey != self.peer.rkey {
            return Err(fail("remote key does not match the peer's ring".into()));
        }
        let taken = self.peer.posted.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if taken.is_err() {
            return Err(fail("receiver not ready: the peer has no receive posted".into()));
        }
        if let Some(slot) = slot {
            let target = self.peer.ring.get(slot).ok_or_else(|| fail(format!("slot {slot} is outside the ring")))?;
            if len > self.slot_size {
                return Err(fail(format!("{len} bytes do not fit a {}-byte slot", self.slot_size)));
            }
            lock(target)[..len].copy_from_slice(&self.staging[slot][..len]);
        }
        lock(&self.peer.arrivals).push_back(Completion::Arrived { imm, len });
        self.written.push_back(Completion::Written { slot });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        if FAULT.load(Ordering::Acquire) {
            return Err(RdmaError::Verbs { call: "poll_cq (emulated)", reason: "injected fault".into() });
        }
        out.extend(self.written.drain(..));
        out.extend(lock(&self.me.arrivals).drain(..));
        Ok(())
    }

    fn repost(&mut self) -> Result<(), RdmaError> {
        self.me.posted.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}
