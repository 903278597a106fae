//! Metrics through the [`metrics`] facade: what each rank did, how long it took, what crossed
//! which transport, how its links and its membership are doing.
//!
//! `op` is the collective's name (`all_reduce`, `broadcast`, …), `send`, `recv`, or the name
//! of the RPC function called. Every series carries the label `rank` (the world rank; bounded by the world size), so that
//! several ranks in one process stay apart. No label ever holds a sequence number, a tag or
//! any other value that grows with the job: communicators beyond the first
//! [`LABELLED_COMMS`] of a rank share the label `comm="other"`.
//!
//! | series | kind | labels |
//! |---|---|---|
//! | `nexar_op_duration_seconds` | histogram | rank, op, comm |
//! | `nexar_ops_total` | counter | rank, op, comm, outcome (`completed`, `failed`, `cancelled`) |
//! | `nexar_op_bytes_total` | counter | rank, op |
//! | `nexar_ops_in_flight` | gauge | rank |
//! | `nexar_sent_bytes_total` | counter | rank, transport (`quic`, `tcp-tls` for the TCP lane, a bulk channel's name such as RDMA's) |
//! | `nexar_peer_rtt_seconds` | gauge | rank, peer |
//! | `nexar_peer_sent_packets_total`, `nexar_peer_lost_packets_total` | counter | rank, peer |
//! | `nexar_world_size`, `nexar_dead_ranks`, `nexar_membership_epoch` | gauge | rank |
//!
//! A program that installs its own `metrics` recorder (StatsD, OpenTelemetry, …) gets these
//! series there; install it before the first client is made. With the crate feature
//! `prometheus`, `NEXAR_METRICS_ADDR` instead makes nexar serve them itself in Prometheus
//! text format ([`start_exporter`]).
//!
//! ```
//! // Without a recorder the metrics cost next to nothing and go nowhere.
//! let cfg = nexar::NexarConfig::from_lookup(|v| (v == "NEXAR_METRICS_ADDR").then(|| "127.0.0.1:9400".into())).unwrap();
//! assert_eq!(cfg.metrics_addr, Some("127.0.0.1:9400".parse().unwrap()));
//! ```

mod exporter;

use std::sync::Mutex;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Unit};
use rustc_hash::FxHashMap;

pub use exporter::{MetricsError, start_exporter};

use crate::sync::lock;

/// Communicators a rank labels by id; later ones share `comm="other"`, so a program that
/// splits communicators in a loop does not grow the series without bound.
pub const LABELLED_COMMS: usize = 16;

/// Bucket bounds of `nexar_op_duration_seconds`: 10 µs to 100 s, three per decade.
pub const DURATION_BUCKETS: [f64; 22] = [
    10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
    10.0, 20.0, 50.0, 100.0,
];

/// The name of the operation-duration histogram.
pub const OP_DURATION: &str = "nexar_op_duration_seconds";

/// Describes every series to the installed recorder (units and help texts).
fn describe() {
    metrics::describe_histogram!(OP_DURATION, Unit::Seconds, "Duration of completed operations");
    metrics::describe_counter!("nexar_ops_total", "Operations finished, by outcome");
    metrics::describe_counter!("nexar_op_bytes_total", Unit::Bytes, "Payload bytes of finished operations");
    metrics::describe_gauge!("nexar_ops_in_flight", "Operations started and not yet finished");
    metrics::describe_counter!("nexar_sent_bytes_total", Unit::Bytes, "Bytes handed to each transport");
    metrics::describe_gauge!("nexar_peer_rtt_seconds", Unit::Seconds, "QUIC round-trip time to each peer");
    metrics::describe_counter!("nexar_peer_sent_packets_total", "QUIC datagrams sent to each peer");
    metrics::describe_counter!("nexar_peer_lost_packets_total", "QUIC datagrams to each peer declared lost");
    metrics::describe_gauge!("nexar_world_size", "Ranks in the cluster as this rank knows it");
    metrics::describe_gauge!("nexar_dead_ranks", "Ranks this rank has declared dead");
    metrics::describe_gauge!(
        "nexar_membership_epoch",
        "Membership changes this rank has seen (ranks joined plus ranks declared dead)"
    );
}

/// How an operation ended, for `nexar_ops_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Completed,
    Failed,
    Cancelled,
}

/// The handles of one (operation, communicator) pair.
struct OpMeters {
    duration: Histogram,
    completed: Counter,
    failed: Counter,
    cancelled: Counter,
    bytes: Counter,
}

#[derive(Default)]
struct OpTable {
    /// Keyed by operation and communicator (`None`: the shared `other`). Every finished
    /// operation looks here, so the hasher is a fast one (the keys are nexar's own names).
    meters: FxHashMap<(&'static str, Option<u64>), OpMeters>,
    /// The communicators that have a label of their own.
    labelled: Vec<u64>,
}

/// One rank's operation metrics. Handles are made once per (operation, communicator), so a
/// finished operation costs one uncontended lock and a few atomic updates.
pub(crate) struct RankMeters {
    rank: String,
    table: Mutex<OpTable>,
    in_flight: Gauge,
}

impl std::fmt::Debug for RankMeters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankMeters").field("rank", &self.rank).finish()
    }
}

impl RankMeters {
    /// The metrics of world rank `rank`, on whatever recorder is installed now.
    pub fn new(rank: usize) -> Self {
        describe();
        let rank = rank.to_string();
        let in_flight = metrics::gauge!("nexar_ops_in_flight", "rank" => rank.clone());
        RankMeters { rank, table: Mutex::new(OpTable::default()), in_flight }
    }

    /// An operation started.
    pub fn started(&self) {
        self.in_flight.increment(1.0);
    }

    /// An operation `op` on communicator `comm` with `bytes` of payload ended after `took`.
    pub fn finished(&self, op: &'static str, comm: u64, bytes: u64, took: Duration, outcome: Outcome) {
        self.in_flight.decrement(1.0);
        let mut table = lock(&self.table);
        let slot = if table.labelled.contains(&comm) {
            Some(comm)
        } else if table.labelled.len() < LABELLED_COMMS {
            table.labelled.push(comm);
            Some(comm)
        } else {
            None
        };
        let rank = &self.rank;
        let meters = table.meters.entry((op, slot)).or_insert_with(|| {
            let comm = slot.map_or_else(|| "other".to_string(), |c| c.to_string());
            let outcome = |o: &'static str| {
                metrics::counter!("nexar_ops_total", "rank" => rank.clone(), "op" => op, "comm" => comm.clone(), "outcome" => o)
            };
            OpMeters {
                duration: metrics::histogram!(OP_DURATION, "rank" => rank.clone(), "op" => op, "comm" => comm.clone()),
                completed: outcome("completed"),
                failed: outcome("failed"),
                cancelled: outcome("cancelled"),
                bytes: metrics::counter!("nexar_op_bytes_total", "rank" => rank.clone(), "op" => op),
            }
        });
        match outcome {
            Outcome::Completed => {
                meters.duration.record(took.as_secs_f64());
                meters.bytes.increment(bytes);
                meters.completed.increment(1);
            }
            Outcome::Failed => meters.failed.increment(1),
            Outcome::Cancelled => meters.cancelled.increment(1),
        }
    }
}

/// Bytes one link hands to its transports (`nexar_sent_bytes_total`).
#[derive(Debug)]
pub(crate) struct SentBytes {
    rank: String,
    quic: Counter,
    /// The counter of the link's bulk channel, made at its first group (a link attaches one
    /// channel, once): looking it up by its labels cost an allocation and a hash per message.
    bulk: std::sync::OnceLock<(&'static str, Counter)>,
}

impl SentBytes {
    /// The counters of world rank `rank`'s links.
    pub fn new(rank: u32) -> Self {
        let rank = rank.to_string();
        let quic = metrics::counter!("nexar_sent_bytes_total", "rank" => rank.clone(), "transport" => "quic");
        SentBytes { rank, quic, bulk: std::sync::OnceLock::new() }
    }

    /// `n` bytes went to QUIC.
    pub fn quic(&self, n: usize) {
        self.quic.increment(n as u64);
    }

    /// `n` bytes went to the bulk channel named `transport`.
    pub fn bulk(&self, transport: &'static str, n: usize) {
        let lookup =
            || metrics::counter!("nexar_sent_bytes_total", "rank" => self.rank.clone(), "transport" => transport);
        match self.bulk.get_or_init(|| (transport, lookup())) {
            (cached, counter) if *cached == transport => counter.increment(n as u64),
            _ => lookup().increment(n as u64),
        }
    }
}

/// What a rank samples of its links and membership (see [`Sample`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Sample {
    /// `(peer, rtt, sent datagrams, lost datagrams)` per direct link.
    pub links: Vec<(usize, Duration, u64, u64)>,
    pub world_size: usize,
    pub dead: usize,
    pub joined: usize,
}

/// Records one [`Sample`] of world rank `rank`. Peers are bounded by the world size.
pub(crate) fn record_sample(rank: usize, sample: &Sample) {
    let rank = rank.to_string();
    for &(peer, rtt, sent, lost) in &sample.links {
        let peer = peer.to_string();
        metrics::gauge!("nexar_peer_rtt_seconds", "rank" => rank.clone(), "peer" => peer.clone())
            .set(rtt.as_secs_f64());
        metrics::counter!("nexar_peer_sent_packets_total", "rank" => rank.clone(), "peer" => peer.clone())
            .absolute(sent);
        metrics::counter!("nexar_peer_lost_packets_total", "rank" => rank.clone(), "peer" => peer).absolute(lost);
    }
    metrics::gauge!("nexar_world_size", "rank" => rank.clone()).set(sample.world_size as f64);
    metrics::gauge!("nexar_dead_ranks", "rank" => rank.clone()).set(sample.dead as f64);
    metrics::gauge!("nexar_membership_epoch", "rank" => rank).set((sample.joined + sample.dead) as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn communicators_past_the_limit_share_one_label() {
        let meters = RankMeters::new(0);
        for comm in 0..(LABELLED_COMMS as u64 + 40) {
            meters.started();
            meters.finished("all_reduce", comm, 16, Duration::from_micros(10), Outcome::Completed);
        }
        let table = lock(&meters.table);
        assert_eq!(table.labelled.len(), LABELLED_COMMS);
        assert_eq!(table.meters.len(), LABELLED_COMMS + 1, "one `other` entry for the rest");
        assert!(table.meters.contains_key(&("all_reduce", None)));
    }
}
