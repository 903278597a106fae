//! The flight recorder's dump: one JSON file per rank, named by cluster and rank, and reading a
//! directory of them back (for `nexar trace`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Largest dump file read back: a dump of the default 2,000 entries is about 600 KB, and even
/// `NEXAR_TRACE_ENTRIES=100000` stays well below this.
pub const MAX_DUMP_BYTES: u64 = 256 << 20;

/// Errors writing or reading flight-recorder dumps.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// No directory to write to (`NEXAR_TRACE_DIR=off`).
    #[error("rank {rank}: the flight recorder has no directory to write to (NEXAR_TRACE_DIR=off)")]
    NoDirectory {
        /// The rank asked to dump.
        rank: usize,
    },
    /// A file or directory could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A file is not a dump this version can read.
    #[error("{path}: not a nexar flight-recorder dump: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// One rank's flight recorder, as dumped: its last operations, oldest first.
///
/// ```
/// let dump = nexar::trace::TraceDump {
///     cluster: "c0ffee".into(), rank: 1, world: 4, reason: "manual".into(), written_unix_us: 0, entries: vec![],
/// };
/// assert_eq!(dump.file_name(), "nexar-trace-c0ffee-rank1.json");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceDump {
    /// The cluster's id (the same on every rank of one cluster).
    pub cluster: String,
    /// The rank that wrote it (world rank).
    pub rank: usize,
    /// The world size when the cluster formed.
    pub world: usize,
    /// Why it was written: `manual`, `SIGUSR1`, or the error that caused it.
    pub reason: String,
    /// When it was written, in microseconds since the Unix epoch.
    pub written_unix_us: u64,
    /// The operations, oldest first.
    pub entries: Vec<TraceEntry>,
}

/// One operation in a [`TraceDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// Order of recording on its rank.
    pub id: u64,
    /// `collective`, `send`, `recv` or `rpc`.
    pub class: String,
    /// Communicator id.
    pub comm: u64,
    /// Collective sequence number; for point-to-point the tag; for RPC the function id.
    pub seq: u64,
    /// Operation name, such as `all_reduce`.
    pub op: String,
    /// Element type, such as `f32`.
    pub dtype: Option<String>,
    /// Elements the caller passed.
    pub count: u64,
    /// Root rank of a rooted collective.
    pub root: Option<u32>,
    /// Peer (world rank) of a point-to-point operation or RPC.
    pub peer: Option<u32>,
    /// Algorithm of a collective.
    pub algorithm: Option<String>,
    /// Payload bytes.
    pub bytes: u64,
    /// `started`, `completed`, `failed` or `cancelled`.
    pub state: String,
    /// Start, in microseconds since the Unix epoch.
    pub started_unix_us: u64,
    /// End, if it ended.
    pub ended_unix_us: Option<u64>,
    /// How long it ran (until the dump, if it had not ended).
    pub duration_us: u64,
    /// The peer (world rank) it waited for when dumped, if it was waiting.
    pub waiting_on: Option<u32>,
    /// The error it failed with.
    pub error: Option<String>,
}

impl TraceDump {
    /// The file this dump is written to: `nexar-trace-<cluster>-rank<rank>.json`.
    pub fn file_name(&self) -> String {
        format!("nexar-trace-{}-rank{}.json", self.cluster, self.rank)
    }

    /// Writes the dump into `dir` (created if missing), replacing an earlier dump of the same
    /// rank and cluster; returns the file's path. The file is written beside and renamed, so a
    /// reader never sees half a dump.
    pub fn write_to(&self, dir: &Path) -> Result<PathBuf, TraceError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TraceError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let path = dir.join(self.file_name());
        let partial = dir.join(format!(".{}.partial", self.file_name()));
        let text = serde_json::to_vec_pretty(self)
            .map_err(|e| TraceError::Invalid { path: path.clone(), reason: e.to_string() })?;
        std::fs::write(&partial, text).map_err(io(&partial))?;
        std::fs::rename(&partial, &path).map_err(io(&path))?;
        Ok(path)
    }

    /// Reads one dump, refusing a file larger than [`MAX_DUMP_BYTES`] before reading it.
    pub fn read(path: &Path) -> Result<TraceDump, TraceError> {
        let io = |source| TraceError::Io { path: path.to_path_buf(), source };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_DUMP_BYTES {
            return Err(TraceError::Invalid {
                path: path.to_path_buf(),
                reason: format!("{len} bytes, more than the {MAX_DUMP_BYTES} a dump may have"),
            });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        serde_json::from_slice(&bytes)
            .map_err(|e| TraceError::Invalid { path: path.to_path_buf(), reason: e.to_string() })
    }

    /// Reads every `nexar-trace-*.json` in `dir`, sorted by cluster and rank.
    pub fn read_dir(dir: &Path) -> Result<Vec<TraceDump>, TraceError> {
        let io = |source| TraceError::Io { path: dir.to_path_buf(), source };
        let mut dumps = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.starts_with("nexar-trace-") && name.ends_with(".json") {
                dumps.push(TraceDump::read(&path)?);
            }
        }
        dumps.sort_by(|a, b| (&a.cluster, a.rank).cmp(&(&b.cluster, b.rank)));
        Ok(dumps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_round_trips_through_its_file_and_garbage_is_refused() {
        let dir = std::env::temp_dir().join(format!("nexar-dump-test-{}", std::process::id()));
        let dump = TraceDump {
            cluster: "ab12".into(),
            rank: 3,
            world: 4,
            reason: "manual".into(),
            written_unix_us: 5,
            entries: Vec::new(),
        };
        let path = dump.write_to(&dir).unwrap();
        assert_eq!(TraceDump::read(&path).unwrap(), dump);
        std::fs::write(dir.join("nexar-trace-bad-rank0.json"), b"{\"cluster\": 7").unwrap();
        let err = TraceDump::read_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("not a nexar flight-recorder dump"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
