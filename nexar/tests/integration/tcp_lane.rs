//! The TCP lane (`NexarConfig::bulk_transport = Tcp`): collective payloads over TLS on TCP
//! between real ranks on 127.0.0.1, every collective checked, small messages kept on QUIC, and
//! a lane that breaks mid-operation falling back to QUIC without wrong results. Typed
//! point-to-point messages take the lane too, in order.

use std::time::{Duration, Instant};

use nexar::prelude::*;
use nexar::{BulkTransport, CollectiveError, LaneCongestion, NexarConfigBuilder};

use crate::common;
use crate::common::p2p;

const LIMIT: Duration = Duration::from_secs(180);

/// The TCP lane between ranks that share this host: shared memory (which would take these
/// links) is off.
fn tcp(min_bytes: usize) -> NexarConfig {
    NexarConfig::builder()
        .bulk_transport(BulkTransport::Tcp)
        .bulk_min_bytes(min_bytes)
        .shared_memory(false)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_lanes_carry_every_collective_large_and_small() {
    common::logs();
    let run = async {
        for (n, min_bytes) in [(2, 0), (4, 64 << 10)] {
            let ranks = NexarClient::bootstrap_local_with(n, tcp(min_bytes)).await.unwrap();
            common::on_each(&ranks, move |c| async move {
                for p in (0..n).filter(|p| *p != c.rank()) {
                    assert_eq!(c.bulk_transport(p), Some("tcp-tls"), "rank {} to {p}", c.rank());
                }
                common::check_every_collective(&c, &[0, 1, 3, 1000, 300_007, 1 << 20]).await;
                for i in 0..300i64 {
                    let mut x = vec![i + c.rank() as i64; 5];
                    c.all_reduce(&mut x, Sum).await.unwrap();
                    assert_eq!(x, vec![n as i64 * i + (n * (n - 1) / 2) as i64; 5]);
                }
                // Point-to-point takes the lane too.
                let peer = (c.rank() + 1) % n;
                c.send(&[c.rank() as u32; 3][..], peer, 9).await.unwrap();
                let got: Vec<u32> = c.recv_vec((c.rank() + n - 1) % n, 9).await.unwrap();
                assert_eq!(got, vec![((c.rank() + n - 1) % n) as u32; 3]);
                c.barrier().await.unwrap();
                c.shutdown().await;
            })
            .await;
        }
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_that_breaks_mid_allreduce_falls_back_to_quic_without_wrong_results() {
    common::logs();
    let run = async {
        let cfg = tcp(64 << 10).into_builder().op_timeout(Duration::from_secs(20)).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
        let mut tasks = Vec::new();
        for c in ranks.clone() {
            tasks.push(tokio::spawn(async move {
                c.barrier().await.unwrap();
                let mut failed = 0;
                for _ in 0..20 {
                    let mut x = vec![c.rank() as i64; 1 << 20];
                    match c.all_reduce(&mut x, Sum).await {
                        Ok(()) => assert!(x.iter().all(|v| *v == 3), "a completed operation is correct"),
                        Err(e) => {
                            // Lost messages are never taken for later ones: no rank sees a
                            // bogus disagreement, let alone reduces the wrong bytes.
                            assert!(!matches!(e, CollectiveError::Mismatch { .. }), "rank {}: {e}", c.rank());
                            failed += 1;
                        }
                    }
                }
                tracing::info!(rank = c.rank(), failed, "operations that met the fault");
                failed
            }));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(ranks[0].inject_bulk_fault(1), "rank 0 has a lane to rank 1");
        for t in tasks {
            t.await.expect("rank task panicked");
        }
        // Both ends of the broken lane went back to QUIC; the other lanes stay.
        let deadline = Instant::now() + Duration::from_secs(30);
        for (a, b) in [(0, 1), (1, 0)] {
            while ranks[a].bulk_transport(b) != Some("quic") {
                assert!(Instant::now() < deadline, "rank {a} still sends to {b} over tcp");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        assert_eq!(ranks[0].bulk_transport(2), Some("tcp-tls"));
        common::on_each(&ranks, |c| async move {
            common::check_every_collective(&c, &[1, 1000, 300_001]).await;
            c.shutdown().await;
        })
        .await;
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

/// Typed point-to-point messages between ranks whose links have a TCP lane go through it, not
/// QUIC, sealed or in plaintext: sizes from empty to several segments, on two tags received in
/// another order than sent, every element checked, each tag's messages in order. With the
/// lane's I/O on threads of its own (`NEXAR_LANE_THREADS=on`) they stay on QUIC, where a small
/// message costs no thread wake-up, and arrive the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_takes_the_lane_in_order() {
    common::logs();
    let run = async {
        for (encrypt, threads) in [(true, false), (false, false), (true, true)] {
            let cfg = tcp(64 << 10).into_builder().bulk_encryption(encrypt).lane_threads(threads).build().unwrap();
            let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
            common::on_each(&ranks, move |c| async move {
                let peer = 1 - c.rank();
                assert_eq!(c.bulk_transport(peer), Some("tcp-tls"));
                let lens = [0usize, 1, 1000, 16 << 10, 300_007, 3 << 20, 3];
                let datagrams = p2p::exchange_in_order(&c, peer, &lens).await;
                // 13 MiB cannot cross QUIC in fewer than 212 datagrams of 64 KiB; on the lane,
                // QUIC carries only the odd control message.
                if threads {
                    assert!(datagrams > 212, "rank {}: {datagrams} datagrams: not over QUIC", c.rank());
                } else {
                    assert!(datagrams < 100, "rank {}: {datagrams} datagrams: not on the lane", c.rank());
                }
                c.barrier().await.unwrap();
                c.shutdown().await;
            })
            .await;
        }
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

/// When the lane that carried a peer's point-to-point messages breaks, some of them may be
/// lost, so receives from that peer fail at once naming the lane (what arrived before is still
/// received), sends to it fail too, and collectives go on over QUIC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_lane_fails_point_to_point_and_keeps_what_arrived() {
    common::logs();
    let run = async {
        let cfg = tcp(0).into_builder().op_timeout(p2p::LONG_OP_TIMEOUT).build().unwrap();
        let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
        p2p::broken_link_fails_point_to_point(&ranks, "tcp-tls").await;
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_without_the_lane_keeps_its_links_on_quic() {
    common::logs();
    let run = async {
        // Rank 2 keeps QUIC: its peers' offers meet a refusal, and only 0 <-> 1 use TCP.
        let mut cfgs = vec![tcp(0); 3];
        cfgs[2].bulk_transport = BulkTransport::Quic;
        cfgs.iter_mut().for_each(|c| c.connect_timeout = Duration::from_secs(2));
        let ranks = NexarClient::bootstrap_local_each(cfgs).await.unwrap();
        assert_eq!(ranks[0].bulk_transport(1), Some("tcp-tls"));
        assert_eq!(ranks[0].bulk_transport(2), Some("quic"));
        assert_eq!(ranks[2].bulk_transport(0), Some("quic"));
        common::on_each(&ranks, |c| async move {
            common::check_every_collective(&c, &[5, 200_003]).await;
            c.shutdown().await;
        })
        .await;
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

/// The host's default congestion control for new connections.
fn host_congestion() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap().trim().to_string()
}

/// Whether this process may set CUBIC on its sockets (root may choose any algorithm the
/// kernel has; others those in `tcp_allowed_congestion_control`).
fn may_choose_cubic() -> bool {
    let listed = |file: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/ipv4/{file}")).unwrap().split_whitespace().any(|a| a == "cubic")
    };
    let root = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
    listed("tcp_available_congestion_control") && (root || listed("tcp_allowed_congestion_control"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_runs_the_congestion_control_it_asks_for_on_its_lanes() {
    common::logs();
    let run = async {
        // Rank 0 names reno (every process may choose it), rank 1 keeps the host's default,
        // rank 2 takes nexar's default (CUBIC, where this process may choose it).
        let mut cfgs = vec![tcp(0); 3];
        cfgs[0].lane_congestion = LaneCongestion::Named("reno".into());
        cfgs[1].lane_congestion = LaneCongestion::System;
        let default = if may_choose_cubic() {
            "cubic".to_string()
        } else {
            eprintln!("this process may not choose cubic here: nexar's default keeps the host's");
            host_congestion()
        };
        let want = [String::from("reno"), host_congestion(), default];
        let ranks = NexarClient::bootstrap_local_each(cfgs).await.unwrap();
        common::on_each(&ranks, move |c| {
            let want = want.clone();
            async move {
                for p in (0..3).filter(|p| *p != c.rank()) {
                    assert_eq!(c.bulk_transport(p), Some("tcp-tls"), "rank {} to {p}", c.rank());
                    let details = c.bulk_transport_details(p).expect("a lane describes itself");
                    let expected = format!("sealed, AEGIS-128X2, {} congestion control", want[c.rank()]);
                    assert_eq!(details, expected, "rank {} to {p}", c.rank());
                }
                common::check_every_collective(&c, &[1000, 1 << 20]).await;
                c.shutdown().await;
            }
        })
        .await;
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_lanes_carry_every_collective() {
    common::logs();
    let run = async {
        // Written on the runtime, plaintext groups go to the socket straight from the
        // caller's buffers (and the writer thread takes what the socket does not); with
        // threads, they are copied for the writer.
        for inline in [true, false] {
            let cfg = tcp(0).into_builder().bulk_encryption(false).lane_threads(!inline).build().unwrap();
            let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
            common::on_each(&ranks, move |c| async move {
                for p in (0..3).filter(|p| *p != c.rank()) {
                    assert_eq!(c.bulk_transport(p), Some("tcp-tls"), "rank {} to {p}", c.rank());
                }
                common::check_every_collective(&c, &[0, 1, 1000, 300_007, 1 << 20, 5 << 20]).await;
                c.shutdown().await;
            })
            .await;
        }
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_with_io_on_the_runtime_or_on_threads_carry_every_collective() {
    common::logs();
    let run = async {
        // The runtime's I/O writes inline only while the writer thread is idle, so large
        // groups mix both writers; with threads, the writer and the reader are threads. Each
        // with either cipher.
        for cipher in [nexar::LaneCipher::Aegis128X2, nexar::LaneCipher::Aes128Gcm] {
            for inline in [true, false] {
                lanes_carry_every_collective(cipher, inline).await;
            }
        }
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

/// Three ranks whose lanes are sealed with `cipher` and whose lane I/O is on the runtime
/// (`inline`) or on threads run every collective.
async fn lanes_carry_every_collective(cipher: nexar::LaneCipher, inline: bool) {
    let cfg = tcp(0).into_builder().lane_threads(!inline).lane_cipher(cipher).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(3, cfg).await.unwrap();
    let name = match cipher {
        nexar::LaneCipher::Aegis128X2 => "sealed, AEGIS-128X2".to_string(),
        nexar::LaneCipher::Aes128Gcm => format!("sealed, AES-GCM from {}", nexar::LaneAes::Auto.resolve()),
    };
    common::on_each(&ranks, move |c| {
        let name = name.clone();
        async move {
            for p in (0..3).filter(|p| *p != c.rank()) {
                assert_eq!(c.bulk_transport(p), Some("tcp-tls"), "rank {} to {p}", c.rank());
                let details = c.bulk_transport_details(p).expect("a lane describes itself");
                assert!(details.starts_with(&name), "rank {} to {p}: {details}", c.rank());
            }
            common::check_every_collective(&c, &[1000, 300_007, 1 << 20]).await;
            c.shutdown().await;
        }
    })
    .await;
}

/// A link between ranks that both do the lane's I/O on their runtimes has one connection for
/// both ways; any other link one per direction. Ranks that differ (one with lane threads,
/// two without) still agree on each link's connections, and every collective runs on them;
/// their lanes' AES-128-GCM comes from aws-lc on rank 0 and ring on the others (the records
/// are the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_whose_lane_io_differs_agree_on_each_links_connections() {
    common::logs();
    let run = async {
        let aes = |i| if i == 0 { nexar::LaneAes::AwsLc } else { nexar::LaneAes::Ring };
        let (ranks, _seed) = three_ranks_each(|i, cfg| {
            cfg.lane_threads(i == 1).lane_cipher(nexar::LaneCipher::Aes128Gcm).lane_aes(aes(i))
        })
        .await;
        common::on_each(&ranks, |c| async move {
            for p in (0..3).filter(|p| *p != c.rank()) {
                assert_eq!(c.bulk_transport(p), Some("tcp-tls"), "rank {} to {p}", c.rank());
            }
            common::check_every_collective(&c, &[0, 1000, 300_007, 1 << 20]).await;
            c.shutdown().await;
        })
        .await;
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

/// Ranks alone on their hosts (here: fake hosts) have cores to spare, so by default their
/// lanes' I/O runs on their runtimes, and a thread of the lane's own reads the rest of each
/// large group. Every collective runs on such lanes, at sizes whose groups go either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_alone_on_their_hosts_read_large_groups_on_a_thread_of_the_lane() {
    common::logs();
    let run = async {
        let (ranks, _seed) = three_ranks_each(|i, cfg| cfg.host_id(format!("lane-host-{i}"))).await;
        common::on_each(&ranks, |c| async move {
            for p in (0..3).filter(|p| *p != c.rank()) {
                assert_eq!(c.bulk_transport(p), Some("tcp-tls"), "rank {} to {p}", c.rank());
            }
        })
        .await;
        // Every lane is up: one reader of large groups per lane of each rank (other tests may
        // run lanes of their own meanwhile). A thread takes its name only once it runs, so a
        // reader just started may still show its starter's name for a moment.
        let named = || thread_names().iter().filter(|n| n.starts_with("nexar-tcp-rxl-")).count();
        let started = Instant::now();
        while named() < 6 && started.elapsed() < Duration::from_secs(30) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let large_readers = named();
        assert!(large_readers >= 6, "{large_readers} large-group readers: {:?}", thread_names());
        common::on_each(&ranks, |c| async move {
            common::check_every_collective(&c, &[0, 1000, 300_007, 1 << 20, 3 << 20]).await;
            c.shutdown().await;
        })
        .await;
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

/// Three ranks on TCP lanes that join one seed (returned too, to keep it for the test's
/// length), rank `i` with its configuration changed by `each(i, ..)`.
async fn three_ranks_each(
    each: impl Fn(usize, NexarConfigBuilder) -> NexarConfigBuilder,
) -> (Vec<NexarClient>, SeedNode) {
    let cfg = tcp(0).into_builder().world_size(3).listen_addr("127.0.0.1:0".parse().unwrap()).build().unwrap();
    let seed = SeedNode::bind("127.0.0.1:0".parse().unwrap(), cfg.clone()).await.unwrap();
    let (addr, token) = (seed.local_addr(), seed.token().to_string());
    let joins: Vec<_> = (0..3)
        .map(|i| {
            let (token, cfg) = (token.clone(), each(i, cfg.clone().into_builder()).build().unwrap());
            tokio::spawn(async move { NexarClient::connect(addr, &token, cfg).await })
        })
        .collect();
    let mut ranks = Vec::new();
    for join in joins {
        ranks.push(join.await.unwrap().unwrap());
    }
    (ranks, seed)
}

/// The names of this process's threads.
fn thread_names() -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_refuses_a_worker_whose_lane_sealing_differs_and_the_cluster_still_forms() {
    common::logs();
    let run = async {
        let cfg = tcp(0).into_builder().world_size(2).listen_addr("127.0.0.1:0".parse().unwrap()).build().unwrap();
        let seed = SeedNode::bind("127.0.0.1:0".parse().unwrap(), cfg.clone()).await.unwrap();
        let (addr, token) = (seed.local_addr(), seed.token().to_string());
        let first = {
            let (token, cfg) = (token.clone(), cfg.clone());
            tokio::spawn(async move { NexarClient::connect(addr, &token, cfg).await })
        };
        // Let the first worker fix the cluster's setting.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let plain = cfg.clone().into_builder().bulk_encryption(false).build().unwrap();
        let aes_gcm = cfg.clone().into_builder().lane_cipher(nexar::LaneCipher::Aes128Gcm).build().unwrap();
        for (other, named) in [(plain, "NEXAR_BULK_ENCRYPTION=off"), (aes_gcm, "NEXAR_LANE_CIPHER=aes-128-gcm")] {
            match NexarClient::connect(addr, &token, other).await {
                Err(NexarError::Cluster(nexar::ClusterError::JoinRejected { reason, .. })) => {
                    assert!(reason.contains(named), "{reason}");
                    assert!(reason.contains("the cluster's first worker with"), "{reason}");
                    assert!(reason.contains("NEXAR_LANE_CIPHER=aegis-128x2"), "{reason}");
                    assert!(reason.contains("every rank must use the same"), "{reason}");
                }
                Err(other) => panic!("refused for another reason: {other}"),
                Ok(_) => panic!("a worker with {named} joined a cluster of another"),
            }
        }
        let second = NexarClient::connect(addr, &token, cfg).await.unwrap();
        let first = first.await.unwrap().unwrap();
        common::on_each(&[first, second], |c| async move {
            common::check_every_collective(&c, &[1, 300_007]).await;
            c.shutdown().await;
        })
        .await;
    };
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}

/// As over shared memory (`shm::a_peer_that_drops_its_client_after_its_last_allreduce…`): a
/// rank that drops its client right after an allreduce whose part went over the lane has its
/// departure judged only once the lane delivered what came before its goodbye.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_drops_its_client_after_its_last_allreduce_over_the_lane_still_completes_it_here() {
    common::logs();
    let run = common::leaver_completes_its_last_allreduce(tcp(0), "tcp-tls");
    tokio::time::timeout(LIMIT, run).await.expect("test ran past its limit");
}
