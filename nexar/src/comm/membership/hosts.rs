//! Which host each rank is on: learnt once when the cluster forms, by an all-gather of a key
//! of each rank's host identity (so every rank holds the same table), and read per
//! communicator to pick the two-level algorithms.

use std::sync::Arc;

use crate::proto::algo::hierarchical::HostLayout;
use crate::transport::shm::setup::host_identity;

use crate::comm::client::NexarClient;
use crate::comm::state::CommState;

impl NexarClient {
    /// Gathers every rank's host key; every rank of the world calls it once, at the same
    /// point, when the cluster forms. On failure the ranks that saw it keep no table, and
    /// their collectives stay on the flat algorithms (logged).
    pub(crate) async fn learn_hosts(&self) {
        let identity = host_identity(self.config().host_id.as_deref());
        // Per rank: its host key, the key of the kernel and process namespace it runs in, and
        // its process id.
        let mine = [nexar_types::stable_hash(identity.as_bytes()), kernel_key(), u64::from(std::process::id())];
        let mut rows = vec![0u64; self.world_size() * mine.len()];
        // A communicator of its own: the world's sequence numbers start untouched.
        let id = nexar_types::stable_id(&["hosts", &self.comm.id.to_string()]).max(1);
        let gather = self.with_comm(CommState::new(id, self.comm.members.clone(), self.comm.me));
        match gather.all_gather(&mine[..], &mut rows[..]).await {
            Ok(()) => {
                let keys: Vec<u64> = rows.chunks_exact(mine.len()).map(|row| row[0]).collect();
                let layout = HostLayout::from_keys(&keys);
                tracing::debug!(rank = self.rank(), hosts = layout.hosts(), "host layout");
                let _ = self.inner.host_keys.set(keys);
                let pids = rows
                    .chunks_exact(mine.len())
                    .map(|row| match u32::try_from(row[2]) {
                        // This process's own id too: its in-process ranks are told apart
                        // from other processes by it (`probe.rs`).
                        Ok(pid) if row[1] == mine[1] => pid,
                        _ => 0,
                    })
                    .collect();
                let _ = self.inner.host_pids.set(pids);
                for (rank, row) in rows.chunks_exact(mine.len()).enumerate() {
                    if rank != self.rank()
                        && row[1] == mine[1]
                        && let Ok(pid) = u32::try_from(row[2])
                    {
                        // Ranks on this kernel may share a core with this one whatever carries
                        // their messages (shared memory, or TCP where that is off or between
                        // network namespaces): a spin that runs out looks whether one waits on
                        // its core.
                        self.inner.spin.add_same_host_peer(pid, false);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(rank = self.rank(), error = %e, "could not learn which hosts the ranks are on; collectives stay flat")
            }
        }
    }

    /// Which host each rank of this communicator is on, as learnt when the cluster formed;
    /// `None` where it is not known (a communicator with ranks that joined later). The
    /// collectives use the two-level algorithms when
    /// [`is_two_level`](HostLayout::is_two_level) says so.
    ///
    /// ```no_run
    /// # async fn run(comm: nexar::NexarClient) {
    /// if let Some(layout) = comm.host_layout() {
    ///     println!("{} ranks on {} hosts", layout.world(), layout.hosts());
    /// }
    /// # }
    /// ```
    pub fn host_layout(&self) -> Option<HostLayout> {
        self.layout().map(|l| (*l).clone())
    }

    /// [`host_layout`](Self::host_layout), made once per communicator.
    pub(crate) fn layout(&self) -> Option<Arc<HostLayout>> {
        self.layout_kept().cloned()
    }

    /// [`layout`](Self::layout) without taking a reference count (each collective asks).
    pub(crate) fn layout_ref(&self) -> Option<&HostLayout> {
        self.layout_kept().map(|layout| &**layout)
    }

    fn layout_kept(&self) -> Option<&Arc<HostLayout>> {
        // Not kept before the table is learnt (nothing would make it again).
        let keys = self.inner.host_keys.get()?;
        self.comm
            .layout
            .get_or_init(|| {
                let mine: Option<Vec<u64>> = self.comm.members.iter().map(|w| keys.get(*w).copied()).collect();
                mine.map(|keys| Arc::new(HostLayout::from_keys(&keys)))
            })
            .as_ref()
    }
}

/// A key of the kernel this process runs on and of its process namespace: ranks with the same
/// key see each other's threads in `/proc` under the process ids they report, and may share
/// cores. Unlike the host identity, a network namespace or a `NEXAR_HOST_ID` override does not
/// change it.
fn kernel_key() -> u64 {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let pid_ns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
    nexar_types::stable_hash(format!("boot:{} {pid_ns}", boot.trim()).as_bytes())
}
