//! The channel engine: one thread per RDMA link that turns message groups into RDMA writes
//! and completions back into message groups, with credit-based flow control.
//!
//! Sending: a group is cut into slot-sized chunks; each chunk is copied into the next staging
//! slot and written to the peer's ring slot of the same index, with an immediate value that
//! names the slot and marks the group's last chunk. A slot is used again only when the NIC
//! has completed its write *and* the peer has returned a credit for it, so the peer's ring is
//! never overwritten before it was read. A group's `send` resolves when its last write has
//! completed.
//!
//! Receiving: each arrival names a ring slot; its bytes are appended to the group being
//! assembled, the receive is posted again, and the slot's credit goes back to the peer (in
//! batches, as a zero-length write whose immediate value carries the count). A finished group
//! goes to nexar's [`BulkInbound`](nexar::backend::BulkInbound) on the runtime.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::Duration;

use bytes::Bytes;
use nexar::TransportError;
use nexar::backend::{BulkChannel, BulkClosed, BulkSend};
use tokio::sync::{mpsc, oneshot, watch};

use crate::wire::{Completion, Wire};

/// Immediate-value bit: a credit return (the low 16 bits count the slots returned).
const CREDIT: u32 = 1 << 31;
/// Immediate-value bit: the last chunk of a group.
const LAST: u32 = 1 << 30;
/// Low bits of an immediate value: the slot, or the credit count.
const LOW: u32 = 0xffff;
/// How long an idle engine keeps polling before it starts sleeping between polls.
const SPIN: Duration = Duration::from_micros(50);
/// How long an idle engine sleeps between polls.
const IDLE_SLEEP: Duration = Duration::from_micros(50);

/// Who waits for a group to be written.
type Done = oneshot::Sender<Result<(), TransportError>>;

/// One group to send and who waits for it.
struct Request {
    frames: Vec<Bytes>,
    done: Done,
}

/// The sending half nexar holds: groups go to the engine thread in order.
pub(crate) struct RdmaChannel {
    name: &'static str,
    peer: usize,
    requests: Sender<Request>,
    /// Becomes `true` when the engine stopped: the link goes back to QUIC.
    stopped: watch::Receiver<bool>,
    /// Set by nexar when the link gives the channel up: the engine fails what it holds and stops.
    close: Arc<AtomicBool>,
}

impl BulkChannel for RdmaChannel {
    fn name(&self) -> &'static str {
        self.name
    }

    fn send(&self, frames: Vec<Bytes>) -> BulkSend {
        let (done, wait) = oneshot::channel();
        let lost = link_lost(self.peer, "its engine has stopped");
        if self.requests.send(Request { frames, done }).is_err() {
            return Box::pin(async move { Err(lost) });
        }
        Box::pin(async move { wait.await.unwrap_or(Err(lost)) })
    }

    fn usable(&self) -> bool {
        !*self.stopped.borrow()
    }

    fn close(&self) {
        self.close.store(true, Ordering::Release);
    }

    fn closed(&self) -> BulkClosed {
        let mut stopped = self.stopped.clone();
        // Resolves on `true`, and also when the engine thread is gone without saying so.
        Box::pin(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
    }
}

fn link_lost(peer: usize, reason: &str) -> TransportError {
    TransportError::ConnectionLost { peer: format!("rank {peer} (RDMA)"), reason: reason.to_string() }
}

/// Starts the engine of a connected wire. Groups received go to `delivered`; groups larger
/// than `max_group` bytes are a protocol violation.
pub(crate) fn start(
    name: &'static str,
    peer: usize,
    wire: Box<dyn Wire>,
    max_group: usize,
    delivered: mpsc::Sender<Bytes>,
) -> std::io::Result<RdmaChannel> {
    let (requests, incoming) = std::sync::mpsc::channel();
    let (flag, stopped) = watch::channel(false);
    let close = Arc::new(AtomicBool::new(false));
    let close_requested = close.clone();
    std::thread::Builder::new().name(format!("nexar-rdma-{peer}")).spawn(move || {
        let mut engine = Engine::new(peer, wire, max_group, delivered, close_requested);
        let result = engine.run(incoming, &flag);
        flag.send_replace(true);
        if let Err(what) = result {
            tracing::error!(peer, %what, "RDMA link failed: its pending payloads fail, later ones go over QUIC");
        }
    })?;
    Ok(RdmaChannel { name, peer, requests, stopped, close })
}

/// A group being written: where the next chunk starts.
struct Sending {
    request: Request,
    frame: usize,
    offset: usize,
}

struct Engine {
    peer: usize,
    wire: Box<dyn Wire>,
    max_group: usize,
    delivered: mpsc::Sender<Bytes>,
    /// Finished groups the delivery queue had no room for: while there are any, no credit
    /// goes back, so the peer cannot make this rank hold more than one ring's worth of them.
    undelivered: VecDeque<Bytes>,
    /// Ring slots of the peer this side may write now.
    credits: usize,
    next_slot: usize,
    /// Staging slots whose write has not completed yet.
    staging_busy: Vec<bool>,
    /// Posted writes in order: the slot (none for credit writes) and, for a group's last
    /// chunk, who waits for it.
    in_flight: VecDeque<(Option<usize>, Option<Done>)>,
    queue: VecDeque<Request>,
    sending: Option<Sending>,
    assembling: Vec<u8>,
    /// Ring slots read but not yet returned to the peer.
    to_return: u32,
    /// Credit writes posted and not completed (the send queue holds `slots` data writes and
    /// `slots + 1` of these).
    credit_writes: usize,
    completions: Vec<Completion>,
    close: Arc<AtomicBool>,
}

impl Engine {
    fn new(
        peer: usize,
        wire: Box<dyn Wire>,
        max_group: usize,
        delivered: mpsc::Sender<Bytes>,
        close: Arc<AtomicBool>,
    ) -> Engine {
        let slots = wire.slots();
        Engine {
            peer,
            wire,
            max_group,
            delivered,
            undelivered: VecDeque::new(),
            credits: slots,
            next_slot: 0,
            staging_busy: vec![false; slots],
            in_flight: VecDeque::new(),
            queue: VecDeque::new(),
            sending: None,
            assembling: Vec::new(),
            to_return: 0,
            credit_writes: 0,
            completions: Vec::new(),
            close,
        }
    }

    /// Runs until nexar drops the channel (and everything sent has completed) or the link
    /// fails; a failure fails every waiting and later group.
    fn run(&mut self, incoming: Receiver<Request>, stopped: &watch::Sender<bool>) -> Result<(), String> {
        let result = self.serve(&incoming);
        // Whole groups that arrived still go to the rank (their senders count them delivered);
        // a partly written one is lost, and its collective fails through the link's failure.
        for group in self.undelivered.drain(..) {
            if self.delivered.blocking_send(group).is_err() {
                break;
            }
        }
        if let Err(what) = &result {
            // New groups go over QUIC from now on; those already handed over fail.
            stopped.send_replace(true);
            let err = link_lost(self.peer, what);
            let waiting = self.sending.take().map(|s| s.request).into_iter().chain(self.queue.drain(..));
            for request in waiting {
                let _ = request.done.send(Err(err.clone()));
            }
            for (_, done) in self.in_flight.drain(..) {
                if let Some(done) = done {
                    let _ = done.send(Err(err.clone()));
                }
            }
            while let Ok(request) = incoming.try_recv() {
                let _ = request.done.send(Err(err.clone()));
            }
        }
        result
    }

    fn serve(&mut self, incoming: &Receiver<Request>) -> Result<(), String> {
        let mut idle_since: Option<std::time::Instant> = None;
        let mut open = true;
        loop {
            if open {
                loop {
                    match incoming.try_recv() {
                        Ok(request) => self.queue.push_back(request),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            open = false;
                            break;
                        }
                    }
                }
            }
            let mut progress = self.complete()?;
            progress |= self.post_writes()?;
            progress |= self.hand_over();
            let may_return = self.undelivered.is_empty() && self.credit_writes <= self.wire.slots();
            if self.to_return > 0 && may_return && (!progress || self.to_return as usize >= self.wire.slots() / 2) {
                self.return_credits()?;
                progress = true;
            }
            if self.delivered.is_closed() {
                return Err("the rank stopped taking what arrives".into());
            }
            if self.close.load(Ordering::Acquire) {
                return Err("the link gave the channel up".into());
            }
            if !open {
                // nexar dropped the channel: nobody waits for anything it holds.
                return Ok(());
            }
            let busy = self.sending.is_some() || !self.queue.is_empty() || !self.in_flight.is_empty();
            let spinning = *idle_since.get_or_insert_with(std::time::Instant::now);
            if progress {
                idle_since = None;
            } else if spinning.elapsed() < SPIN {
                std::hint::spin_loop();
            } else if open && !busy {
                match incoming.recv_timeout(IDLE_SLEEP) {
                    Ok(request) => self.queue.push_back(request),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => open = false,
                }
            } else {
                std::thread::sleep(IDLE_SLEEP);
            }
        }
    }

    /// Handles every ready completion; whether there was any.
    fn complete(&mut self) -> Result<bool, String> {
        let mut ready = std::mem::take(&mut self.completions);
        ready.clear();
        self.wire.poll(&mut ready).map_err(|e| e.to_string())?;
        let any = !ready.is_empty();
        for completion in ready.drain(..) {
            match completion {
                Completion::Written { slot } => self.written(slot)?,
                Completion::Arrived { imm, len } => self.arrived(imm, len)?,
                Completion::Failed { what } => return Err(what),
            }
        }
        self.completions = ready;
        Ok(any)
    }

    fn written(&mut self, slot: Option<usize>) -> Result<(), String> {
        let Some((posted, done)) = self.in_flight.pop_front() else {
            return Err("a write completed that was never posted".into());
        };
        if posted != slot {
            return Err(format!("writes completed out of order: {slot:?} before {posted:?}"));
        }
        match slot {
            Some(s) => self.staging_busy[s] = false,
            None => self.credit_writes -= 1,
        }
        if let Some(done) = done {
            let _ = done.send(Ok(()));
        }
        Ok(())
    }

    fn arrived(&mut self, imm: u32, len: usize) -> Result<(), String> {
        self.wire.repost().map_err(|e| e.to_string())?;
        let low = (imm & LOW) as usize;
        if imm & CREDIT != 0 {
            if self.credits + low > self.wire.slots() {
                return Err(format!("rank {} returned {low} credits, more than it holds", self.peer));
            }
            self.credits += low;
            return Ok(());
        }
        if self.to_return as usize >= self.wire.slots() {
            return Err(format!("rank {} wrote more slots than it holds credits for", self.peer));
        }
        if low >= self.wire.slots() || len > self.wire.slot_size() {
            return Err(format!("rank {} wrote {len} bytes into slot {low}, outside the ring", self.peer));
        }
        if self.assembling.len() + len > self.max_group {
            return Err(format!("rank {} sent a group over the {}-byte limit", self.peer, self.max_group));
        }
        self.wire.read_ring(low, len, &mut self.assembling);
        self.to_return += 1;
        if imm & LAST != 0 {
            self.undelivered.push_back(Bytes::from(std::mem::take(&mut self.assembling)));
            self.hand_over();
        }
        Ok(())
    }

    /// Posts as many chunks as credits and free staging slots allow; whether it posted any.
    fn post_writes(&mut self) -> Result<bool, String> {
        let mut posted = false;
        loop {
            if self.sending.is_none() {
                let Some(request) = self.queue.pop_front() else { return Ok(posted) };
                self.sending = Some(Sending { request, frame: 0, offset: 0 });
            }
            let slot = self.next_slot;
            if self.credits == 0 || self.staging_busy[slot] {
                return Ok(posted);
            }
            let Some(sending) = self.sending.as_mut() else { return Ok(posted) };
            let staging = self.wire.staging(slot);
            let len = fill(staging, sending);
            let last = sending.frame == sending.request.frames.len();
            let imm = slot as u32 | if last { LAST } else { 0 };
            self.wire.write(Some(slot), len, imm).map_err(|e| e.to_string())?;
            self.credits -= 1;
            self.staging_busy[slot] = true;
            self.next_slot = (slot + 1) % self.wire.slots();
            let done = if last { self.sending.take().map(|s| s.request.done) } else { None };
            self.in_flight.push_back((Some(slot), done));
            posted = true;
        }
    }

    /// Passes finished groups to the delivery queue while it has room; whether any went.
    fn hand_over(&mut self) -> bool {
        let mut any = false;
        while let Some(group) = self.undelivered.pop_front() {
            match self.delivered.try_send(group) {
                Ok(()) => any = true,
                Err(mpsc::error::TrySendError::Full(group)) => {
                    self.undelivered.push_front(group);
                    break;
                }
                // The rank is going away; nobody wants the groups.
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    self.undelivered.clear();
                    return true;
                }
            }
        }
        any
    }

    fn return_credits(&mut self) -> Result<(), String> {
        self.wire.write(None, 0, CREDIT | self.to_return).map_err(|e| e.to_string())?;
        self.credit_writes += 1;
        self.in_flight.push_back((None, None));
        self.to_return = 0;
        Ok(())
    }
}

/// Copies the next chunk of a group into `staging`; returns its length. Empty frames are
/// skipped; a group's last chunk leaves `frame` past the end.
fn fill(staging: &mut [u8], sending: &mut Sending) -> usize {
    let mut len = 0;
    let frames = &sending.request.frames;
    while len < staging.len() && sending.frame < frames.len() {
        let frame = &frames[sending.frame];
        let n = (frame.len() - sending.offset).min(staging.len() - len);
        staging[len..len + n].copy_from_slice(&frame[sending.offset..sending.offset + n]);
        len += n;
        sending.offset += n;
        if sending.offset == frame.len() {
            sending.frame += 1;
            sending.offset = 0;
        }
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulated;

    /// Two engines over the emulated fabric: `a` sends to `b`; what reaches `a` is kept too.
    type Pair = (RdmaChannel, mpsc::Receiver<Bytes>, RdmaChannel, mpsc::Receiver<Bytes>);

    fn pair(slots: u16, queue: usize) -> Pair {
        let (ea, oa) = emulated::open(slots, 4096);
        let (eb, ob) = emulated::open(slots, 4096);
        let (wa, wb) = (ea.connect(&ob).unwrap(), eb.connect(&oa).unwrap());
        let (to_a, at_a) = mpsc::channel(queue);
        let (to_b, at_b) = mpsc::channel(queue);
        let a = start("test", 1, Box::new(wa), 1 << 20, to_a).unwrap();
        let b = start("test", 0, Box::new(wb), 1 << 20, to_b).unwrap();
        (a, at_b, b, at_a)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn groups_arrive_whole_and_in_order_across_slot_boundaries() {
        let (a, mut at_b, _b, _at_a) = pair(3, 64);
        let sizes = [0usize, 1, 4095, 4096, 4097, 3 * 4096, 20_000, 100_000];
        let sends: Vec<_> = sizes
            .iter()
            .map(|&n| {
                let half = n / 2;
                let body: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
                // Two frames per group, split at an arbitrary point.
                a.send(vec![Bytes::copy_from_slice(&body[..half]), Bytes::copy_from_slice(&body[half..])])
            })
            .collect();
        for (&n, sent) in sizes.iter().zip(sends) {
            let group = at_b.recv().await.unwrap();
            assert_eq!(group.len(), n);
            assert!(group.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
            sent.await.unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_receiver_that_does_not_keep_up_holds_the_sender_back() {
        let (a, mut at_b, _b, _at_a) = pair(4, 1);
        let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for i in 0..64u8 {
            let sent = a.send(vec![Bytes::from(vec![i; 100])]);
            let done = done.clone();
            tokio::spawn(async move {
                sent.await.unwrap();
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The queue (1), the groups parked while credits are held back (at most the 4 slots
        // the sender had), and nothing more: the rest wait for credits.
        let written = done.load(std::sync::atomic::Ordering::SeqCst);
        assert!(written <= 1 + 4 + 4, "{written} groups written into a receiver that reads nothing");
        for i in 0..64u8 {
            let group = tokio::time::timeout(Duration::from_secs(30), at_b.recv()).await.unwrap().unwrap();
            assert_eq!(&group[..], &[i; 100][..]);
        }
    }
}
