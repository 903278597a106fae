//! `NEXAR_METRICS_ADDR`: the process's metrics served in Prometheus text format
//! (metrics-exporter-prometheus, behind the crate feature `prometheus`).
//!
//! The exporter runs on a thread of its own with its own small runtime, so it answers while
//! the program's runtime is busy or blocked, and it outlives any one client: metrics belong to
//! the process, and every rank in it is told apart by its `rank` label.

use std::net::SocketAddr;

/// Why the metrics endpoint could not be started.
///
/// ```
/// let err = nexar::telemetry::MetricsError::Bind { addr: "0.0.0.0:9400".parse().unwrap(), reason: "in use".into() };
/// assert!(err.to_string().contains("NEXAR_METRICS_ADDR=0.0.0.0:9400"));
/// ```
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The address was given, but this build has no exporter.
    #[error(
        "NEXAR_METRICS_ADDR={addr} asks for a Prometheus endpoint, but nexar was built without its `prometheus` \
         feature (nexar = {{ features = [\"prometheus\"] }}); unset the variable or enable the feature"
    )]
    NotBuilt {
        /// The address asked for.
        addr: SocketAddr,
    },
    /// The listener could not be bound (the port is taken, the address is not this host's).
    #[error("NEXAR_METRICS_ADDR={addr}: cannot serve metrics there: {reason}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the system said.
        reason: String,
    },
    /// The program installed a `metrics` recorder of its own first.
    #[error(
        "NEXAR_METRICS_ADDR={addr}: another metrics recorder is already installed in this process; nexar's metrics \
         go to it. Unset NEXAR_METRICS_ADDR, or serve that recorder instead"
    )]
    RecorderTaken {
        /// The address asked for.
        addr: SocketAddr,
    },
    /// The exporter's thread or runtime could not be started.
    #[error("NEXAR_METRICS_ADDR={addr}: could not start the exporter: {reason}")]
    Runtime {
        /// The address asked for.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
}

/// Starts serving this process's metrics at `addr` (`GET /metrics`, or any path), once per
/// process; later calls with the same address do nothing, and with another address log that
/// the first one serves. Clients call it themselves when `NEXAR_METRICS_ADDR` is set.
///
/// ```no_run
/// nexar::telemetry::start_exporter("127.0.0.1:9400".parse().unwrap()).unwrap();
/// ```
pub fn start_exporter(addr: SocketAddr) -> Result<(), MetricsError> {
    imp::start(addr)
}

#[cfg(feature = "prometheus")]
mod imp {
    use std::net::SocketAddr;
    use std::sync::Mutex;

    use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};

    use super::MetricsError;
    use crate::sync::lock;
    use crate::telemetry::{DURATION_BUCKETS, OP_DURATION};

    /// Where this process serves, once started.
    static SERVING: Mutex<Option<SocketAddr>> = Mutex::new(None);

    pub(super) fn start(addr: SocketAddr) -> Result<(), MetricsError> {
        let mut serving = lock(&SERVING);
        if let Some(at) = *serving {
            if at != addr {
                tracing::warn!(%at, asked = %addr, "metrics are served once per process: still at the first address");
            }
            return Ok(());
        }
        let runtime_err = |reason: String| MetricsError::Runtime { addr, reason };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| runtime_err(e.to_string()))?;
        let builder = PrometheusBuilder::new()
            .with_http_listener(addr)
            .set_buckets_for_metric(Matcher::Full(OP_DURATION.into()), &DURATION_BUCKETS)
            .map_err(|e| runtime_err(e.to_string()))?;
        let (recorder, exporter) = {
            let _in_runtime = runtime.enter();
            builder.build().map_err(|e| match e {
                BuildError::FailedToCreateHTTPListener(reason) => MetricsError::Bind { addr, reason },
                other => runtime_err(other.to_string()),
            })?
        };
        metrics::set_global_recorder(recorder).map_err(|_| MetricsError::RecorderTaken { addr })?;
        std::thread::Builder::new()
            .name("nexar-metrics".into())
            .spawn(move || {
                if let Err(e) = runtime.block_on(exporter) {
                    tracing::warn!(%addr, error = ?e, "the metrics endpoint stopped");
                }
            })
            .map_err(|e| runtime_err(e.to_string()))?;
        tracing::info!(%addr, "serving metrics in Prometheus text format");
        *serving = Some(addr);
        Ok(())
    }
}

#[cfg(not(feature = "prometheus"))]
mod imp {
    use std::net::SocketAddr;

    use super::MetricsError;

    pub(super) fn start(addr: SocketAddr) -> Result<(), MetricsError> {
        Err(MetricsError::NotBuilt { addr })
    }
}
