//! Hostile inputs: strangers and bad frames at the seed, wrong tokens, and peers with
//! certificates from another CA or bound to another rank. Each is refused with a clear error
//! while the real cluster still forms.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use nexar::prelude::*;
use nexar::transport::endpoint::{bind, server_with_transport, with_transport};
use nexar::transport::tls::{ClusterCa, mesh_client, mesh_server, rank_server_name, seed_client};
use nexar::{ClusterError, JoinToken, TransportError};

use crate::common::{TEST_LIMIT, logs};

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Ports that were free a moment ago, for static-membership clusters.
fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let sockets: Vec<UdpSocket> = (0..n).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
    sockets.iter().map(|s| s.local_addr().unwrap()).collect()
}

/// A raw QUIC connection to the seed that passes TLS (it knows the CA fingerprint) but speaks
/// whatever the test wants afterwards.
async fn raw_seed_connection(seed: SocketAddr, token: &JoinToken, cfg: &NexarConfig) -> quinn::Connection {
    let endpoint = bind(loopback(), cfg, None).unwrap();
    let client = with_transport(seed_client(Some(token.ca_fingerprint())).unwrap(), cfg);
    endpoint.connect_with(client, seed, "seed.nexar").unwrap().await.unwrap()
}

async fn closed_within(conn: &quinn::Connection, limit: Duration) -> quinn::ConnectionError {
    tokio::time::timeout(limit, conn.closed()).await.expect("the seed kept a hostile connection open")
}

async fn ring_exchange(ranks: Vec<NexarClient>) {
    let world = ranks.len();
    let mut set = tokio::task::JoinSet::new();
    for c in ranks {
        set.spawn(async move {
            let me = c.rank();
            c.send(&[me as u32; 3], (me + 1) % world, 1).await.unwrap();
            let mut got = [0u32; 3];
            c.recv(&mut got, (me + world - 1) % world, 1).await.unwrap();
            assert_eq!(got, [((me + world - 1) % world) as u32; 3]);
            c.shutdown().await;
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_drops_strangers_and_junk_and_the_cluster_still_forms() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().world_size(3).handshake_timeout(Duration::from_millis(800)).build().unwrap();
        let seed = SeedNode::bind(loopback(), cfg.clone()).await.unwrap();
        let (addr, token) = (seed.local_addr(), seed.token().clone());

        // A silent connection: completes TLS, then says nothing.
        let silent = raw_seed_connection(addr, &token, &cfg).await;
        // A junk frame.
        let junk = raw_seed_connection(addr, &token, &cfg).await;
        let (mut send, _recv) = junk.open_bi().await.unwrap();
        send.write_all(b"\x7fthis is not a nexar frame").await.unwrap();
        // A 4 GiB announced length, with no body behind it.
        let huge = raw_seed_connection(addr, &token, &cfg).await;
        let (mut send_huge, _recv_huge) = huge.open_bi().await.unwrap();
        let mut header = vec![0x01u8];
        header.extend_from_slice(&(4u64 << 30).to_le_bytes());
        send_huge.write_all(&header).await.unwrap();
        // Raw UDP garbage at the seed's port.
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        for i in 0..50u8 {
            udp.send_to(&[i; 200], addr).unwrap();
        }

        // The real workers join while all that is going on.
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..3 {
            let (token, cfg) = (token.to_string(), cfg.clone());
            workers.spawn(async move { NexarClient::connect(addr, &token, cfg).await });
        }

        // A worker with the right CA but a wrong secret is refused by the seed.
        let mut wrong = token.to_string();
        let flip = if wrong.as_bytes()[7] == b'0' { "1" } else { "0" };
        wrong.replace_range(7..8, flip);
        let err = NexarClient::connect(addr, &wrong, cfg.clone()).await.unwrap_err();
        match &err {
            NexarError::Cluster(ClusterError::JoinRejected { reason, .. }) => {
                assert_eq!(reason, "invalid join token")
            }
            other => panic!("expected a refused join, got {other}"),
        }
        assert!(err.to_string().contains("refused the join: invalid join token"), "{err}");
        // A token naming another CA: the worker refuses the seed before sending its secret.
        let other_ca = ClusterCa::generate().unwrap();
        let foreign = format!("nexar1.{}.{}", "00".repeat(16), hex(&other_ca.fingerprint()));
        let err = NexarClient::connect(addr, &foreign, cfg.clone()).await.unwrap_err();
        assert!(matches!(&err, NexarError::Cluster(ClusterError::Transport(TransportError::Connect { .. }))), "{err}");
        assert!(err.to_string().contains("not from the CA named in the join token"), "{err}");
        assert!(err.to_string().contains("the token belongs to another seed or an earlier run"), "{err}");
        assert!(!err.to_string().contains("error 40"), "{err}");

        for conn in [&junk, &huge] {
            match closed_within(conn, Duration::from_secs(10)).await {
                quinn::ConnectionError::ApplicationClosed(close) => {
                    assert_eq!(&close.reason[..], b"invalid join request")
                }
                other => panic!("unexpected close: {other}"),
            }
        }
        closed_within(&silent, Duration::from_secs(10)).await;

        let mut ranks = Vec::new();
        while let Some(r) = workers.join_next().await {
            ranks.push(r.unwrap().expect("a real worker failed to join"));
        }
        ranks.sort_by_key(|c| c.rank());
        assert_eq!(ranks.iter().map(|c| c.rank()).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(seed.wait_formed().await.unwrap().len(), 3);
        ring_exchange(ranks).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_it_authenticates_a_stranger_gets_one_stream_and_a_place_among_a_capped_few() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().world_size(2).handshake_timeout(Duration::from_secs(3)).build().unwrap();
        let seed = SeedNode::bind(loopback(), cfg.clone()).await.unwrap();
        let (addr, token) = (seed.local_addr(), seed.token().clone());

        // One stream, the join stream; no second one, and none the other way.
        let conn = raw_seed_connection(addr, &token, &cfg).await;
        let (mut join, _recv) = conn.open_bi().await.unwrap();
        join.write_all(&[0x01]).await.unwrap();
        let wait = Duration::from_millis(500);
        assert!(tokio::time::timeout(wait, conn.open_bi()).await.is_err(), "a second stream was allowed");
        assert!(tokio::time::timeout(wait, conn.open_uni()).await.is_err(), "a unidirectional stream was allowed");

        // The seed serves a capped number of unauthenticated connections at once (64 for a
        // small cluster); one more is refused at once rather than held.
        let mut silent = vec![conn];
        while silent.len() < 64 {
            silent.push(raw_seed_connection(addr, &token, &cfg).await);
        }
        let endpoint = bind(loopback(), &cfg, None).unwrap();
        let client = with_transport(seed_client(Some(token.ca_fingerprint())).unwrap(), &cfg);
        let refused = endpoint.connect_with(client, addr, "seed.nexar").unwrap().await.unwrap_err();
        assert!(matches!(refused, quinn::ConnectionError::ConnectionClosed(_)), "{refused}");
        assert!(refused.to_string().contains("refused to accept a new connection"), "{refused}");

        // Once the silent ones have been dropped at the handshake timeout, workers join.
        for conn in &silent {
            closed_within(conn, Duration::from_secs(30)).await;
        }
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..2 {
            let (token, cfg) = (token.to_string(), cfg.clone());
            workers.spawn(async move { NexarClient::connect(addr, &token, cfg).await });
        }
        let mut ranks = Vec::new();
        while let Some(r) = workers.join_next().await {
            ranks.push(r.unwrap().expect("a real worker failed to join"));
        }
        ring_exchange(ranks).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_whose_certificates_expired_admits_nobody_more() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let cfg = NexarConfig::builder().world_size(2).cert_lifetime(Duration::from_secs(1)).build().unwrap();
        let seed = SeedNode::bind(loopback(), cfg.clone()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let err = NexarClient::connect(seed.local_addr(), &seed.token().to_string(), cfg).await.unwrap_err();
        // The worker refuses the seed's expired certificate, or (certificate times are whole
        // seconds) the seed refuses the join first: either way the error says why.
        let text = err.to_string();
        assert!(
            text.contains("the seed's certificate has expired") || text.contains("this seed's certificates expired"),
            "{text}"
        );
        assert!(text.contains("NEXAR_CERT_LIFETIME_HOURS"), "{text}");
    })
    .await
    .expect("test timed out");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_a_foreign_or_misbound_certificate_are_refused_and_the_mesh_forms() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ca = ClusterCa::generate().unwrap();
        let ca_der = ca.cert_der().to_vec();
        let addrs = free_addrs(2);
        let cfg = NexarConfig::builder().mesh_timeout(Duration::from_secs(60)).build().unwrap();

        // Rank 0 starts and waits for rank 1.
        let rank0 = {
            let (addrs, id, ca_der, cfg) =
                (addrs.clone(), ca.issue(&rank_server_name(0)).unwrap(), ca_der.to_vec(), cfg.clone());
            tokio::spawn(async move { NexarClient::connect_static(0, &addrs, &id, &ca_der, cfg).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;

        // A certificate from another CA, presented to rank 0: the TLS handshake fails.
        let other = ClusterCa::generate().unwrap();
        let foreign = other.issue(&rank_server_name(1)).unwrap();
        let ep = bind(loopback(), &cfg, None).unwrap();
        let attempt = ep
            .connect_with(with_transport(mesh_client(&foreign, &ca_der).unwrap(), &cfg), addrs[0], &rank_server_name(0))
            .unwrap()
            .await;
        let refused = match attempt {
            Err(e) => e.to_string(),
            Ok(conn) => closed_within(&conn, Duration::from_secs(10)).await.to_string(),
        };
        assert!(
            refused.contains("certificate") || refused.contains("crypto") || refused.contains("alert"),
            "{refused}"
        );

        // A certificate from the right CA bound to rank 2 (not a member): admitted by TLS,
        // then closed by rank 0 because that rank is not expected to dial it.
        let misbound = ca.issue(&rank_server_name(2)).unwrap();
        let conn = ep
            .connect_with(
                with_transport(mesh_client(&misbound, &ca_der).unwrap(), &cfg),
                addrs[0],
                &rank_server_name(0),
            )
            .unwrap()
            .await
            .unwrap();
        match closed_within(&conn, Duration::from_secs(10)).await {
            quinn::ConnectionError::ApplicationClosed(close) => {
                assert_eq!(&close.reason[..], b"unexpected rank")
            }
            other => panic!("unexpected close: {other}"),
        }

        // The real rank 1 still gets in.
        let id1 = ca.issue(&rank_server_name(1)).unwrap();
        let rank1 = NexarClient::connect_static(1, &addrs, &id1, &ca_der, cfg.clone()).await.unwrap();
        let rank0 = rank0.await.unwrap().unwrap();
        ring_exchange(vec![rank0, rank1]).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dialler_refuses_a_listener_whose_certificate_names_another_rank() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ca = ClusterCa::generate().unwrap();
        let ca_der = ca.cert_der().to_vec();
        let addrs = free_addrs(2);
        let cfg = NexarConfig::builder().mesh_timeout(Duration::from_secs(20)).build().unwrap();
        // An impostor listens where rank 0 should be, with a valid certificate for rank 2.
        let impostor = ca.issue(&rank_server_name(2)).unwrap();
        let listener =
            bind(addrs[0], &cfg, Some(server_with_transport(mesh_server(&impostor, &ca_der).unwrap(), &cfg))).unwrap();
        tokio::spawn(async move {
            while let Some(incoming) = listener.accept().await {
                tokio::spawn(async move {
                    let _ = incoming.await;
                });
            }
        });
        let id1 = ca.issue(&rank_server_name(1)).unwrap();
        let err = NexarClient::connect_static(1, &addrs, &id1, &ca_der, cfg).await.unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, NexarError::Cluster(ClusterError::Mesh { rank: 1, .. })), "{text}");
        assert!(text.contains("could not authenticate rank 0"), "{text}");
        assert!(text.contains("rank-0.nexar"), "{text}");
    })
    .await
    .expect("test timed out");
}

/// Ranks formed without a seed (`connect_static`), which nobody checks for agreement, offer
/// each other their lanes with how they seal them: a pair whose ciphers differ (AEGIS-128X2
/// on one, AES-128-GCM on the other), which could read none of each other's records, keeps
/// its collective payloads on QUIC (each rank logs why) and runs them correctly; a pair that
/// agrees takes the lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seedless_ranks_whose_lane_ciphers_differ_keep_quic_and_still_run_collectives() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ca = ClusterCa::generate().unwrap();
        let ca_der = ca.cert_der().to_vec();
        let base = NexarConfig::builder().mesh_timeout(Duration::from_secs(60)).shared_memory(false).build().unwrap();
        for (second, transport) in [(nexar::LaneCipher::Aegis128X2, "tcp-tls"), (nexar::LaneCipher::Aes128Gcm, "quic")]
        {
            let addrs = free_addrs(2);
            let ciphers = [nexar::LaneCipher::Aegis128X2, second];
            let joins: Vec<_> = (0..2)
                .map(|rank| {
                    let cfg = base.clone().into_builder().lane_cipher(ciphers[rank]).build().unwrap();
                    let (addrs, id, ca_der) =
                        (addrs.clone(), ca.issue(&rank_server_name(rank as u32)).unwrap(), ca_der.clone());
                    tokio::spawn(async move { NexarClient::connect_static(rank, &addrs, &id, &ca_der, cfg).await })
                })
                .collect();
            let mut set = tokio::task::JoinSet::new();
            for join in joins {
                let c = join.await.unwrap().unwrap();
                set.spawn(async move {
                    let peer = 1 - c.rank();
                    assert_eq!(c.bulk_transport(peer), Some(transport), "rank {}", c.rank());
                    let mut data: Vec<f32> = (0..300_000).map(|i| (i % 97) as f32).collect();
                    c.all_reduce(&mut data[..], ReduceOp::Sum).await.unwrap();
                    assert!(data.iter().enumerate().all(|(i, v)| *v == 2.0 * (i % 97) as f32));
                    c.shutdown().await;
                });
            }
            while let Some(r) = set.join_next().await {
                r.unwrap();
            }
        }
    })
    .await
    .expect("test timed out");
}
