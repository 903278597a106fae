//! The RDMA transport over real nexar clusters (QUIC on 127.0.0.1): device discovery, the
//! fallback to QUIC without a device, every collective over the emulated fabric (the same
//! engine and flow control a NIC runs), and peers that break the setup protocol.

use std::future::Future;
use std::time::Duration;

use nexar::prelude::*;
use nexar_rdma::{Fabric, LinkTransport, RdmaConfig, RdmaError, attach};

use crate::common;

const LIMIT: Duration = Duration::from_secs(180);

/// RDMA takes links whose collective payloads are on QUIC (a TCP lane would hold them).
/// Links whose collective payloads are on QUIC, which RDMA takes (a TCP lane or shared
/// memory would hold them; these ranks share a host).
fn quic() -> NexarConfig {
    NexarConfig::builder().bulk_transport(nexar::BulkTransport::Quic).shared_memory(false).build().unwrap()
}

fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Runs a test body with logs on, failing it if it runs past [`LIMIT`].
async fn within_limit(body: impl Future<Output = ()>) {
    logs();
    tokio::time::timeout(LIMIT, body).await.expect("test ran past its limit");
}

/// Runs `job` on every rank of `ranks` at once; results by rank.
async fn on_ranks<F, Fut, R>(ranks: Vec<NexarClient>, job: F) -> Vec<R>
where
    F: Fn(NexarClient) -> Fut,
    Fut: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let handles: Vec<_> = ranks.into_iter().map(|c| tokio::spawn(job(c))).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("rank task panicked"));
    }
    out
}

#[test]
fn discovery_names_devices_or_says_there_are_none() {
    match nexar_rdma::devices() {
        Ok(devices) => assert!(!devices.is_empty() && devices.iter().all(|d| !d.name.is_empty())),
        Err(RdmaError::NoDevice { reason }) => {
            let text = RdmaError::NoDevice { reason: reason.clone() }.to_string();
            assert!(text.starts_with("no RDMA device: ") && !reason.is_empty(), "{text}");
        }
        Err(other) => panic!("discovery failed with something other than 'no device': {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_device_every_link_falls_back_and_carries_every_collective() {
    within_limit(async {
        let ranks = NexarClient::bootstrap_local_with(3, quic()).await.unwrap();
        let no_device = nexar_rdma::devices().is_err();
        let reports = on_ranks(ranks, move |c| async move {
            let report = attach(&c, &RdmaConfig::default()).await.unwrap();
            common::check_every_collective(&c, &[0, 1, 4, 10_007, 1 << 20]).await;
            let transports: Vec<_> = (0..3).filter(|p| *p != c.rank()).map(|p| c.bulk_transport(p)).collect();
            c.shutdown().await;
            (report, transports)
        })
        .await;
        for (rank, (report, transports)) in reports.into_iter().enumerate() {
            assert_eq!(report.links.len(), 2);
            if no_device {
                assert_eq!(report.rdma_links(), 0, "rank {rank}: {report:?}");
                assert!(transports.iter().all(|t| *t == Some("quic")));
                for (_, t) in &report.links {
                    let LinkTransport::Quic { reason } = t else { panic!("rank {rank}: {t:?}") };
                    assert!(reason.contains("no RDMA device"), "rank {rank}: {reason}");
                }
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_rdma_carries_every_collective_through_a_small_ring() {
    within_limit(async {
        let ranks = NexarClient::bootstrap_local_with(4, quic()).await.unwrap();
        // 4 slots of 4 KiB: large payloads take hundreds of chunks and credit round trips.
        let cfg = RdmaConfig { fabric: Fabric::Emulated, slots: 4, slot_size: 4096, ..Default::default() };
        let results = on_ranks(ranks, move |c| {
            let cfg = cfg.clone();
            async move {
                let report = attach(&c, &cfg).await.unwrap();
                assert_eq!(report.rdma_links(), 3, "rank {}: {report:?}", c.rank());
                for p in (0..4).filter(|p| *p != c.rank()) {
                    assert_eq!(c.bulk_transport(p), Some("rdma"));
                }
                common::check_every_collective(&c, &[0, 1, 3, 1000, 4093, 300_007]).await;
                // Many small operations cycle every slot and credit many times.
                for i in 0..500i64 {
                    let mut x = vec![i + c.rank() as i64; 5];
                    c.all_reduce(&mut x, Sum).await.unwrap();
                    assert_eq!(x, vec![4 * i + 6; 5]);
                }
                // Point-to-point stays on QUIC beside it.
                let peer = (c.rank() + 1) % 4;
                c.send(&[c.rank() as u32; 3][..], peer, 9).await.unwrap();
                let got: Vec<u32> = c.recv_vec((c.rank() + 3) % 4, 9).await.unwrap();
                assert_eq!(got, vec![((c.rank() + 3) % 4) as u32; 3]);
                c.barrier().await.unwrap();
                c.shutdown().await;
            }
        })
        .await;
        assert_eq!(results.len(), 4);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_on_different_fabrics_both_stay_on_quic() {
    within_limit(async {
        let ranks = NexarClient::bootstrap_local_with(2, quic()).await.unwrap();
        let results = on_ranks(ranks, |c| async move {
            let fabric = if c.rank() == 0 { Fabric::Emulated } else { Fabric::Verbs };
            let report = attach(&c, &RdmaConfig { fabric, ..Default::default() }).await.unwrap();
            common::check_every_collective(&c, &[1, 70_001]).await;
            c.shutdown().await;
            report
        })
        .await;
        for report in results {
            assert_eq!(report.rdma_links(), 0, "{report:?}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_breaks_the_setup_protocol_gets_quic_and_a_named_reason() {
    within_limit(async {
        let ranks = NexarClient::bootstrap_local_with(2, quic()).await.unwrap();
        let results = on_ranks(ranks, |c| async move {
            let cfg = RdmaConfig { fabric: Fabric::Emulated, ..Default::default() };
            let outcome = if c.rank() == 0 {
                Some(attach(&c, &cfg).await.unwrap())
            } else {
                // A hostile rank 1: garbage for an offer. Rank 0's first attach on this
                // communicator: attempt 0.
                let (offer, outcome) = nexar::backend::setup_tags("rdma", c.comm_id(), 0);
                c.send_setup(0, offer, b"not an offer at all".to_vec()).await.unwrap();
                assert!(!c.recv_setup(0, offer).await.unwrap().is_empty(), "rank 0's offer");
                // Rank 0 says its half failed, and why.
                let failed = c.recv_setup(0, outcome).await.unwrap();
                assert!(String::from_utf8_lossy(&failed).contains("magic"), "{failed:?}");
                None
            };
            common::check_every_collective(&c, &[2, 5000]).await;
            assert_eq!(c.bulk_transport(1 - c.rank()), Some("quic"));
            c.shutdown().await;
            outcome
        })
        .await;
        let report = results[0].clone().unwrap();
        let LinkTransport::Quic { reason } = &report.links[0].1 else { panic!("{report:?}") };
        assert!(reason.contains("rank 1") && reason.contains("magic"), "{reason}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_messages_are_checked_and_time_out() {
    within_limit(async {
        let cfg = quic().into_builder().op_timeout(Duration::from_millis(500)).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
        let c = ranks[0].clone();
        let too_big = c.send_setup(1, 1, vec![0; nexar::MAX_SETUP_BODY + 1]).await.unwrap_err();
        assert!(too_big.to_string().contains("limit"), "{too_big}");
        let to_self = c.send_setup(0, 1, vec![]).await.unwrap_err();
        assert!(to_self.to_string().contains("rank 0 send_setup"), "{to_self}");
        let waited = c.recv_setup(1, 42).await.unwrap_err();
        assert!(matches!(waited, nexar::BackendError::Timeout { peer: 1, tag: 42, .. }), "{waited}");
        // Messages with the same tag arrive in order; other tags do not get in the way.
        for i in 0..5u8 {
            ranks[1].send_setup(0, 7, vec![i]).await.unwrap();
        }
        ranks[1].send_setup(0, 8, vec![80]).await.unwrap();
        assert_eq!(c.recv_setup(1, 8).await.unwrap(), vec![80]);
        for i in 0..5u8 {
            assert_eq!(c.recv_setup(1, 7).await.unwrap(), vec![i]);
        }
        let bad = attach(&c, &RdmaConfig { slot_size: 1000, ..Default::default() }).await.unwrap_err();
        assert!(matches!(bad, RdmaError::Config(_)), "{bad}");
        futures_join(ranks).await;
    })
    .await;
}

async fn futures_join(ranks: Vec<NexarClient>) {
    on_ranks(ranks, |c| async move { c.shutdown().await }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collective_running_across_the_attach_completes_correctly() {
    within_limit(async {
        let ranks = NexarClient::bootstrap_local_with(3, quic()).await.unwrap();
        let cfg = RdmaConfig { fabric: Fabric::Emulated, slots: 4, slot_size: 4096, ..Default::default() };
        on_ranks(ranks, move |c| {
            let cfg = cfg.clone();
            async move {
                let n = 1 << 21;
                // Started over QUIC; the attach lands in its middle.
                let running = c.all_reduce_start(Buf::from_vec(vec![c.rank() as i64 + 1; n]), Sum);
                assert_eq!(attach(&c, &cfg).await.unwrap().rdma_links(), 2);
                let done = running.await.unwrap();
                assert!(done.iter().all(|v| *v == 6), "the collective that spanned the attach");
                common::check_every_collective(&c, &[1, 5000]).await;
                c.shutdown().await;
            }
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attaching_again_keeps_the_links_that_are_attached() {
    within_limit(async {
        let ranks = NexarClient::bootstrap_local_with(2, quic()).await.unwrap();
        let cfg = RdmaConfig { fabric: Fabric::Emulated, ..Default::default() };
        let reports = on_ranks(ranks, move |c| {
            let cfg = cfg.clone();
            async move {
                let first = attach(&c, &cfg).await.unwrap();
                let second = attach(&c, &cfg).await.unwrap();
                common::check_every_collective(&c, &[3, 70_000]).await;
                assert_eq!(c.bulk_transport(1 - c.rank()), Some("rdma"));
                c.shutdown().await;
                (first, second)
            }
        })
        .await;
        for (first, second) in reports {
            assert_eq!(first.rdma_links(), 1);
            let LinkTransport::Quic { reason } = &second.links[0].1 else { panic!("{second:?}") };
            assert!(reason.contains("already had a rdma channel"), "{reason}");
        }
    })
    .await;
}
