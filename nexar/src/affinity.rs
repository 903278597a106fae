//! Binding rank processes to cores, as `mpirun` does by default.
//!
//! Ranks that wait for messages spin for a while before they park (see
//! [`NexarConfig::spin`](crate::NexarConfig::spin)). That pays only while each rank has a core
//! of its own. On a busy host the kernel's wake-up placement tends to put two ranks that wake
//! each other on the same core (the waker's), and from then on each spinner holds the core that
//! the peer needs to send its reply: every step costs a whole spin window (the "2 ms mode",
//! `bench/busy.sh`). Binding each rank on a host to its own core, the default of Open MPI's
//! `mpirun` for small jobs, makes that placement impossible.
//!
//! The core is chosen among those this process may use ([`allowed_cpus`]), so a binding made by
//! a scheduler (SLURM's `--cpu-bind`, a cgroup cpuset, `taskset`) is respected.
//!
//! ```no_run
//! // Local rank 1 of 2 ranks on this host: bind the thread that drives the rank to one core.
//! match nexar::affinity::core_for(1, 2)? {
//!     Some(cpu) => nexar::affinity::bind_thread(cpu)?,
//!     None => println!("more ranks than cores here: not binding"),
//! }
//! # Ok::<(), nexar::affinity::AffinityError>(())
//! ```

use rustix::thread::{CpuSet, Pid, sched_getaffinity, sched_setaffinity};

/// Why a binding failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AffinityError {
    /// The kernel refused to report or change the CPU set.
    #[error("cannot {what}: {source}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// What the kernel said.
        source: std::io::Error,
    },
    /// A CPU asked for is not one this process may use.
    #[error("cpu {cpu} is not in this process's allowed set {allowed:?}")]
    NotAllowed {
        /// The CPU asked for.
        cpu: usize,
        /// The CPUs this process may use.
        allowed: Vec<usize>,
    },
}

fn os(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> AffinityError {
    move |e| AffinityError::Os { what, source: e.into() }
}

/// The CPUs the calling thread may run on, in increasing order.
///
/// ```
/// let cpus = nexar::affinity::allowed_cpus().unwrap();
/// assert!(!cpus.is_empty());
/// ```
pub fn allowed_cpus() -> Result<Vec<usize>, AffinityError> {
    let set = sched_getaffinity(None).map_err(os("read this process's CPU set"))?;
    Ok((0..CpuSet::MAX_CPU).filter(|c| set.is_set(*c)).collect())
}

/// The core for local rank `local_rank` of `local_world` ranks on this host: the
/// `local_rank`-th allowed CPU, or `None` when the host has fewer allowed CPUs than local ranks
/// (ranks that share cores must not be bound, or they could not spread out).
///
/// ```
/// let n = nexar::affinity::allowed_cpus().unwrap().len();
/// assert!(nexar::affinity::core_for(0, 1).unwrap().is_some());
/// assert_eq!(nexar::affinity::core_for(0, n + 1).unwrap(), None);
/// ```
pub fn core_for(local_rank: usize, local_world: usize) -> Result<Option<usize>, AffinityError> {
    let allowed = allowed_cpus()?;
    if local_world == 0 || local_world > allowed.len() || local_rank >= local_world {
        return Ok(None);
    }
    Ok(Some(allowed[local_rank]))
}

/// The cores of local rank `local_rank` of `local_world` ranks on this host: its share of the
/// allowed CPUs, `allowed / local_world` of them in one contiguous block (the `local_rank`-th),
/// so that the ranks of a host never share a core and each rank's compute threads (a
/// framework's pool) have the rest of its share. `None` when the host has fewer allowed CPUs
/// than local ranks. With as many ranks as CPUs this is [`core_for`]'s one core.
///
/// ```
/// let n = nexar::affinity::allowed_cpus().unwrap().len();
/// assert_eq!(nexar::affinity::cores_for(0, 1).unwrap().map(|c| c.len()), Some(n));
/// assert_eq!(nexar::affinity::cores_for(0, n + 1).unwrap(), None);
/// ```
pub fn cores_for(local_rank: usize, local_world: usize) -> Result<Option<Vec<usize>>, AffinityError> {
    let allowed = allowed_cpus()?;
    if local_world == 0 || local_world > allowed.len() || local_rank >= local_world {
        return Ok(None);
    }
    let share = allowed.len() / local_world;
    Ok(Some(allowed[local_rank * share..(local_rank + 1) * share].to_vec()))
}

/// How many threads a rank's compute (a framework's thread pool: rayon, candle, burn) should
/// use: the CPUs the calling thread may run on, which after [`NexarClient::init`]'s binding
/// (`NEXAR_BIND=core`) is the rank's share of the host ([`cores_for`]); at least 1.
///
/// ```
/// assert!(nexar::affinity::compute_threads() >= 1);
/// ```
///
/// [`NexarClient::init`]: crate::NexarClient::init
pub fn compute_threads() -> usize {
    allowed_cpus().map_or(1, |c| c.len()).max(1)
}

/// Binds the calling thread (and the threads it starts later) to `cpu`, leaving the process's
/// other threads where they are: the thread that runs a rank's receives gets a core of its
/// own, while helper threads (the TCP lanes' readers and writers) still use every core, even
/// those started later from the bound thread.
///
/// ```no_run
/// nexar::affinity::bind_thread(0)?;
/// # Ok::<(), nexar::affinity::AffinityError>(())
/// ```
pub fn bind_thread(cpu: usize) -> Result<(), AffinityError> {
    bind_thread_to(&[cpu])
}

/// Binds the calling thread (and the threads it starts later) to `cpus`, as
/// [`bind_thread`] does to one.
///
/// ```no_run
/// if let Some(share) = nexar::affinity::cores_for(0, 2)? {
///     nexar::affinity::bind_thread_to(&share)?;
/// }
/// # Ok::<(), nexar::affinity::AffinityError>(())
/// ```
pub fn bind_thread_to(cpus: &[usize]) -> Result<(), AffinityError> {
    let allowed = allowed_cpus()?;
    if let Some(&cpu) = cpus.iter().find(|c| !allowed.contains(c)) {
        return Err(AffinityError::NotAllowed { cpu, allowed });
    }
    // What helper threads started from this thread later get back (see `free_helper_thread`).
    let before = sched_getaffinity(None).map_err(os("read this thread's CPU set"))?;
    HELPER_SET.get_or_init(|| before);
    let mut set = CpuSet::new();
    cpus.iter().for_each(|&c| set.set(c));
    sched_setaffinity(None, &set).map_err(os("bind this thread"))?;
    tracing::debug!(?cpus, "bound this thread");
    Ok(())
}

/// The CPU set the first thread bound with [`bind_thread`] had before: nexar's helper threads
/// (the TCP lanes' readers and writers, the shared-memory writer) keep it, whichever thread
/// starts them, so a bound rank's links still use every core.
static HELPER_SET: std::sync::OnceLock<CpuSet> = std::sync::OnceLock::new();

/// Gives the calling helper thread the CPUs the process had before a rank's thread was bound
/// (nothing to do where none was): a thread inherits its parent's set, and links are also
/// built later, from the bound thread, when the cluster grows or rebuilds.
pub(crate) fn free_helper_thread() {
    if let Some(set) = HELPER_SET.get()
        && let Err(e) = sched_setaffinity(None, set)
    {
        tracing::debug!(error = %e, "a helper thread keeps its parent's CPU set");
    }
}

/// How many CPUs nexar's helper threads may run on ([`free_helper_thread`]'s set, else this
/// thread's); at least 1.
pub(crate) fn helper_cpus() -> usize {
    let count = match HELPER_SET.get() {
        Some(set) => set.count() as usize,
        None => allowed_cpus().map(|c| c.len()).unwrap_or(1),
    };
    count.max(1)
}

/// Binds every thread of this process, and the threads it starts later, to `cpus`.
///
/// ```no_run
/// nexar::affinity::bind_process(&[0])?;
/// # Ok::<(), nexar::affinity::AffinityError>(())
/// ```
pub fn bind_process(cpus: &[usize]) -> Result<(), AffinityError> {
    let allowed = allowed_cpus()?;
    let mut set = CpuSet::new();
    for &cpu in cpus {
        if !allowed.contains(&cpu) {
            return Err(AffinityError::NotAllowed { cpu, allowed });
        }
        set.set(cpu);
    }
    // The calling thread first (threads it starts inherit its set), then every other thread
    // this process already has.
    sched_setaffinity(None, &set).map_err(os("bind this thread"))?;
    let tasks =
        std::fs::read_dir("/proc/self/task").map_err(|e| AffinityError::Os { what: "list threads", source: e })?;
    for task in tasks.flatten() {
        let tid = task.file_name().to_str().and_then(|t| t.parse::<i32>().ok()).and_then(Pid::from_raw);
        if let Some(tid) = tid {
            // A thread that ended meanwhile is no error.
            match sched_setaffinity(Some(tid), &set) {
                Ok(()) | Err(rustix::io::Errno::SRCH) => {}
                Err(e) => return Err(os("bind a thread")(e)),
            }
        }
    }
    tracing::debug!(?cpus, "bound this process");
    Ok(())
}

/// Moves the calling thread off the CPU it runs on, then gives it back its whole CPU set (so it
/// stays where the kernel put it until the kernel moves it again). `false` when the thread may
/// use only one CPU or the kernel refused.
///
/// This is how a rank that finds itself sharing a core with the peer it waits for (every spin
/// expires, see `comm::spin`) breaks the placement the kernel's wake-ups keep choosing.
pub(crate) fn hop_off_current_cpu() -> bool {
    let Ok(allowed) = sched_getaffinity(None) else { return false };
    let current = rustix::thread::sched_getcpu();
    if allowed.count() < 2 || !allowed.is_set(current) {
        return false;
    }
    let mut elsewhere = allowed;
    elsewhere.unset(current);
    // Changing the set migrates the thread before the call returns.
    let moved = sched_setaffinity(None, &elsewhere).is_ok();
    let restored = sched_setaffinity(None, &allowed).is_ok();
    tracing::debug!(from = current, to = rustix::thread::sched_getcpu(), moved, restored, "hopped off a shared core");
    moved && restored
}

/// Whether the calling thread may run on more than one CPU (it is not bound to a core). `false`
/// where the kernel does not say.
pub(crate) fn thread_unbound() -> bool {
    sched_getaffinity(None).is_ok_and(|allowed| allowed.count() > 1)
}

/// The thread ids of process `pid`, from `/proc/<pid>/task`; empty where that cannot be read
/// (the process is gone, or belongs to another user).
pub(crate) fn thread_ids(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks.filter_map(|task| task.ok()?.file_name().to_str()?.parse().ok()).collect()
}

/// Whether thread `tid` of process `pid` is runnable (running or waiting for a CPU) on `cpu`,
/// from `/proc/<pid>/task/<tid>/stat`; `false` where that cannot be read.
///
/// A rank whose spin runs long asks this of the ranks it shares a host with
/// (`comm/exec/host_peers.rs`): one of them waiting behind it on its very core is the peer it spins
/// for.
pub(crate) fn thread_runnable_on(pid: u32, tid: u32, cpu: usize) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).is_ok_and(|stat| stat_runnable_on(&stat, cpu))
}

/// Whether a task's `stat` line says it is runnable on `cpu`: its state (the first field after
/// the parenthesised command, which may hold spaces and parentheses) is `R`, and its
/// `processor` (the 39th field) is `cpu`.
fn stat_runnable_on(stat: &str, cpu: usize) -> bool {
    let Some((_, after)) = stat.rsplit_once(')') else { return false };
    let mut fields = after.split_ascii_whitespace();
    fields.next() == Some("R") && fields.nth(35).and_then(|c| c.parse::<usize>().ok()) == Some(cpu)
}

/// Whether process `pid` of this kernel still runs: `false` once it has exited (no entry in
/// `/proc`, or a zombie waiting for its parent), `true` otherwise.
pub(crate) fn process_running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold any byte.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

/// The share of the last ten seconds in which some runnable task on this host waited for a
/// CPU (`/proc/pressure/cpu`, "some avg10", 0–100), or `None` where the kernel does not keep
/// pressure stall information. The failure detector reads it: a silence from a rank of this
/// host while the host's CPUs were this contended is no evidence that the rank died.
pub(crate) fn cpu_pressure() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/pressure/cpu").ok()?;
    parse_cpu_pressure(&text)
}

fn parse_cpu_pressure(text: &str) -> Option<f64> {
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace().find_map(|f| f.strip_prefix("avg10=")).and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_pressure_is_read_from_the_some_line() {
        let text = "some avg10=17.27 avg60=64.25 avg300=50.45 total=3751239494\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_cpu_pressure(text), Some(17.27));
        assert_eq!(parse_cpu_pressure("full avg10=1.00"), None);
        assert_eq!(parse_cpu_pressure(""), None);
        assert!(process_running(std::process::id()));
        assert!(!process_running(u32::MAX - 7));
    }

    #[test]
    fn a_busy_thread_is_found_runnable_on_its_cpu_and_nowhere_else() {
        let line = |state: &str, cpu: usize| {
            let mut fields = vec!["0"; 36];
            fields[35] = "x";
            let rest = fields.join(" ").replace(" x", &format!(" {cpu}"));
            format!("42 (a (weird) name) {state} {rest} 0 0")
        };
        assert!(stat_runnable_on(&line("R", 3), 3));
        assert!(!stat_runnable_on(&line("R", 3), 2));
        assert!(!stat_runnable_on(&line("S", 3), 3));
        assert!(!stat_runnable_on("garbage", 0));
        // A thread of this process, busy on one CPU, is found there.
        let cpu = *allowed_cpus().unwrap().last().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let busy = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut set = CpuSet::new();
                set.set(cpu);
                sched_setaffinity(None, &set).unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        let me = std::process::id();
        let found = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            thread_ids(me).into_iter().any(|tid| thread_runnable_on(me, tid, cpu))
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        busy.join().unwrap();
        assert!(found, "a thread spinning on cpu {cpu} was never seen runnable there");
        assert!(thread_ids(u32::MAX).is_empty(), "a process that does not exist");
        assert!(!thread_runnable_on(u32::MAX, u32::MAX, cpu));
    }

    #[test]
    fn binds_and_unbinds_within_the_allowed_set() {
        let allowed = allowed_cpus().unwrap();
        let last = *allowed.last().unwrap();
        // A thread of its own, so other tests keep the whole set.
        std::thread::spawn(move || {
            let mut set = CpuSet::new();
            set.set(last);
            sched_setaffinity(None, &set).unwrap();
            assert_eq!(allowed_cpus().unwrap(), vec![last]);
            assert_eq!(core_for(0, 1).unwrap(), Some(last));
            assert_eq!(core_for(0, 2).unwrap(), None);
            assert_eq!(core_for(1, 1).unwrap(), None);
            assert_eq!(cores_for(0, 1).unwrap(), Some(vec![last]));
            assert_eq!(compute_threads(), 1);
        })
        .join()
        .unwrap();
        let outside = allowed.last().unwrap() + 1;
        assert!(matches!(bind_process(&[outside]), Err(AffinityError::NotAllowed { cpu, .. }) if cpu == outside));
    }

    #[test]
    fn each_local_rank_gets_a_disjoint_share_of_the_cores() {
        let allowed = allowed_cpus().unwrap();
        let n = allowed.len();
        for world in 1..=n {
            let shares: Vec<Vec<usize>> = (0..world).map(|r| cores_for(r, world).unwrap().unwrap()).collect();
            assert!(shares.iter().all(|s| s.len() == n / world), "{world} ranks on {n} cpus: {shares:?}");
            let mut all = shares.concat();
            all.sort();
            all.dedup();
            assert_eq!(all.len(), (n / world) * world, "shares overlap: {shares:?}");
        }
        assert_eq!(cores_for(0, n + 1).unwrap(), None);
        std::thread::spawn(move || {
            bind_thread_to(&allowed).unwrap();
            assert_eq!(compute_threads(), n);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_helper_thread_started_from_a_bound_thread_gets_every_cpu_back() {
        let whole = allowed_cpus().unwrap();
        std::thread::spawn(move || {
            bind_thread(whole[0]).unwrap();
            assert_eq!(allowed_cpus().unwrap(), vec![whole[0]]);
            // A plain thread inherits the binding; a helper gives it up.
            let inherited = std::thread::spawn(|| allowed_cpus().unwrap()).join().unwrap();
            assert_eq!(inherited, vec![whole[0]]);
            let helper = std::thread::spawn(|| {
                free_helper_thread();
                allowed_cpus().unwrap()
            })
            .join()
            .unwrap();
            assert_eq!(helper, whole);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_hop_leaves_the_current_cpu_and_keeps_the_whole_set() {
        std::thread::spawn(|| {
            let before = allowed_cpus().unwrap();
            let from = rustix::thread::sched_getcpu();
            let hopped = hop_off_current_cpu();
            assert_eq!(allowed_cpus().unwrap(), before);
            if before.len() >= 2 {
                assert!(hopped);
                assert_ne!(rustix::thread::sched_getcpu(), from);
            } else {
                assert!(!hopped, "one allowed CPU: nowhere to hop");
            }
        })
        .join()
        .unwrap();
    }
}
