//! `nexar trace`: merges the ranks' dumps of one cluster and finds, per communicator, the first
//! collective where the ranks disagree or stop, and per operation who arrives last.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::dump::{TraceDump, TraceEntry};

/// Where the ranks of one communicator first part ways.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// The communicator.
    pub comm: u64,
    /// The first sequence number where they disagree or stop.
    pub seq: u64,
    /// Each distinct thing the ranks did at `seq` ("all_reduce f32 x1024, completed", "nothing
    /// recorded"), with the ranks that did it.
    pub groups: Vec<(String, Vec<usize>)>,
    /// The errors that started the failure at `seq`, by rank (a rank whose error only quotes
    /// another's abort is left out).
    pub causes: Vec<(usize, String)>,
}

/// Time spent in one operation, over every rank's dump.
#[derive(Clone, Debug, PartialEq)]
pub struct OpSummary {
    /// The operation, such as `all_reduce`.
    pub op: String,
    /// Calls recorded, over all ranks.
    pub calls: usize,
    /// Median duration in microseconds.
    pub p50_us: u64,
    /// Longest duration in microseconds.
    pub max_us: u64,
    /// The rank that started last most often in collectives every rank recorded (the one the
    /// others waited for), with how often and the median lead of the others over it.
    pub straggler: Option<(usize, usize, usize, u64)>,
}

/// What `nexar trace` found in one cluster's dumps.
///
/// ```
/// let analyses = nexar::trace::analyse(&[]);
/// assert!(analyses.is_empty());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TraceAnalysis {
    /// The cluster id.
    pub cluster: String,
    /// The ranks whose dumps were read.
    pub ranks: Vec<usize>,
    /// The world size the dumps name.
    pub world: usize,
    /// Per communicator, the first divergence (none when every rank agrees throughout).
    pub divergences: Vec<Divergence>,
    /// Per operation, the durations.
    pub summaries: Vec<OpSummary>,
}

/// Analyses dumps, one [`TraceAnalysis`] per cluster found among them.
pub fn analyse(dumps: &[TraceDump]) -> Vec<TraceAnalysis> {
    let mut clusters: BTreeMap<&str, Vec<&TraceDump>> = BTreeMap::new();
    for dump in dumps {
        clusters.entry(&dump.cluster).or_default().push(dump);
    }
    clusters.into_iter().map(|(cluster, dumps)| analyse_cluster(cluster, &dumps)).collect()
}

/// One rank's collectives on one communicator, by sequence number (a segmented call's parts
/// merged: the last state of any part wins unless one failed).
type Calls<'a> = BTreeMap<u64, &'a TraceEntry>;

fn calls_of(dump: &TraceDump, comm: u64) -> Calls<'_> {
    let mut calls: Calls<'_> = BTreeMap::new();
    for e in dump.entries.iter().filter(|e| e.class == "collective" && e.comm == comm) {
        let keep = calls.get(&e.seq).is_none_or(|old| old.state == "completed");
        if keep {
            calls.insert(e.seq, e);
        }
    }
    calls
}

fn what(e: &TraceEntry) -> String {
    let mut text = format!("{} {} x{}", e.op, e.dtype.as_deref().unwrap_or("?"), e.count);
    if let Some(root) = e.root {
        text.push_str(&format!(" root {root}"));
    }
    text
}

fn analyse_cluster(cluster: &str, dumps: &[&TraceDump]) -> TraceAnalysis {
    let comms: BTreeSet<u64> =
        dumps.iter().flat_map(|d| d.entries.iter().filter(|e| e.class == "collective").map(|e| e.comm)).collect();
    let divergences = comms.iter().filter_map(|&comm| first_divergence(comm, dumps)).collect();
    TraceAnalysis {
        cluster: cluster.to_string(),
        ranks: dumps.iter().map(|d| d.rank).collect(),
        world: dumps.iter().map(|d| d.world).max().unwrap_or(0),
        divergences,
        summaries: summaries(dumps, &comms),
    }
}

fn first_divergence(comm: u64, dumps: &[&TraceDump]) -> Option<Divergence> {
    let per_rank: Vec<(usize, Calls<'_>)> = dumps.iter().map(|d| (d.rank, calls_of(d, comm))).collect();
    // Older calls may have left some rank's ring: start where every rank that recorded any
    // call of this communicator still has its records.
    let from = per_rank.iter().filter_map(|(_, c)| c.keys().next().copied()).max()?;
    let seqs: BTreeSet<u64> = per_rank.iter().flat_map(|(_, c)| c.range(from..).map(|(s, _)| *s)).collect();
    for seq in seqs {
        let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        let mut errors: Vec<(usize, String)> = Vec::new();
        for (rank, calls) in &per_rank {
            let story = match calls.get(&seq) {
                Some(e) => {
                    if let Some(error) = &e.error {
                        errors.push((*rank, error.clone()));
                    }
                    format!("{}, {}", what(e), e.state)
                }
                None => match calls.keys().next_back() {
                    Some(last) if *last < seq => format!("nothing (last recorded #{last})"),
                    _ => "nothing recorded".to_string(),
                },
            };
            groups.entry(story).or_default().push(*rank);
        }
        let all_done = groups.len() == 1 && groups.keys().all(|g| g.ends_with(", completed"));
        if !all_done {
            let quoted = |e: &str| e.contains(": aborted: ");
            let causes: Vec<(usize, String)> = match errors.iter().any(|(_, e)| !quoted(e)) {
                true => errors.into_iter().filter(|(_, e)| !quoted(e)).collect(),
                false => errors.into_iter().take(1).collect(),
            };
            return Some(Divergence { comm, seq, groups: groups.into_iter().collect(), causes });
        }
    }
    None
}

fn median(values: &mut [u64]) -> u64 {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or(0)
}

fn summaries(dumps: &[&TraceDump], comms: &BTreeSet<u64>) -> Vec<OpSummary> {
    let mut durations: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for e in dumps.iter().flat_map(|d| d.entries.iter()).filter(|e| e.state == "completed") {
        durations.entry(&e.op).or_default().push(e.duration_us);
    }
    // For each collective every rank recorded: who started last, and by how much.
    let mut late: BTreeMap<&str, BTreeMap<usize, Vec<u64>>> = BTreeMap::new();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for &comm in comms {
        let per_rank: Vec<(usize, Calls<'_>)> = dumps.iter().map(|d| (d.rank, calls_of(d, comm))).collect();
        let Some((_, first)) = per_rank.first() else { continue };
        for (seq, entry) in first {
            let starts: Option<Vec<(usize, u64)>> =
                per_rank.iter().map(|(r, c)| c.get(seq).map(|e| (*r, e.started_unix_us))).collect();
            let Some(starts) = starts.filter(|s| s.len() > 1) else { continue };
            let (last_rank, last_start) = starts.iter().copied().max_by_key(|(_, t)| *t).unwrap_or_default();
            let mut others: Vec<u64> =
                starts.iter().filter(|(r, _)| *r != last_rank).map(|(_, t)| last_start - t).collect();
            *seen.entry(&entry.op).or_default() += 1;
            late.entry(&entry.op).or_default().entry(last_rank).or_default().push(median(&mut others));
        }
    }
    durations
        .into_iter()
        .map(|(op, mut d)| {
            let straggler = late.get(op).and_then(|by_rank| {
                let (rank, leads) = by_rank.iter().max_by_key(|(_, leads)| leads.len())?;
                let mut leads = leads.clone();
                Some((*rank, leads.len(), seen.get(op).copied().unwrap_or(0), median(&mut leads)))
            });
            OpSummary {
                op: op.to_string(),
                calls: d.len(),
                p50_us: median(&mut d),
                max_us: d.last().copied().unwrap_or(0),
                straggler,
            }
        })
        .collect()
}

fn micros(us: u64) -> String {
    match us {
        0..1_000 => format!("{us} µs"),
        1_000..1_000_000 => format!("{:.1} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

impl fmt::Display for TraceAnalysis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "cluster {}: dumps of {} of {} ranks {:?}",
            self.cluster,
            self.ranks.len(),
            self.world,
            self.ranks
        )?;
        let missing: Vec<usize> = (0..self.world).filter(|r| !self.ranks.contains(r)).collect();
        if !missing.is_empty() {
            writeln!(f, "  no dump from ranks {missing:?} (dead, or never dumped)")?;
        }
        if self.divergences.is_empty() {
            writeln!(f, "  every communicator: the ranks agree on every collective recorded")?;
        }
        for d in &self.divergences {
            writeln!(f, "  comm {}: first divergence at #{}", d.comm, d.seq)?;
            for (story, ranks) in &d.groups {
                writeln!(f, "    ranks {ranks:?}: {story}")?;
            }
            for (rank, error) in &d.causes {
                writeln!(f, "    rank {rank} failed: {error}")?;
            }
        }
        if !self.summaries.is_empty() {
            writeln!(f, "  {:<16} {:>7} {:>10} {:>10}  arrived last most often", "operation", "calls", "p50", "max")?;
        }
        for s in &self.summaries {
            let straggler = match s.straggler {
                Some((rank, times, of, lead)) => {
                    format!("rank {rank}: {times} of {of} calls, {} after the others (median)", micros(lead))
                }
                None => "-".to_string(),
            };
            writeln!(
                f,
                "  {:<16} {:>7} {:>10} {:>10}  {straggler}",
                s.op,
                s.calls,
                micros(s.p50_us),
                micros(s.max_us)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, op: &str, state: &str, start: u64) -> TraceEntry {
        TraceEntry {
            id: seq,
            class: "collective".into(),
            comm: 0,
            seq,
            op: op.into(),
            dtype: Some("f32".into()),
            count: 8,
            root: (op == "broadcast").then_some(0),
            peer: None,
            algorithm: None,
            bytes: 32,
            state: state.into(),
            started_unix_us: start,
            ended_unix_us: None,
            duration_us: 100,
            waiting_on: None,
            error: None,
        }
    }

    fn dump(rank: usize, entries: Vec<TraceEntry>) -> TraceDump {
        TraceDump { cluster: "c".into(), rank, world: 4, reason: "test".into(), written_unix_us: 0, entries }
    }

    #[test]
    fn the_first_divergent_sequence_number_and_its_ranks_are_found() {
        let done = |seq, start| entry(seq, "all_reduce", "completed", start);
        let dumps = vec![
            dump(0, vec![done(0, 10), done(1, 20), entry(2, "all_reduce", "failed", 30)]),
            dump(1, vec![done(0, 10), done(1, 20), entry(2, "all_reduce", "failed", 30)]),
            dump(2, vec![done(0, 10), done(1, 20), entry(2, "broadcast", "failed", 30)]),
            dump(3, vec![done(0, 15), done(1, 29)]),
        ];
        let analyses = analyse(&dumps);
        let a = &analyses[0];
        assert_eq!(a.divergences.len(), 1);
        let d = &a.divergences[0];
        assert_eq!(d.seq, 2);
        let ranks_of = |needle: &str| d.groups.iter().find(|(s, _)| s.contains(needle)).map(|(_, r)| r.clone());
        assert_eq!(ranks_of("all_reduce"), Some(vec![0, 1]));
        assert_eq!(ranks_of("broadcast"), Some(vec![2]));
        assert_eq!(ranks_of("nothing (last recorded #1)"), Some(vec![3]));
        let all_reduce = a.summaries.iter().find(|s| s.op == "all_reduce").unwrap();
        assert_eq!(all_reduce.straggler.map(|s| (s.0, s.1, s.2)), Some((3, 2, 2)), "rank 3 started last twice");
        let text = a.to_string();
        assert!(text.contains("first divergence at #2"), "{text}");
    }
}
