//! The flight recorder: a bounded ring of this rank's last operations, and the operations in
//! flight, kept apart so a long-running operation is never pushed out by short ones.
//!
//! Recording takes one uncontended lock and writes into storage reserved up front, so the hot
//! path does not allocate (an error text, on the failure path, is the exception). Every
//! operation recorded is also metered ([`crate::telemetry`]).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nexar_types::DType;
use rustc_hash::FxHashMap;

use super::dump::{TraceDump, TraceEntry};
use crate::sync::lock;
use crate::telemetry::{Outcome, RankMeters};

/// What kind of operation an entry records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpClass {
    /// A collective (or one plan of collectives) on a communicator.
    Collective,
    /// A point-to-point send.
    Send,
    /// A point-to-point receive.
    Recv,
    /// An RPC call this rank made.
    Rpc,
}

impl OpClass {
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Collective => "collective",
            OpClass::Send => "send",
            OpClass::Recv => "recv",
            OpClass::Rpc => "rpc",
        }
    }
}

/// Where an operation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpState {
    /// Running, or waiting for a peer.
    Started,
    /// Finished successfully.
    Completed,
    /// Finished with an error (kept in the entry).
    Failed,
    /// Its future was dropped before it finished.
    Cancelled,
}

impl OpState {
    pub fn name(self) -> &'static str {
        match self {
            OpState::Started => "started",
            OpState::Completed => "completed",
            OpState::Failed => "failed",
            OpState::Cancelled => "cancelled",
        }
    }
}

/// What an operation is, as the caller made it. `Copy`, so recording it costs no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub class: OpClass,
    /// Communicator id (0, the world, for RPC).
    pub comm: u64,
    /// Collective sequence number; for point-to-point the tag; for RPC the function id.
    pub seq: u64,
    /// Operation name (`all_reduce`, `send`, `rpc`).
    pub op: &'static str,
    /// Collective kind's wire code (0 for others).
    pub kind: u8,
    pub dtype: Option<DType>,
    /// Elements the caller passed.
    pub count: u64,
    pub root: Option<u32>,
    /// The peer (world rank) of a point-to-point operation or RPC call.
    pub peer: Option<u32>,
    pub algorithm: &'static str,
    pub bytes: u64,
}

/// One recorded operation.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    /// Order of recording on this rank, from 0.
    pub id: u64,
    pub desc: OpDesc,
    pub state: OpState,
    /// Microseconds since the recorder started.
    pub started_us: u64,
    pub ended_us: Option<u64>,
    /// The peer (world rank) the operation waits for right now, if it is parked on one.
    pub waiting_on: Option<u32>,
    /// Since when (microseconds since the recorder started) it waits for `waiting_on`;
    /// meaningless while `waiting_on` is `None`.
    pub waiting_since_us: u64,
    pub error: Option<Arc<str>>,
}

/// How far this rank got with the collectives of one communicator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CommProgress {
    pub last_started: Option<u64>,
    pub last_completed: Option<u64>,
}

struct Ring {
    /// Finished operations, oldest overwritten first (`slots[id % capacity]`).
    slots: Vec<Entry>,
    capacity: usize,
    /// Operations in flight.
    active: Vec<Entry>,
    next_id: u64,
    progress: FxHashMap<u64, CommProgress>,
}

/// A bounded record of this rank's last operations (see the module docs).
pub(crate) struct FlightRecorder {
    ring: Mutex<Ring>,
    origin: Instant,
    /// Wall-clock time of `origin`, in microseconds since the Unix epoch.
    origin_unix_us: u64,
    meters: RankMeters,
}

impl fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlightRecorder").field("capacity", &lock(&self.ring).capacity).finish()
    }
}

impl FlightRecorder {
    /// A recorder of world rank `rank` that keeps the last `capacity` finished operations (0
    /// keeps none, though the operations in flight are still known, for the stall inspector).
    pub fn new(capacity: usize, rank: usize) -> Self {
        let origin_unix_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        FlightRecorder {
            ring: Mutex::new(Ring {
                slots: Vec::with_capacity(capacity),
                capacity,
                active: Vec::with_capacity(16),
                next_id: 0,
                progress: FxHashMap::default(),
            }),
            origin: Instant::now(),
            origin_unix_us,
            meters: RankMeters::new(rank),
        }
    }

    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }

    /// Records the start of `desc`; the returned guard records how it ends (a guard dropped
    /// unfinished records a cancellation).
    pub fn start(&self, desc: OpDesc) -> OpTrace<'_> {
        self.start_at(desc, Instant::now())
    }

    /// [`start`](Self::start) for an operation that began at `began` (a clock read the caller
    /// has already made).
    pub fn start_at(&self, desc: OpDesc, began: Instant) -> OpTrace<'_> {
        self.meters.started();
        let now = began.saturating_duration_since(self.origin).as_micros() as u64;
        let mut ring = lock(&self.ring);
        let id = ring.next_id;
        ring.next_id += 1;
        if desc.class == OpClass::Collective {
            let progress = ring.progress.entry(desc.comm).or_default();
            progress.last_started = progress.last_started.max(Some(desc.seq));
        }
        ring.active.push(Entry {
            id,
            desc,
            state: OpState::Started,
            started_us: now,
            ended_us: None,
            waiting_on: None,
            waiting_since_us: now,
            error: None,
        });
        OpTrace { recorder: self, id, done: false }
    }

    fn set_size(&self, id: u64, count: u64, bytes: u64) {
        let mut ring = lock(&self.ring);
        if let Some(entry) = ring.active.iter_mut().rev().find(|e| e.id == id) {
            (entry.desc.count, entry.desc.bytes) = (count, bytes);
        }
    }

    fn set_waiting(&self, id: u64, peer: Option<u32>) {
        // The end of a wait needs no time stamp: only a wait in progress is reported.
        let now = if peer.is_some() { self.now_us() } else { 0 };
        let mut ring = lock(&self.ring);
        if let Some(entry) = ring.active.iter_mut().rev().find(|e| e.id == id) {
            entry.waiting_on = peer;
            entry.waiting_since_us = now;
        }
    }

    fn finish(&self, id: u64, state: OpState, error: Option<Arc<str>>) {
        let now = self.now_us();
        let (op, comm, bytes, started_us) = {
            let mut ring = lock(&self.ring);
            let Some(at) = ring.active.iter().rposition(|e| e.id == id) else { return };
            let mut entry = ring.active.swap_remove(at);
            (entry.state, entry.ended_us, entry.error, entry.waiting_on) = (state, Some(now), error, None);
            let metered = (entry.desc.op, entry.desc.comm, entry.desc.bytes, entry.started_us);
            if state == OpState::Completed && entry.desc.class == OpClass::Collective {
                let progress = ring.progress.entry(entry.desc.comm).or_default();
                progress.last_completed = progress.last_completed.max(Some(entry.desc.seq));
            }
            if ring.capacity > 0 {
                let slot = (entry.id % ring.capacity as u64) as usize;
                match ring.slots.get_mut(slot) {
                    Some(old) => *old = entry,
                    None => ring.slots.push(entry),
                }
            }
            metered
        };
        let outcome = match state {
            OpState::Completed => Outcome::Completed,
            OpState::Failed => Outcome::Failed,
            OpState::Started | OpState::Cancelled => Outcome::Cancelled,
        };
        // Metered outside the ring's lock, so a stall inspection never waits on the meters.
        self.meters.finished(op, comm, bytes, Duration::from_micros(now.saturating_sub(started_us)), outcome);
    }

    /// The collectives in flight on communicator `comm`, oldest first, and how far it got.
    pub fn position(&self, comm: u64) -> (Vec<Entry>, CommProgress) {
        let ring = lock(&self.ring);
        let mut active: Vec<Entry> = ring
            .active
            .iter()
            .filter(|e| e.desc.class == OpClass::Collective && e.desc.comm == comm)
            .cloned()
            .collect();
        active.sort_by_key(|e| e.id);
        (active, ring.progress.get(&comm).copied().unwrap_or_default())
    }

    /// Microseconds since the recorder started.
    pub fn elapsed_us(&self) -> u64 {
        self.now_us()
    }

    /// Everything recorded, oldest first, in the dump format.
    pub fn snapshot(&self, rank: usize, world: usize, cluster: &str, reason: &str) -> TraceDump {
        let ring = lock(&self.ring);
        let mut entries: Vec<&Entry> = ring.slots.iter().chain(ring.active.iter()).collect();
        entries.sort_by_key(|e| e.id);
        let unix = |us: u64| self.origin_unix_us + us;
        let now = self.now_us();
        TraceDump {
            cluster: cluster.to_string(),
            rank,
            world,
            reason: reason.to_string(),
            written_unix_us: unix(now),
            entries: entries
                .into_iter()
                .map(|e| TraceEntry {
                    id: e.id,
                    class: e.desc.class.name().to_string(),
                    comm: e.desc.comm,
                    seq: e.desc.seq,
                    op: e.desc.op.to_string(),
                    dtype: e.desc.dtype.map(|d| d.name().to_string()),
                    count: e.desc.count,
                    root: e.desc.root,
                    peer: e.desc.peer,
                    algorithm: (!e.desc.algorithm.is_empty()).then(|| e.desc.algorithm.to_string()),
                    bytes: e.desc.bytes,
                    state: e.state.name().to_string(),
                    started_unix_us: unix(e.started_us),
                    ended_unix_us: e.ended_us.map(unix),
                    duration_us: e.ended_us.unwrap_or(now).saturating_sub(e.started_us),
                    waiting_on: e.waiting_on,
                    error: e.error.as_deref().map(str::to_string),
                })
                .collect(),
        }
    }
}

/// The record of one operation in flight; see [`FlightRecorder::start`].
pub(crate) struct OpTrace<'r> {
    recorder: &'r FlightRecorder,
    id: u64,
    done: bool,
}

impl OpTrace<'_> {
    /// The operation now waits for world rank `peer` (parked, not spinning).
    pub fn waiting_on(&self, peer: usize) {
        self.recorder.set_waiting(self.id, Some(peer as u32));
    }

    /// The wait for a peer is over.
    pub fn not_waiting(&self) {
        self.recorder.set_waiting(self.id, None);
    }

    /// The operation's size became known only now (a receive of any length): `count`
    /// elements, `bytes` bytes.
    pub fn sized(&self, count: usize, bytes: usize) {
        self.recorder.set_size(self.id, count as u64, bytes as u64);
    }

    /// Records how the operation ended.
    pub fn end<T, E: fmt::Display>(mut self, result: &Result<T, E>) {
        self.done = true;
        match result {
            Ok(_) => self.recorder.finish(self.id, OpState::Completed, None),
            Err(e) => self.recorder.finish(self.id, OpState::Failed, Some(e.to_string().into())),
        }
    }
}

impl Drop for OpTrace<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.recorder.finish(self.id, OpState::Cancelled, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coll(seq: u64) -> OpDesc {
        OpDesc {
            class: OpClass::Collective,
            comm: 0,
            seq,
            op: "all_reduce",
            kind: 1,
            dtype: Some(DType::F32),
            count: 4,
            root: None,
            peer: None,
            algorithm: "ring",
            bytes: 16,
        }
    }

    #[test]
    fn the_ring_keeps_the_last_operations_and_those_in_flight() {
        let recorder = FlightRecorder::new(3, 1);
        let long = recorder.start(coll(0));
        for seq in 1..=5 {
            recorder.start(coll(seq)).end::<(), String>(&Ok(()));
        }
        long.waiting_on(2);
        let dump = recorder.snapshot(1, 4, "c", "test");
        let seqs: Vec<u64> = dump.entries.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![0, 3, 4, 5], "the long operation in flight stays, the oldest finished ones go");
        assert_eq!(dump.entries[0].state, "started");
        assert_eq!(dump.entries[0].waiting_on, Some(2));
        let (active, progress) = recorder.position(0);
        assert_eq!(active.len(), 1);
        assert_eq!(progress, CommProgress { last_started: Some(5), last_completed: Some(5) });
        long.end::<(), String>(&Err("rank 1 all_reduce: timed out".into()));
        let dump = recorder.snapshot(1, 4, "c", "test");
        assert!(dump.entries.iter().any(|e| e.seq == 0 && e.state == "failed" && e.error.is_some()));
    }

    #[test]
    fn a_size_learnt_late_is_recorded() {
        let recorder = FlightRecorder::new(4, 0);
        let op = recorder.start(OpDesc { count: 0, bytes: 0, ..coll(1) });
        op.sized(6, 24);
        op.end::<(), String>(&Ok(()));
        let dump = recorder.snapshot(0, 2, "c", "test");
        assert_eq!((dump.entries[0].count, dump.entries[0].bytes), (6, 24));
    }

    #[test]
    fn a_dropped_operation_is_recorded_as_cancelled() {
        let recorder = FlightRecorder::new(8, 0);
        drop(recorder.start(coll(7)));
        let dump = recorder.snapshot(0, 2, "c", "test");
        assert_eq!(dump.entries[0].state, "cancelled");
        assert_eq!(recorder.position(0).1.last_completed, None);
    }
}
