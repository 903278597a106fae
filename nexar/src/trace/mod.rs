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
pub(crate) mod recorder;
mod stall_report;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

pub use analyse::{Divergence, OpSummary, TraceAnalysis, analyse};
pub use dump::{MAX_DUMP_BYTES, TraceDump, TraceEntry, TraceError};
pub(crate) use recorder::{FlightRecorder, OpClass, OpDesc, OpTrace};
pub(crate) use stall_report::{Answer, Reply, StalledOp, stall_report};

use crate::config::{ConfigError, invalid, parse};
use crate::sync::lock;

/// Automatic dumps of one rank are at most this frequent (a loop of failing calls does not
/// rewrite the file thousands of times).
const AUTO_DUMP_EVERY: Duration = Duration::from_secs(1);

/// Settings of the flight recorder and the stall inspector.
///
/// ```
/// let trace = nexar::trace::TraceConfig::default();
/// assert_eq!(trace.entries, 2000);
/// assert_eq!(trace.stall_warn, std::time::Duration::from_secs(30));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceConfig {
    /// Finished operations each rank keeps (`NEXAR_TRACE_ENTRIES`, default 2,000; 0 keeps
    /// none, though the stall inspector still knows what is in flight).
    pub entries: usize,
    /// Where dumps go (`NEXAR_TRACE_DIR`, default `$TMPDIR/nexar-trace`; `off` writes none).
    pub dir: Option<PathBuf>,
    /// How long an operation waits for a peer before the stall inspector reports
    /// (`NEXAR_STALL_WARN_MS`, default 30 s). Keep it well below `NEXAR_OP_TIMEOUT_MS`.
    pub stall_warn: Duration,
    /// Whether `SIGUSR1` dumps every rank of the process (`NEXAR_TRACE_SIGNAL`, `on` by
    /// default; `off` leaves the signal to the program).
    pub on_signal: bool,
}

impl Default for TraceConfig {
    fn default() -> Self {
        TraceConfig {
            entries: 2000,
            dir: Some(std::env::temp_dir().join("nexar-trace")),
            stall_warn: Duration::from_secs(30),
            on_signal: true,
        }
    }
}

impl TraceConfig {
    /// Defaults, overridden by the `NEXAR_TRACE_*` and `NEXAR_STALL_WARN_MS` variables that
    /// `lookup` has.
    ///
    /// ```
    /// let trace = nexar::trace::TraceConfig::from_lookup(|v| (v == "NEXAR_TRACE_DIR").then(|| "off".into())).unwrap();
    /// assert_eq!(trace.dir, None);
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut c = TraceConfig::default();
        let get = |var: &'static str| lookup(var).map(|v| (var, v));
        if let Some((var, v)) = get("NEXAR_TRACE_ENTRIES") {
            c.entries = parse(var, &v)?;
            if c.entries > 1_000_000 {
                return Err(invalid(var, &v, "at most 1000000 entries"));
            }
        }
        if let Some((_, v)) = get("NEXAR_TRACE_DIR") {
            c.dir = match v.trim() {
                "off" | "" => None,
                dir => Some(PathBuf::from(dir)),
            };
        }
        if let Some((var, v)) = get("NEXAR_STALL_WARN_MS") {
            let ms: u64 = parse(var, &v)?;
            if ms == 0 {
                return Err(invalid(var, &v, "at least 1 ms"));
            }
            c.stall_warn = Duration::from_millis(ms);
        }
        if let Some((var, v)) = get("NEXAR_TRACE_SIGNAL") {
            c.on_signal = match v.trim() {
                "on" | "1" | "true" => true,
                "off" | "0" | "false" => false,
                _ => return Err(invalid(var, &v, "expected on or off")),
            };
        }
        Ok(c)
    }
}

/// One rank's recorder, with what names its dumps and where they go.
pub(crate) struct RankTrace {
    pub recorder: FlightRecorder,
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
