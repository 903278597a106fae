//! The ranks that share this host's cores, and whether a thread of one of them waits behind
//! this thread on its very core (the spin loop's question, see [`crate::comm::exec::spin`]).
//!
//! `/proc` answers it, at a price: on the 2-core CI-type machine reading one thread's `stat`
//! costs about 10 µs (the kernel formats some fifty fields) and listing a process's threads
//! about 7 µs, so reading every thread of a peer took 56 µs for a process of 5 threads and
//! 0.7 ms for one of 65, as a training process with its thread pools has. A look part-way
//! through a spin paid that on every long wait. So each peer's thread ids are kept between
//! looks, the thread last found waiting is read first, and a look reads at most a given number
//! of the others, going on where the previous look stopped.

use std::sync::Mutex;

/// Threads a look part-way through a spin reads of each peer, besides the one last found
/// waiting (read first, and the look stops at the first found): every thread of a rank
/// process of nexar's own (a runtime thread, lane threads, a few of tokio's), a bounded part
/// of a process with large thread pools. Reading only one measured worse under a niced
/// memory-bound load (4 KiB allreduce p50 20 µs against 11–15, p99 4.1 ms in three runs of
/// three): the thread that waits is not always the one found before.
pub(crate) const GLANCE_READS: usize = 8;
/// Threads a look at the end of a spin window reads of each peer, besides the one last found
/// waiting (after a window of up to 1 ms; the list of threads is read afresh first).
pub(crate) const THOROUGH_READS: usize = 16;

/// The ranks that share this host's cores, by process.
#[derive(Debug, Default)]
pub(crate) struct HostPeers {
    peers: Mutex<Vec<HostPeer>>,
}

/// A rank that shares this host's cores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostPeer {
    pub(crate) pid: u32,
    /// Whether its messages come through shared memory (else over TCP or QUIC).
    pub(crate) shared_memory: bool,
    /// Its thread ids, as last listed.
    threads: Vec<u32>,
    /// Where the next look starts in `threads`.
    next: usize,
    /// The thread last found waiting on this thread's core.
    last_waiting: Option<u32>,
}

impl HostPeer {
    fn new(pid: u32, shared_memory: bool) -> HostPeer {
        HostPeer { pid, shared_memory, threads: Vec::new(), next: 0, last_waiting: None }
    }

    /// The threads a look reads: the one last found waiting, then up to `reads` others from
    /// where the previous look stopped (advancing that place).
    fn next_to_read(&mut self, reads: usize) -> Vec<u32> {
        let mut out: Vec<u32> = self.last_waiting.into_iter().collect();
        let others = self.threads.len().min(reads);
        for i in 0..others {
            let tid = self.threads[(self.next + i) % self.threads.len()];
            if Some(tid) != self.last_waiting {
                out.push(tid);
            }
        }
        if !self.threads.is_empty() {
            self.next = (self.next + others) % self.threads.len();
        }
        out
    }
}

impl HostPeers {
    /// Notes that the rank in process `pid` shares this host's cores, and whether a
    /// shared-memory link to it is up (`shared_memory`; once up, it stays noted). Ranks of this
    /// very process are left out: this thread is always runnable on its own core.
    pub(crate) fn add(&self, pid: u32, shared_memory: bool) {
        if pid == std::process::id() {
            return;
        }
        let mut peers = crate::sync::lock(&self.peers);
        match peers.iter_mut().find(|p| p.pid == pid) {
            Some(peer) => peer.shared_memory |= shared_memory,
            None => peers.push(HostPeer::new(pid, shared_memory)),
        }
    }

    /// Whether a peer that `which` picks is noted.
    pub(crate) fn any(&self, which: impl Fn(&HostPeer) -> bool) -> bool {
        crate::sync::lock(&self.peers).iter().any(which)
    }

    /// Whether a thread of a peer that `which` picks is runnable on `cpu`, reading at most
    /// `reads` threads of each besides the one last found waiting; `relist` reads each peer's
    /// list of threads afresh (a look with no list yet reads it anyway).
    pub(crate) fn one_waits_on(
        &self,
        cpu: usize,
        which: impl Fn(&HostPeer) -> bool,
        reads: usize,
        relist: bool,
    ) -> bool {
        // The reads happen outside the lock: other threads of this rank may look meanwhile.
        let chosen: Vec<(u32, bool)> = crate::sync::lock(&self.peers)
            .iter()
            .filter(|p| which(p))
            .map(|p| (p.pid, relist || p.threads.is_empty()))
            .collect();
        for (pid, list) in chosen {
            let threads = list.then(|| crate::affinity::thread_ids(pid));
            let reads_now = {
                let mut peers = crate::sync::lock(&self.peers);
                let Some(peer) = peers.iter_mut().find(|p| p.pid == pid) else { continue };
                if let Some(threads) = threads {
                    peer.threads = threads;
                    peer.next %= peer.threads.len().max(1);
                }
                peer.next_to_read(reads)
            };
            let waiting = reads_now.into_iter().find(|tid| crate::affinity::thread_runnable_on(pid, *tid, cpu));
            if let Some(peer) = crate::sync::lock(&self.peers).iter_mut().find(|p| p.pid == pid) {
                peer.last_waiting = waiting.or(peer.last_waiting);
            }
            if waiting.is_some() {
                return true;
            }
        }
        false
    }

    /// The peers noted, for tests.
    #[cfg(test)]
    pub(crate) fn noted(&self) -> Vec<(u32, bool)> {
        crate::sync::lock(&self.peers).iter().map(|p| (p.pid, p.shared_memory)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_of_this_host_are_noted_once_with_their_transport_and_this_process_never() {
        let peers = HostPeers::default();
        peers.add(std::process::id(), false);
        assert!(peers.noted().is_empty(), "this process was noted as a peer");
        // From the host table first (over the network), then its shared-memory link came up.
        peers.add(u32::MAX - 1, false);
        peers.add(u32::MAX - 1, true);
        // A shared-memory link, then the host table: the link is not forgotten.
        peers.add(u32::MAX - 2, true);
        peers.add(u32::MAX - 2, false);
        peers.add(u32::MAX - 3, false);
        assert_eq!(peers.noted(), vec![(u32::MAX - 1, true), (u32::MAX - 2, true), (u32::MAX - 3, false)]);
        // No such processes: no thread of theirs waits anywhere.
        assert!(!peers.one_waits_on(0, |_| true, THOROUGH_READS, true));
        assert!(!peers.one_waits_on(0, |p| !p.shared_memory, GLANCE_READS, false));
    }

    #[test]
    fn looks_read_a_bounded_number_of_threads_the_last_found_first_and_cover_them_all_in_turn() {
        let mut peer = HostPeer::new(1, false);
        peer.threads = (10..17).collect();
        let mut seen = Vec::new();
        for _ in 0..7 {
            let look = peer.next_to_read(1);
            assert_eq!(look.len(), 1, "a look of one read reads one thread");
            seen.extend(look);
        }
        seen.sort_unstable();
        assert_eq!(seen, (10..17).collect::<Vec<_>>(), "seven such looks read each of seven threads once");
        peer.last_waiting = Some(13);
        let look = peer.next_to_read(2);
        assert_eq!(look[0], 13, "the thread last found waiting is read first");
        assert!(look.len() <= 3 && look.iter().filter(|t| **t == 13).count() == 1, "{look:?}");
        assert_eq!(peer.next_to_read(100).len(), 7, "a thorough look reads each thread once");
        assert_eq!(HostPeer::new(2, false).next_to_read(5), Vec::<u32>::new());
    }

    #[test]
    fn a_busy_thread_of_another_process_is_found_waiting_on_its_cpu_and_remembered() {
        use rustix::thread::{CpuSet, Pid, sched_setaffinity};
        let cpu = *crate::affinity::allowed_cpus().unwrap().last().unwrap();
        /// The busy process, killed however the test ends.
        struct Busy(std::process::Child);
        impl Drop for Busy {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let child = Busy(std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap());
        let mut set = CpuSet::new();
        set.set(cpu);
        sched_setaffinity(Pid::from_raw(child.0.id() as i32), &set).unwrap();
        let peers = HostPeers::default();
        peers.add(child.0.id(), false);
        let found = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            peers.one_waits_on(cpu, |_| true, THOROUGH_READS, true)
        });
        let remembered = found && peers.one_waits_on(cpu, |_| true, 0, false);
        drop(child);
        assert!(found, "a process spinning on cpu {cpu} was never seen runnable there");
        assert!(remembered, "a glance reads the thread last found waiting first");
    }
}
