//! Always-on diagnostics for a job that stalls or fails: the flight recorder, its dumps, the
//! stall inspector's report and `nexar trace`'s analysis of a directory of dumps.
//!
//! Every rank keeps its last operations (`NEXAR_TRACE_ENTRIES`, default 2,000) and writes
//! them as JSON into `NEXAR_TRACE_DIR` (default `$TMPDIR/nexar-trace`) when an operation times
//! out or fails because of a peer, on `SIGUSR1`, and on [`NexarClient::dump_trace`]. An
//! operation that has waited `NEXAR_STALL_WARN_MS` (default 30 s) for a peer asks the other
//! members where they are and logs who is missing and why; the same report is the text of
//! the timeout error.
//!
//! ```
//! let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_STALL_WARN_MS").then(|| "500".into())).unwrap();
//! assert_eq!(cfg.trace.stall_warn, std::time::Duration::from_millis(500));
//! ```
//!
//! [`NexarClient::dump_trace`]: crate::NexarClient::dump_trace

mod analyse;
mod dump;
mod last_seen;
pub(crate) mod recorder;
mod stall_report;
pub(crate) use stall_report::ranks as list_ranks;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

pub use analyse::{Divergence, OpSummary, TraceAnalysis, analyse};
pub use dump::{MAX_DUMP_BYTES, TraceDump, TraceEntry, TraceError};
pub(crate) use last_seen::LastSeen;
pub(crate) use recorder::{FlightRecorder, OpClass, OpDesc, OpTrace};
pub(crate) use stall_report::{Answer, Reply, StalledOp, stall_report};

pub use crate::config::TraceConfig;
use crate::sync::lock;

/// Automatic dumps of one rank are at most this frequent (a loop of failing calls does not
/// rewrite the file thousands of times).
const AUTO_DUMP_EVERY: Duration = Duration::from_secs(1);

/// One rank's recorder, with what names its dumps and where they go.
pub(crate) struct RankTrace {
    pub recorder: FlightRecorder,
    /// What each peer was last seen calling, for the stall inspector's reports.
    pub seen: LastSeen,
    pub rank: usize,
    world: usize,
    cluster: String,
    dir: Option<PathBuf>,
    last_auto_dump: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for RankTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankTrace").field("rank", &self.rank).field("cluster", &self.cluster).finish()
    }
}

/// Every live rank's recorder in this process, for `SIGUSR1`.
static RANKS: Mutex<Vec<Weak<RankTrace>>> = Mutex::new(Vec::new());

impl RankTrace {
    /// A recorder for `rank` of the cluster named `cluster`, dumped on `SIGUSR1` when the
    /// configuration says so.
    pub fn new(cfg: &TraceConfig, rank: usize, world: usize, cluster: String) -> Arc<Self> {
        let trace = Arc::new(RankTrace {
            recorder: FlightRecorder::new(cfg.entries, rank),
            seen: LastSeen::default(),
            rank,
            world,
            cluster,
            dir: cfg.dir.clone(),
            last_auto_dump: Mutex::new(None),
        });
        if cfg.on_signal {
            let mut ranks = lock(&RANKS);
            ranks.retain(|r| r.strong_count() > 0);
            ranks.push(Arc::downgrade(&trace));
            drop(ranks);
            listen_for_sigusr1();
        }
        trace
    }

    /// The recorder's content in the dump format.
    pub fn snapshot(&self, reason: &str) -> TraceDump {
        self.recorder.snapshot(self.rank, self.world, &self.cluster, reason)
    }

    /// Writes the dump into the configured directory.
    pub fn dump(&self, reason: &str) -> Result<PathBuf, TraceError> {
        let dir = self.dir.as_deref().ok_or(TraceError::NoDirectory { rank: self.rank })?;
        self.dump_into(dir, reason)
    }

    fn dump_into(&self, dir: &Path, reason: &str) -> Result<PathBuf, TraceError> {
        self.snapshot(reason).write_to(dir)
    }

    /// Dumps after an operation failed with `error`, at most once a second, off the async
    /// threads. The path is logged.
    pub fn dump_after_failure(self: &Arc<Self>, error: &str) {
        if self.dir.is_none() {
            return;
        }
        {
            let mut last = lock(&self.last_auto_dump);
            if last.is_some_and(|t| t.elapsed() < AUTO_DUMP_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let snapshot = self.snapshot(error);
        let (dir, rank) = (self.dir.clone(), self.rank);
        let write = move || {
            let Some(dir) = dir else { return };
            match snapshot.write_to(&dir) {
                Ok(path) => tracing::warn!(rank, path = %path.display(), "flight recorder dumped after a failure"),
                Err(e) => tracing::warn!(rank, error = %e, "could not dump the flight recorder"),
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(write)),
            Err(_) => write(),
        }
    }
}

/// Starts, once per process, a thread that dumps every live rank's recorder on `SIGUSR1`.
fn listen_for_sigusr1() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("nexar-sigusr1".into()).spawn(|| {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return tracing::warn!(error = %e, "no SIGUSR1 dumps: could not start the signal thread"),
            };
            rt.block_on(async {
                let kind = tokio::signal::unix::SignalKind::user_defined1();
                let mut signals = match tokio::signal::unix::signal(kind) {
                    Ok(s) => s,
                    Err(e) => return tracing::warn!(error = %e, "no SIGUSR1 dumps: could not listen for it"),
                };
                while signals.recv().await.is_some() {
                    let ranks: Vec<Arc<RankTrace>> = lock(&RANKS).iter().filter_map(Weak::upgrade).collect();
                    for rank in ranks {
                        match rank.dump("SIGUSR1") {
                            Ok(path) => tracing::warn!(rank = rank.rank, path = %path.display(), "SIGUSR1: flight recorder dumped"),
                            Err(e) => tracing::warn!(rank = rank.rank, error = %e, "SIGUSR1: could not dump"),
                        }
                    }
                }
            })
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no SIGUSR1 dumps: could not start the signal thread");
        }
    });
}
