//! An exhaustive check of the ring's sleep and wake protocol: every interleaving of a writer
//! and a reader, step by step, on a small ring.
//!
//! The model transcribes the four functions of [`super::ring`] that coordinate the two sides,
//! one shared-memory access per step:
//! - `Writer::publish`: store `head`; swap the reader's flag to 0; ring the doorbell if it was up
//!   (the code loads the flag first and swaps only a raised one: swapping a lowered flag
//!   changes nothing, so the load stands for the swap);
//! - `Reader::sleep` (and the wait after it): raise the reader's flag; load `head`; lower the
//!   flag and go on if bytes came, else wait for a doorbell;
//! - `Reader::release`: store `tail`; swap the writer's flag to 0 (loaded first, likewise); futex-wake if it was up;
//! - `RoomWait::wait`: raise the writer's flag; load `tail`; lower it and go on if room came,
//!   else futex-wait on the flag (which returns at once unless the flag is still 1); lower it.
//!
//! Each access in the real code is `SeqCst` or sits between `SeqCst` fences, so the order of
//! these steps is sequentially consistent and an interleaving of whole steps covers every
//! execution. The doorbell is a socket (a bell rung while nobody waits is kept), the futex
//! wakes only a writer that already sleeps. The writer's nap, which bounds a sleep in the real
//! code should the peer scribble on the flag, is left out: the model proves that honest sides
//! never need it. A deadlock (a side waiting with nothing left to wake it) fails the test with
//! the interleaving that reached it; two broken variants of the protocol check that the search
//! would see one.

use std::collections::{HashSet, VecDeque};

/// Data capacity of the modelled ring, in bytes.
const CAP: u8 = 2;

/// Which protocol the model runs: the real one, or one with a known flaw.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Real,
    /// The reader sleeps without checking for bytes after raising its flag.
    ReaderSkipsRecheck,
    /// The writer looks at the reader's flag before it publishes `head`.
    WriterSwapsBeforeHead,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum W {
    /// Load `tail`, write what fits (or go to wait for room), or finish. (The code writes by
    /// a `tail` loaded earlier when that leaves room enough: an older tail only shows less
    /// room, and it loads anew before it would wait.)
    Write,
    PublishHead,
    PublishSwap,
    RingBell,
    WaitRaise,
    WaitLoadTail,
    WaitLower,
    FutexWait,
    /// In the futex: only a wake gets it out.
    Asleep,
    Done,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum R {
    /// Load `head`, take what is there, or go to sleep.
    Read,
    ReleaseTail,
    ReleaseSwap,
    FutexWake,
    SleepRaise,
    SleepLoadHead,
    SleepLower,
    /// Waiting on the socket: only a doorbell gets it out.
    AwaitBell,
    Done,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct State {
    // Shared memory.
    head: u8,
    tail: u8,
    reader_sleeps: bool,
    writer_sleeps: bool,
    // The socket and the futex.
    bells: u8,
    futex_woken: bool,
    // The writer: where it is, its own head, what it saw of the reader's flag.
    w: W,
    w_head: u8,
    w_saw_flag: bool,
    // The reader: where it is, its own tail.
    r: R,
    r_tail: u8,
}

/// The states one step of either side leads to (none: both are done, or both wait).
fn steps(s: &State, total: u8, v: Variant) -> Vec<(State, &'static str)> {
    let mut next = Vec::new();
    if let Some(n) = writer_step(s, total, v) {
        next.push(n);
    }
    if let Some(n) = reader_step(s, total, v) {
        next.push(n);
    }
    next
}

fn writer_step(s: &State, total: u8, v: Variant) -> Option<(State, &'static str)> {
    let mut n = s.clone();
    let what = match s.w {
        W::Write => {
            if s.w_head == total {
                n.w = W::Done;
            } else {
                let room = CAP - (s.w_head - s.tail);
                if room > 0 {
                    n.w_head += 1.min(total - s.w_head).min(room);
                    n.w = if v == Variant::WriterSwapsBeforeHead { W::PublishSwap } else { W::PublishHead };
                } else {
                    n.w = W::WaitRaise;
                }
            }
            "writer: load tail, write"
        }
        W::PublishHead => {
            n.head = s.w_head;
            n.w = if v == Variant::WriterSwapsBeforeHead {
                if s.w_saw_flag { W::RingBell } else { W::Write }
            } else {
                W::PublishSwap
            };
            "writer: store head"
        }
        W::PublishSwap => {
            n.w_saw_flag = s.reader_sleeps;
            n.reader_sleeps = false;
            n.w = match v {
                Variant::WriterSwapsBeforeHead => W::PublishHead,
                _ if s.reader_sleeps => W::RingBell,
                _ => W::Write,
            };
            "writer: swap the reader's flag"
        }
        W::RingBell => {
            n.bells = s.bells.saturating_add(1).min(2);
            n.w = W::Write;
            "writer: ring the doorbell"
        }
        W::WaitRaise => {
            n.writer_sleeps = true;
            n.w = W::WaitLoadTail;
            "writer: raise its flag"
        }
        W::WaitLoadTail => {
            n.w = if CAP - (s.w_head - s.tail) > 0 { W::WaitLower } else { W::FutexWait };
            "writer: load tail"
        }
        W::FutexWait => {
            // The kernel sleeps only while the flag still reads 1.
            n.w = if s.writer_sleeps { W::Asleep } else { W::WaitLower };
            n.futex_woken = false;
            "writer: futex wait"
        }
        W::Asleep => {
            if !s.futex_woken {
                return None;
            }
            n.futex_woken = false;
            n.w = W::WaitLower;
            "writer: woken"
        }
        W::WaitLower => {
            n.writer_sleeps = false;
            n.w = W::Write;
            "writer: lower its flag"
        }
        W::Done => return None,
    };
    Some((n, what))
}

fn reader_step(s: &State, total: u8, v: Variant) -> Option<(State, &'static str)> {
    let mut n = s.clone();
    let what = match s.r {
        R::Read => {
            if s.r_tail == total {
                n.r = R::Done;
            } else if s.head > s.r_tail {
                n.r_tail = s.head;
                n.r = R::ReleaseTail;
            } else {
                n.r = R::SleepRaise;
            }
            "reader: load head, read"
        }
        R::ReleaseTail => {
            n.tail = s.r_tail;
            n.r = R::ReleaseSwap;
            "reader: store tail"
        }
        R::ReleaseSwap => {
            n.writer_sleeps = false;
            n.r = if s.writer_sleeps { R::FutexWake } else { R::Read };
            "reader: swap the writer's flag"
        }
        R::FutexWake => {
            // Wakes a writer already asleep in the futex; nobody else.
            if s.w == W::Asleep {
                n.futex_woken = true;
            }
            n.r = R::Read;
            "reader: futex wake"
        }
        R::SleepRaise => {
            n.reader_sleeps = true;
            n.r = if v == Variant::ReaderSkipsRecheck { R::AwaitBell } else { R::SleepLoadHead };
            "reader: raise its flag"
        }
        R::SleepLoadHead => {
            n.r = if s.head > s.r_tail { R::SleepLower } else { R::AwaitBell };
            "reader: load head"
        }
        R::SleepLower => {
            n.reader_sleeps = false;
            n.r = R::Read;
            "reader: lower its flag"
        }
        R::AwaitBell => {
            if s.bells == 0 {
                return None;
            }
            // One read takes every bell rung so far.
            n.bells = 0;
            n.r = R::Read;
            "reader: doorbell"
        }
        R::Done => return None,
    };
    Some((n, what))
}

/// Explores every interleaving of a writer sending `total` bytes and a reader taking them,
/// breadth first; `Err` carries the shortest interleaving that leaves a side waiting for ever.
fn explore(total: u8, v: Variant) -> Result<usize, Vec<&'static str>> {
    let start = State {
        head: 0,
        tail: 0,
        reader_sleeps: false,
        writer_sleeps: false,
        bells: 0,
        futex_woken: false,
        w: W::Write,
        w_head: 0,
        w_saw_flag: false,
        r: R::Read,
        r_tail: 0,
    };
    let mut seen = HashSet::new();
    let mut queue = VecDeque::from([(start, Vec::new())]);
    while let Some((s, trace)) = queue.pop_front() {
        if !seen.insert(s.clone()) {
            continue;
        }
        let next = steps(&s, total, v);
        if next.is_empty() && (s.w != W::Done || s.r != R::Done) {
            return Err(trace);
        }
        // Every byte read is a byte written, in order, and the ring never holds more than CAP.
        assert!(s.r_tail <= s.head && s.head <= s.w_head && s.w_head - s.tail <= CAP, "{s:?}");
        for (n, what) in next {
            let mut t = trace.clone();
            t.push(what);
            queue.push_back((n, t));
        }
    }
    Ok(seen.len())
}

#[test]
fn no_interleaving_of_the_sleep_and_wake_flags_loses_a_wakeup() {
    // Up to three times the ring's capacity, so the writer waits for room as well.
    for total in 1..=3 * CAP {
        match explore(total, Variant::Real) {
            Ok(states) => assert!(states > 20, "{total} bytes: only {states} states explored"),
            Err(trace) => panic!("{total} bytes: a side waits for ever after {trace:#?}"),
        }
    }
}

#[test]
fn the_search_finds_the_lost_wakeups_of_broken_variants() {
    for broken in [Variant::ReaderSkipsRecheck, Variant::WriterSwapsBeforeHead] {
        let trace = explore(3, broken).expect_err("a lost wake-up was not found");
        assert!(!trace.is_empty(), "{broken:?}");
    }
}
