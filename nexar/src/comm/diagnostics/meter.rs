//! The rank's periodic metrics sample: its links' QUIC path statistics and its membership
//! (see [`crate::telemetry`]).

use std::sync::Weak;
use std::time::Duration;

use crate::comm::client::Inner;
use crate::telemetry::{Sample, record_sample};

/// How often a rank samples its links and membership: often enough for a dashboard, rarely
/// enough to cost nothing.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Samples every [`SAMPLE_EVERY`] until the client is gone.
pub(crate) async fn sample_periodically(inner: Weak<Inner>) {
    let mut ticks = tokio::time::interval(SAMPLE_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        record_sample(inner.rank, &sample(&inner));
    }
}

/// What this rank knows now of its links and membership.
pub(crate) fn sample(inner: &Inner) -> Sample {
    let links = inner
        .links
        .iter()
        .map(|link| {
            let conn = link.connection();
            let path = conn.stats().path;
            (link.peer() as usize, conn.rtt(), path.sent_packets, path.lost_packets)
        })
        .collect();
    let joined = inner.growth.joined_count();
    Sample { links, world_size: inner.initial_world + joined, dead: inner.health.dead().len(), joined }
}
