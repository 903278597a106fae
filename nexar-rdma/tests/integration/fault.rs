//! An RDMA link that fails mid-operation: the operation ends (with a result or an error, on
//! every rank, within the operation timeout), the links go back to QUIC, and later operations
//! are correct. In a process of its own (`common::alone`): the fault it injects is process-wide.

use std::time::{Duration, Instant};

use nexar::prelude::*;
use nexar_rdma::{Fabric, RdmaConfig, attach};

use crate::common;

#[test]
fn a_failed_rdma_link_falls_back_to_quic_for_later_operations() {
    common::alone(
        module_path!(),
        "a_failed_rdma_link_falls_back_to_quic_for_later_operations",
        a_failed_rdma_link_falls_back_to_quic_for_later_operations_body,
    );
}

async fn a_failed_rdma_link_falls_back_to_quic_for_later_operations_body() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let run = async {
        // RDMA takes links whose collective payloads are on QUIC (a TCP lane or, between
        // these ranks of one host, shared memory would hold them).
        let cfg = NexarConfig::builder()
            .op_timeout(Duration::from_secs(10))
            .bulk_transport(nexar::BulkTransport::Quic)
            .shared_memory(false)
            .build()
            .unwrap();
        let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
        let rdma = RdmaConfig { fabric: Fabric::Emulated, slots: 4, slot_size: 4096, ..Default::default() };
        let mut tasks = Vec::new();
        for c in ranks.clone() {
            let rdma = rdma.clone();
            tasks.push(tokio::spawn(async move {
                assert_eq!(attach(&c, &rdma).await.unwrap().rdma_links(), 2);
                c.barrier().await.unwrap();
                let mut x = vec![c.rank() as i64; 1 << 20];
                match c.all_reduce(&mut x, Sum).await {
                    Ok(()) => assert!(x.iter().all(|v| *v == 3), "a completed operation is correct"),
                    Err(e) => {
                        // Lost messages are never taken for later ones: no rank sees a bogus
                        // disagreement, let alone reduces the wrong bytes.
                        assert!(!matches!(e, nexar::CollectiveError::Mismatch { .. }), "rank {}: {e}", c.rank());
                        tracing::info!(rank = c.rank(), error = %e, "the operation that met the fault");
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        nexar_rdma::inject_emulated_fault(true);
        for t in tasks {
            t.await.expect("rank task panicked");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for c in &ranks {
            for p in (0..3).filter(|p| *p != c.rank()) {
                while c.bulk_transport(p) != Some("quic") {
                    assert!(Instant::now() < deadline, "rank {} still sends to {p} over RDMA", c.rank());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        nexar_rdma::inject_emulated_fault(false);
        let mut tasks = Vec::new();
        for c in ranks {
            tasks.push(tokio::spawn(async move {
                common::check_every_collective(&c, &[1, 1000, 300_001]).await;
                c.shutdown().await;
            }));
        }
        for t in tasks {
            t.await.expect("rank task panicked");
        }
    };
    tokio::time::timeout(Duration::from_secs(180), run).await.expect("test ran past its limit");
}
