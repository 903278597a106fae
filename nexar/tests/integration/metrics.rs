//! The Prometheus endpoint (`NEXAR_METRICS_ADDR`, feature `prometheus`), scraped over real
//! HTTP by a real client (ureq): the expected series appear after a few operations of every
//! kind, their values add up, and after 10,000 more operations (every one with a new sequence
//! number or tag) the set of series is exactly the same.
//!
//! The exporter is per process, so the test runs in a process of its own (`common::alone`).

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use nexar::prelude::*;

use crate::common;

#[nexar::rpc]
fn plus_one(x: u64) -> u64 {
    x + 1
}

/// A port that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `GET http://addr/metrics`: the body, after checking the content type.
async fn scrape(addr: SocketAddr) -> String {
    tokio::task::spawn_blocking(move || {
        let mut resp = ureq::get(&format!("http://{addr}/metrics")).call().expect("the metrics endpoint answers");
        let kind = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        assert!(kind.starts_with("text/plain"), "Prometheus text format, not {kind:?}");
        resp.body_mut().read_to_string().expect("a text body")
    })
    .await
    .unwrap()
}

/// Every series (name and labels) in a scrape.
fn series(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(s, _)| s.to_string()))
        .collect()
}

/// The value of the series whose name and labels are exactly `key`.
fn value(text: &str, key: &str) -> Option<f64> {
    text.lines().find_map(|l| l.rsplit_once(' ').filter(|(s, _)| *s == key).and_then(|(_, v)| v.parse().ok()))
}

/// One round on every rank: a small and a large allreduce (QUIC and the TCP lane), a
/// broadcast, a send and receive with tag `tag`, an RPC and a barrier.
async fn round(ranks: &[NexarClient], tag: u64, large: bool) {
    common::on_each(ranks, move |c| async move {
        let (r, w) = (c.rank(), c.world_size());
        let mut small = vec![1.0f32; 256];
        c.all_reduce(&mut small, Sum).await.unwrap();
        assert_eq!(small[0], w as f32);
        if large {
            let mut big = vec![1.0f32; 1 << 20];
            c.all_reduce(&mut big, Sum).await.unwrap();
            assert_eq!(big[big.len() - 1], w as f32);
        }
        let mut b = vec![r as u64; 16];
        c.broadcast(&mut b, 0).await.unwrap();
        assert_eq!(b[0], 0);
        c.send(&[tag], (r + 1) % w, tag).await.unwrap();
        assert_eq!(c.recv_vec::<u64>((r + w - 1) % w, tag).await.unwrap(), vec![tag]);
        assert_eq!(plus_one::call(&c, (r + 1) % w, tag).await.unwrap(), tag + 1);
        c.barrier().await.unwrap();
    })
    .await;
}

#[test]
fn the_metrics_endpoint_serves_bounded_series() {
    common::alone(
        module_path!(),
        "the_metrics_endpoint_serves_bounded_series",
        the_metrics_endpoint_serves_bounded_series_body,
    );
}

/// In a process of its own: the exporter is installed once per process.
async fn the_metrics_endpoint_serves_bounded_series_body() {
    common::logs();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    // The TCP lane's bytes are counted under its name (shared memory, which would take this
    // same-host link, is off).
    let cfg = NexarConfig::builder().metrics_addr(addr).shared_memory(false).build().unwrap();
    tokio::time::timeout(common::TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
        round(&ranks, 0, true).await;
        // The link sample runs once a second.
        let mut first = scrape(addr).await;
        for _ in 0..100 {
            if first.contains("nexar_peer_rtt_seconds{rank=\"1\",peer=\"0\"}") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            first = scrape(addr).await;
        }
        for want in [
            "# TYPE nexar_op_duration_seconds histogram",
            "nexar_op_duration_seconds_bucket{rank=\"0\",op=\"all_reduce\",comm=\"0\",le=\"0.00001\"}",
            "nexar_op_duration_seconds_count{rank=\"1\",op=\"broadcast\",comm=\"0\"}",
            "nexar_ops_total{rank=\"0\",op=\"send\",comm=\"0\",outcome=\"completed\"}",
            "nexar_ops_total{rank=\"1\",op=\"recv\",comm=\"0\",outcome=\"completed\"}",
            "nexar_ops_total{rank=\"0\",op=\"integration::metrics::plus_one\",comm=\"0\",outcome=\"completed\"}",
            "nexar_op_bytes_total{rank=\"0\",op=\"all_reduce\"}",
            "nexar_ops_in_flight{rank=\"0\"}",
            "nexar_sent_bytes_total{rank=\"0\",transport=\"quic\"}",
            "nexar_sent_bytes_total{rank=\"1\",transport=\"tcp-tls\"}",
            "nexar_peer_rtt_seconds{rank=\"0\",peer=\"1\"}",
            "nexar_peer_lost_packets_total{rank=\"1\",peer=\"0\"}",
            "nexar_world_size{rank=\"0\"} 2",
            "nexar_dead_ranks{rank=\"1\"} 0",
            "nexar_membership_epoch{rank=\"0\"} 0",
        ] {
            assert!(first.contains(want), "the scrape lacks {want:?}:\n{first}");
        }
        let allreduces = "nexar_ops_total{rank=\"0\",op=\"all_reduce\",comm=\"0\",outcome=\"completed\"}";
        assert_eq!(value(&first, allreduces), Some(2.0), "one small and one large allreduce");
        let bytes = value(&first, "nexar_op_bytes_total{rank=\"0\",op=\"all_reduce\"}").unwrap();
        assert_eq!(bytes, ((256 + (1 << 20)) * 4) as f64, "the payload of both allreduces");
        let received = value(&first, "nexar_op_bytes_total{rank=\"1\",op=\"recv\"}");
        assert_eq!(received, Some(8.0), "one u64 received, its size learnt on arrival");
        let tcp = value(&first, "nexar_sent_bytes_total{rank=\"0\",transport=\"tcp-tls\"}").unwrap();
        assert!(tcp >= (1 << 21) as f64, "the 4 MiB allreduce sent half its payload over the TCP lane: {tcp}");
        assert_eq!(value(&first, "nexar_ops_in_flight{rank=\"0\"}"), Some(0.0));

        // 10,000 more operations per rank, each with a sequence number or a tag never seen.
        for tag in 1..=1700u64 {
            round(&ranks, tag, false).await;
        }
        let after = scrape(addr).await;
        assert_eq!(series(&after), series(&first), "no series came or went with new sequence numbers or tags");
        // Shown with --nocapture: what a scrape looks like.
        for line in after.lines().filter(|l| l.contains("rank=\"0\"") && !l.contains("_bucket")) {
            println!("{line}");
        }
        let done = value(&after, allreduces).unwrap();
        assert_eq!(done, 1702.0, "every allreduce counted");
        for c in &ranks {
            c.shutdown().await;
        }
    })
    .await
    .expect("the test finishes within its limit");
}
