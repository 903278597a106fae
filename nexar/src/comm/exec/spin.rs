//! Spin-then-park: a receive that finds nothing polls for a bounded time before it registers a
//! waiter and lets its thread sleep, and the bound adapts to whether spinning pays.
//!
//! Spinning pays while the message is on its way and this rank has a core of its own: a thread
//! wake-up costs tens of microseconds (hundreds on some virtual machines), more than a small
//! message's flight. It hurts when the rank that must send the message waits for the very core
//! this rank spins on. That is what a busy host does to unbound ranks: the kernel places a
//! woken rank on its waker's core, and from then on every step of a collective waits out the
//! whole spin window before the spinner parks and the peer can run (each 4 KiB allreduce took
//! twice the window, 2 ms instead of 10 µs). [`SpinGovernor`] sees that every window expires,
//! shrinks the window to nothing within a few steps, and probes a full window again at growing
//! intervals, so a rank that gets a core of its own back spins again. A spin that runs out
//! while a rank of this host waits on its very core moves its thread off that core first (the
//! governor alone did not end the mode: spins that found their message restored the window),
//! and an unbound thread whose peer on this host talks to it over TCP looks for that 50 µs into
//! the spin already. The ranks of the host are known by their process ids: from `SO_PEERCRED`
//! where shared memory links them, else from the host table (`comm/membership/hosts.rs`). Binding ranks to
//! cores ([`crate::affinity`]) prevents the placement in the first place.
//!
//! Where the host runs more ranks than it has cores, a spin that held its core would keep the
//! very rank it waits for from running, and a rank that parks pays a wake-up per message
//! (on a virtual machine, a halted virtual CPU to wake): four ranks on two cores took ~120 µs
//! per barrier. There a governor *yields*: between polls its thread offers the core to
//! whatever else is runnable on it (`sched_yield`, as MPI's `mpi_yield_when_idle` does), so
//! the sender runs at once, and the receive still sees its message without a wake-up. A
//! yielding spin's window is longer ([`YIELDING_SPIN`]), losing the core on the way is what it
//! is for (it is not counted against spinning), and it never moves its thread to another core.
//! A yielding spin keeps yielding when other work (a niced background job) holds the cores
//! too: parking instead, after a yield that was away long, measured slower at every size and
//! rank count tried (see [`YIELDING_SPIN`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::comm::exec::host_peers::{GLANCE_READS, HostPeer, HostPeers, THOROUGH_READS};
use crate::comm::matcher::{Held, Key, Mailbox, Refusal};
use crate::transport::bulk::{Awaited, Awaiting};

/// A window this short is not worth a poll: below it the governor stops spinning.
const MIN_WINDOW_NS: u64 = 4_000;
/// Waits between two full-window probes while spinning is off; doubled after each probe that
/// expires, up to [`MAX_PROBE_GAP`].
const FIRST_PROBE_GAP: u64 = 64;
/// The longest gap between probes: a co-located rank pays one window per this many waits.
const MAX_PROBE_GAP: u64 = 8_192;
/// The adaptive spin window of one client: the configured window while messages arrive within
/// it, halved each time a window expires empty, and restored by the first spin that finds its
/// message. Shared by every receive of the client; races between them only blur the estimate.
#[derive(Debug)]
pub(crate) struct SpinGovernor {
    /// The configured window, in nanoseconds (0: never spin).
    max_ns: u64,
    /// The window the next wait spins for.
    window_ns: AtomicU64,
    /// Waits so far (for the probe schedule).
    waits: AtomicU64,
    /// The wait at which spinning is next probed while the window is zero.
    next_probe: AtomicU64,
    /// The current gap between probes.
    probe_gap: AtomicU64,
    /// The processes of the ranks that share this host's cores (their pids: checked with
    /// `SO_PEERCRED` where a shared-memory link was set up, else as the host table gave them),
    /// each with whether a shared-memory link to it is up.
    same_host: HostPeers,
    /// Whether the thread offers its core to other runnable threads between polls (the host
    /// runs more ranks than it has cores).
    yields: bool,
}

/// How one spin ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Spun {
    /// The message came within the window.
    Found,
    /// The window passed without it.
    Expired,
}

impl SpinGovernor {
    /// A governor whose window never exceeds `max`. Where `yields`, the spinning thread offers
    /// its core to other runnable threads between polls.
    pub(crate) fn new(max: Duration, yields: bool) -> SpinGovernor {
        let max_ns = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        SpinGovernor {
            max_ns,
            window_ns: AtomicU64::new(max_ns),
            waits: AtomicU64::new(0),
            next_probe: AtomicU64::new(0),
            probe_gap: AtomicU64::new(FIRST_PROBE_GAP),
            same_host: HostPeers::default(),
            yields,
        }
    }

    /// Notes that the rank in process `pid` shares this host's cores, and whether a
    /// shared-memory link to it is up (`shared_memory`; once up, it stays noted). Ranks of this
    /// very process are left out: this thread is always runnable on its own core.
    pub(crate) fn add_same_host_peer(&self, pid: u32, shared_memory: bool) {
        self.same_host.add(pid, shared_memory);
    }

    /// After a spin ran out: if a rank of this host waits behind this thread on its very core
    /// (the kernel placed a woken peer on its waker's core, and a spinning thread keeps it
    /// there), moves this thread off that core, so that the peer runs and the two stop taking
    /// turns a window at a time. Only then: on two cores, leaving the core during a long
    /// transfer would put the thread on its busy peer's core.
    fn leave_core_if_a_peer_waits_on_it(&self) -> bool {
        self.leave_core_if_one_waits_on_it(|_| true, THOROUGH_READS, true)
    }

    /// [`leave_core_if_a_peer_waits_on_it`](Self::leave_core_if_a_peer_waits_on_it) for the
    /// peers `which` picks, reading at most `reads` threads of each (see
    /// [`HostPeers::one_waits_on`]).
    fn leave_core_if_one_waits_on_it(&self, which: impl Fn(&HostPeer) -> bool, reads: usize, relist: bool) -> bool {
        if self.yields() {
            // The peer gets this core at the next poll anyway.
            return false;
        }
        let cpu = rustix::thread::sched_getcpu();
        self.same_host.one_waits_on(cpu, which, reads, relist) && crate::affinity::hop_off_current_cpu()
    }

    /// Part-way through a spin: if this thread is not bound to a core (bound ranks each have
    /// their own) and a rank of this host that talks to this one over the network (TCP or
    /// QUIC) waits behind it on its core, moves this thread off that core.
    ///
    /// Ranks that talk through shared memory are left to the check at the end of the window:
    /// looking for them part-way measured worse (a 16 MiB allreduce between two unbound ranks
    /// fell from 3–4 to 1.7–2.5 GB/s, the spins of a long transfer leaving cores the peer's
    /// copies needed), and the end-of-window check already holds their latency.
    ///
    /// This look reads at most [`GLANCE_READS`] threads of each such peer besides the one last
    /// found waiting (about 10 µs each), not all of them: a peer process of 65 threads took
    /// 0.7 ms to read in full.
    fn leave_core_if_a_networked_peer_waits_on_it(&self) -> bool {
        let networked = |p: &HostPeer| !p.shared_memory;
        self.same_host.any(networked)
            && crate::affinity::thread_unbound()
            && self.leave_core_if_one_waits_on_it(networked, GLANCE_READS, false)
    }

    /// Whether spins offer the core to other threads between polls.
    pub(crate) fn yields(&self) -> bool {
        self.yields
    }

    /// The configured window.
    pub(crate) fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns)
    }

    /// How long the next wait spins.
    pub(crate) fn window(&self) -> Duration {
        let n = self.waits.fetch_add(1, Relaxed);
        let window = self.window_ns.load(Relaxed);
        if window == 0 && self.max_ns > 0 && n >= self.next_probe.load(Relaxed) {
            // A probe. Spins expire when the sender waits for this very core, so leave it
            // first: the probe then tells whether spinning pays elsewhere (a yielding spin
            // lets the sender have the core instead).
            if !self.yields() {
                crate::affinity::hop_off_current_cpu();
            }
            return Duration::from_nanos(self.max_ns);
        }
        Duration::from_nanos(window)
    }

    /// Records how a wait's spin of `window` ended.
    pub(crate) fn record(&self, window: Duration, spun: Spun) {
        if window.is_zero() {
            return;
        }
        match spun {
            Spun::Found => {
                self.window_ns.store(self.max_ns, Relaxed);
                self.probe_gap.store(FIRST_PROBE_GAP, Relaxed);
            }
            Spun::Expired => {
                let half = self.window_ns.load(Relaxed) / 2;
                if half >= MIN_WINDOW_NS {
                    self.window_ns.store(half, Relaxed);
                    return;
                }
                if self.window_ns.swap(0, Relaxed) != 0 {
                    tracing::debug!(max = ?self.max(), "receive spin: windows keep expiring, parking at once");
                    // Probe at once (from another core), then at growing intervals.
                    self.next_probe.store(self.waits.load(Relaxed), Relaxed);
                    return;
                }
                // A probe that expired: wait longer before the next one.
                self.probe_later();
            }
        }
    }

    /// Schedules the next probe the current gap from now, and doubles the gap.
    fn probe_later(&self) {
        let gap = self.probe_gap.load(Relaxed);
        self.next_probe.store((self.waits.load(Relaxed) + gap).saturating_sub(1), Relaxed);
        self.probe_gap.store((gap * 2).min(MAX_PROBE_GAP), Relaxed);
    }
}

/// The spin window where ranks share cores and spins yield between polls: long enough that a
/// wait for a peer which must first get the core (behind one or two others on it) still ends
/// in the spin. Measured with four ranks on two cores (`nexar-bench --np 4`): a 1 ms window
/// kept expiring and the governor turned spinning off (a 4 KiB allreduce 94 µs); 10 ms held it
/// (40 µs); 50 ms was no better.
///
/// A yielding spin keeps yielding under a background job. It once parked after a yield that
/// kept it away for 500 µs while more threads were runnable than ranks (kernel 5.x, 4 ranks on
/// 2 cores with two niced busy loops: 15.7 ms per 1 MiB allreduce yielding, 1.4 ms parking).
/// Measured again on kernel 6.18 (EEVDF) on 2 cores, 2026-12-02, that rule lost everywhere:
/// `nexar-bench --np 4` under two niced busy loops 1 MiB 0.55–0.81 ms without it against
/// 1.52–1.56 ms with it; `bench/scale.py`'s 4 KiB allreduce p50, quiet, 0.6 against 1.5–2.1 ms
/// at 16 ranks, 5.2–5.6 against 9.0–11.6 ms at 64, 21 against 29 ms at 128; under the busy
/// loops 40 against 155 µs at 4 ranks, 5.2–6.4 against 8.9–11.3 ms at 64. At many ranks a core
/// the rule fired with no background job at all: a rank's turn comes round only after every
/// other rank on the core has had its own.
pub(crate) const YIELDING_SPIN: Duration = Duration::from_millis(10);

/// A gap this long between two polls means this thread lost its core meanwhile: whatever the
/// spin found then, another thread (perhaps the sender) had to run first.
const PREEMPTED: Duration = Duration::from_micros(100);

/// How long an unbound thread spins without its message before it looks whether a rank of
/// this host waits behind it on its very core (once a spin; see
/// [`SpinGovernor::leave_core_if_a_peer_waits_on_it`]). Found there, the peer would otherwise
/// wait out the whole window: the kernel does not preempt a running thread of normal priority
/// for a woken one before its tick.
const LOOK_FOR_PEER_AFTER: Duration = Duration::from_micros(50);

/// Polls `mailbox` for `key` for up to the governor's window, yielding between polls so this
/// runtime keeps driving its I/O (the message we wait for arrives through it). Between polls
/// that find nothing, `read_link` may deliver what the sender's link holds ready (a channel
/// read on this task; `Some(hold)` if it read the link itself, see
/// [`BulkChannel::deliver_ready`](crate::transport::bulk::BulkChannel::deliver_ready)), or
/// hand the `awaited` message itself to this receive, which then never enters the mailbox
/// unless an older message of its key is there.
/// `Ok(None)` when nothing came. `spin` is `None` where spinning is not worth a core at all.
pub(in crate::comm) async fn spin_take(
    mailbox: &Mailbox,
    key: Key,
    spin: Option<&SpinGovernor>,
    awaited: Option<Awaited>,
    mut into: Option<&mut [u8]>,
    read_link: impl Fn(Option<Awaiting<'_>>) -> Option<Duration>,
) -> Result<Option<Held>, Refusal> {
    match spin {
        Some(governor) => {
            spin_poll_reading(governor, |read_itself| {
                if let Some(held) = mailbox.try_take(key)? {
                    return Ok(Some(held));
                }
                let mut handed = None;
                // Called by the channel under its read lock: nothing it read later can be in
                // the mailbox before this message is (see `Awaiting::hand`).
                let mut take = |incoming| handed = mailbox.handed(key, incoming);
                let ours = || mailbox.next_is_for_spinner(key);
                let awaiting = awaited.map(|awaited| Awaiting::new(awaited, &mut take));
                let hold = read_link(match (awaiting, into.as_deref_mut()) {
                    (Some(awaiting), Some(into)) => Some(awaiting.with_destination(into, &ours)),
                    (awaiting, _) => awaiting,
                });
                *read_itself = hold;
                match handed {
                    Some(held) => Ok(Some(held)),
                    None if hold.is_some() => mailbox.try_take(key),
                    None => Ok(None),
                }
            })
            .await
        }
        None => Ok(None),
    }
}

/// Calls `poll` until it yields a value, fails, or the governor's window passes (`Ok(None)`),
/// yielding to the runtime between calls. A spin counts as paying only if it found its value
/// without losing the core on the way; one that found it only after the thread was preempted
/// (as when the sender shares this core) counts as expired, unless the governor yields, when
/// giving the core away is the point.
pub(crate) async fn spin_poll<T, E>(
    governor: &SpinGovernor,
    mut poll: impl FnMut() -> Result<Option<T>, E>,
) -> Result<Option<T>, E> {
    spin_poll_reading(governor, |_| poll()).await
}

/// [`spin_poll`] for a `poll` that may read its message's link itself, and says so through
/// its argument, with how long the spin may then keep the thread: while it does, the spin
/// hands the thread to the runtime only once that long has passed since it last did (a
/// runtime cycle is a system call, and the message will not come through the runtime),
/// otherwise after every poll.
pub(crate) async fn spin_poll_reading<T, E>(
    governor: &SpinGovernor,
    mut poll: impl FnMut(&mut Option<Duration>) -> Result<Option<T>, E>,
) -> Result<Option<T>, E> {
    let window = governor.window();
    if window.is_zero() {
        return Ok(None);
    }
    // The clock is read only after a poll that found nothing (one read per poll).
    let mut clock: Option<(Instant, Instant, Instant)> = None;
    let (mut preempted, mut polls, mut looked) = (false, 0u64, false);
    loop {
        let mut read_itself = None;
        if let Some(value) = poll(&mut read_itself)? {
            // Found at once, the spin says nothing about whether spinning pays.
            if polls > 0 {
                governor.record(window, if preempted { Spun::Expired } else { Spun::Found });
            }
            return Ok(Some(value));
        }
        let now = Instant::now();
        let (until, last, yielded) = clock.get_or_insert((now + window, now, now));
        let away = now.duration_since(*last);
        preempted |= !governor.yields() && away > PREEMPTED;
        *last = now;
        if now >= *until {
            governor.record(window, Spun::Expired);
            let _ = governor.leave_core_if_a_peer_waits_on_it();
            return Ok(None);
        }
        polls += 1;
        if !looked && now + window >= *until + LOOK_FOR_PEER_AFTER {
            looked = true;
            if governor.leave_core_if_a_networked_peer_waits_on_it() {
                // The peer runs now; the spin goes on from another core.
                *last = Instant::now();
            }
        }
        if governor.yields() {
            // Whatever else is runnable on this core (the sender, perhaps) runs now.
            std::thread::yield_now();
        }
        if read_itself.is_none_or(|hold| now.duration_since(*yielded) >= hold) {
            *yielded = now;
            tokio::task::yield_now().await;
        } else if !governor.yields() {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiring_windows_turn_spinning_off_and_probes_back_off() {
        let g = SpinGovernor::new(Duration::from_millis(1), false);
        let mut spun = Vec::new();
        for _ in 0..20 {
            let w = g.window();
            spun.push(w);
            g.record(w, Spun::Expired);
        }
        // 1 ms, 500 µs, ... down to under 4 µs: then off.
        assert_eq!(spun[0], Duration::from_millis(1));
        assert_eq!(spun[1], Duration::from_micros(500));
        let off = spun.iter().position(|w| w.is_zero()).expect("spinning never turned off");
        assert!(off <= 10, "{spun:?}");
        // Off: the next probe comes FIRST_PROBE_GAP waits later, then twice as far.
        let mut probes = Vec::new();
        for i in 0..1_000u64 {
            let w = g.window();
            if !w.is_zero() {
                assert_eq!(w, Duration::from_millis(1));
                probes.push(i);
            }
            g.record(w, Spun::Expired);
        }
        assert!(probes.len() >= 3, "{probes:?}");
        let gaps: Vec<u64> = probes.windows(2).map(|p| p[1] - p[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] == 2 * g[0]), "{gaps:?}");
    }

    #[test]
    fn one_spin_that_finds_its_message_restores_the_window() {
        let g = SpinGovernor::new(Duration::from_micros(800), false);
        for _ in 0..12 {
            let w = g.window();
            g.record(w, Spun::Expired);
        }
        // Wait for the probe, which succeeds.
        let probe = (0..200).map(|_| g.window()).find(|w| !w.is_zero()).expect("no probe");
        g.record(probe, Spun::Found);
        assert_eq!(g.window(), Duration::from_micros(800));
        // A zero window never changes anything.
        let never = SpinGovernor::new(Duration::ZERO, false);
        assert_eq!(never.window(), Duration::ZERO);
        never.record(Duration::ZERO, Spun::Expired);
        assert_eq!(never.window(), Duration::ZERO);
    }

    #[test]
    fn a_governor_with_no_live_peer_on_this_host_stays_on_its_core() {
        let g = SpinGovernor::new(Duration::from_millis(1), false);
        g.add_same_host_peer(u32::MAX - 1, false);
        g.add_same_host_peer(u32::MAX - 2, true);
        // No such processes: nothing waits on this core, so the thread stays where it is.
        assert!(!g.leave_core_if_a_peer_waits_on_it());
        assert!(!g.leave_core_if_a_networked_peer_waits_on_it());
    }

    #[test]
    fn a_yielding_governor_stays_on_its_core() {
        let g = SpinGovernor::new(YIELDING_SPIN, true);
        assert!(g.yields());
        // A yielding thread never hops off its core: the peer gets it at the next poll.
        g.add_same_host_peer(std::process::id(), true);
        assert!(!g.leave_core_if_a_peer_waits_on_it());
        assert_eq!(g.window(), YIELDING_SPIN);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_spin_that_reads_its_link_itself_still_lets_other_tasks_run() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let g = SpinGovernor::new(Duration::from_secs(5), false);
        let other_ran = Arc::new(AtomicBool::new(false));
        let flag = other_ran.clone();
        tokio::spawn(async move { flag.store(true, Relaxed) });
        let (mut polls, began) = (0u64, Instant::now());
        // Every poll says it read the link itself, so the spin yields only now and then; the
        // spawned task must still get its turn within the window.
        let found = spin_poll_reading(&g, |read_itself| {
            *read_itself = Some(Duration::from_micros(20));
            polls += 1;
            Ok::<_, ()>(other_ran.load(Relaxed).then_some(()))
        })
        .await;
        assert_eq!(found, Ok(Some(())));
        assert!(polls > 1, "{polls} polls");
        assert!(began.elapsed() < Duration::from_secs(5));
    }
}
