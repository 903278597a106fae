//! A hung job explains itself: ranks that call different collectives, and a rank that calls
//! nothing, are named by the stall inspector on every waiting rank (in the log, and in the
//! timeout error), and the flight-recorder dumps, read back by `nexar trace`, name the first
//! divergent sequence number and the ranks.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nexar::prelude::*;
use nexar::trace::{TraceConfig, TraceDump};

use crate::common;
use crate::common::TEST_LIMIT;

/// Everything this test process logs.
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Capture;

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn captured() -> String {
    String::from_utf8_lossy(&LOG.lock().unwrap()).into_owned()
}

fn trace_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nexar-stall-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Waits until `dir` holds a dump of each of `ranks`, each with an entry for which `ready`
/// holds.
async fn wait_for_dumps(dir: &Path, ranks: usize, ready: impl Fn(&TraceDump) -> bool) -> Vec<TraceDump> {
    let start = Instant::now();
    loop {
        if let Ok(dumps) = TraceDump::read_dir(dir)
            && dumps.len() == ranks
            && dumps.iter().all(&ready)
        {
            return dumps;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "dumps in {} never came", dir.display());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn different_collectives_and_a_silent_rank_are_named_by_every_waiting_rank() {
    common::alone(
        module_path!(),
        "different_collectives_and_a_silent_rank_are_named_by_every_waiting_rank",
        different_collectives_and_a_silent_rank_are_named_by_every_waiting_rank_body,
    );
}

/// In a process of its own, whose log subscriber is the capture below.
async fn different_collectives_and_a_silent_rank_are_named_by_every_waiting_rank_body() {
    let _ = tracing_subscriber::fmt().with_writer(|| Capture).with_ansi(false).try_init();
    let dir = trace_dir("diverge");
    let trace = TraceConfig { stall_warn: Duration::from_millis(400), dir: Some(dir.clone()), ..Default::default() };
    // A ring allreduce takes nothing from rank 2's broadcast parent (rank 0), so the calls do
    // not meet and fail at once with a mismatch, as they do under recursive doubling: they
    // stall, the case the inspector is for.
    let cfg = NexarConfig::builder()
        .op_timeout(Duration::from_secs(6))
        .allreduce_algorithm(nexar::Algorithm::Ring)
        .trace(trace)
        .build()
        .unwrap();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local_with(4, cfg).await.unwrap();
        // #0 completes everywhere.
        common::on_each(&ranks, |c| async move { c.all_reduce(&mut [1.0f32; 1024], Sum).await.unwrap() }).await;
        // #1: ranks 0 and 1 reduce, rank 2 broadcasts, rank 3 calls nothing.
        let waiting: Vec<_> = ranks[..3]
            .iter()
            .cloned()
            .map(|c| {
                tokio::spawn(async move {
                    let mut buf = [1.0f32; 1024];
                    match c.rank() {
                        2 => c.broadcast(&mut buf, 0).await,
                        _ => c.all_reduce(&mut buf, Sum).await,
                    }
                })
            })
            .collect();
        let mut errors = Vec::new();
        for w in waiting {
            errors.push(w.await.unwrap().expect_err("a diverged collective must fail").to_string());
        }
        let logs = captured();
        for rank in 0..3 {
            let line = logs
                .lines()
                .find(|l| l.contains("stalled:") && l.contains(&format!("rank={rank}")))
                .unwrap_or_else(|| panic!("rank {rank} logged no stall report; errors {errors:?}:\n{logs}"));
            assert!(line.contains("rank 3 last completed #0 and has started nothing since"), "rank {rank}: {line}");
            let disagreeing = if rank == 2 { "all_reduce #1" } else { "rank 2 is in broadcast #1 (root 0)" };
            assert!(line.contains(disagreeing), "rank {rank}: {line}");
            assert!(line.contains("the ranks called different collectives"), "rank {rank}: {line}");
        }
        // The first to time out says the same in its error. The others quote its abort, or,
        // when their own time ran out at the same moment, report on ranks that had just
        // failed (which they say).
        let full = |e: &&String| {
            e.contains("rank 3 last completed #0 and has started nothing since")
                && e.contains("the ranks called different collectives")
        };
        assert!(errors.iter().any(|e| e.contains("within 6s:") && full(&e)), "{errors:?}");
        for e in &errors {
            assert!(e.contains("within 6s:") && e.contains("rank 3 last completed #0"), "{e}");
        }

        // The waiting ranks dumped their recorders when they failed; SIGUSR1 dumps all four.
        wait_for_dumps(&dir, 3, |d| d.entries.iter().any(|e| e.seq == 1 && e.state == "failed")).await;
        let pid = std::process::id().to_string();
        let status = std::process::Command::new("kill").args(["-USR1", &pid]).status().unwrap();
        assert!(status.success());
        let dumps = wait_for_dumps(&dir, 4, |d| d.reason == "SIGUSR1").await;
        assert!(dumps.iter().all(|d| d.world == 4 && d.cluster == dumps[0].cluster));

        let out = std::process::Command::new(env!("CARGO_BIN_EXE_nexar")).arg("trace").arg(&dir).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "nexar trace failed: {}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("comm 0: first divergence at #1"), "{text}");
        assert!(text.contains("ranks [0, 1]: all_reduce f32 x1024, failed"), "{text}");
        assert!(text.contains("ranks [2]: broadcast f32 x1024 root 0, failed"), "{text}");
        assert!(text.contains("ranks [3]: nothing (last recorded #0)"), "{text}");
        // The errors of the ranks whose own time ran out (those that only quote another's
        // abort are left out).
        assert!(text.lines().any(|l| l.contains("failed: rank") && l.contains("within 6s:")), "{text}");
        assert!(!text.contains(": aborted: "), "{text}");
        for c in ranks {
            c.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "hostile-member")]
#[test]
fn a_report_made_after_the_peers_failed_names_what_each_was_last_seen_calling() {
    common::alone(
        module_path!(),
        "a_report_made_after_the_peers_failed_names_what_each_was_last_seen_calling",
        a_report_made_after_the_peers_failed_names_what_each_was_last_seen_calling_body,
    );
}

/// When every rank of a stall times out at once, a rank that asks where the others are after
/// they failed hears that they are in no collective. Here the order is made certain: ranks 0
/// and 1 call `all_reduce`, rank 2 `broadcast`, rank 3 nothing; once rank 0's warning has
/// asked where everyone is, rank 3 tells ranks 1 and 2 (not rank 0) that #1 was aborted, as a
/// peer that timed out first would, so they fail and rank 0 waits on. Its own report, at its
/// timeout, still names what ranks 1 and 2 had called, and how rank 2's call differs (before,
/// it said "ranks 1 and 2 last started #1, which did not complete").
#[cfg(feature = "hostile-member")]
async fn a_report_made_after_the_peers_failed_names_what_each_was_last_seen_calling_body() {
    let _ = tracing_subscriber::fmt().with_writer(|| Capture).with_ansi(false).try_init();
    let trace = TraceConfig { stall_warn: Duration::from_millis(400), ..Default::default() };
    // A ring allreduce takes nothing from rank 2's broadcast parent: the calls stall (see above).
    let cfg = NexarConfig::builder()
        .op_timeout(Duration::from_secs(8))
        .allreduce_algorithm(nexar::Algorithm::Ring)
        .trace(trace)
        .build()
        .unwrap();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local_with(4, cfg).await.unwrap();
        common::on_each(&ranks, |c| async move { c.all_reduce(&mut [1.0f32; 1024], Sum).await.unwrap() }).await;
        let waiting: Vec<_> = ranks[..3]
            .iter()
            .cloned()
            .map(|c| {
                tokio::spawn(async move {
                    let mut buf = [1.0f32; 1024];
                    match c.rank() {
                        2 => c.broadcast(&mut buf, 0).await,
                        _ => c.all_reduce(&mut buf, Sum).await,
                    }
                })
            })
            .collect();
        // Rank 0's warning: it has asked every member where it is, and kept the answers.
        let start = Instant::now();
        while !captured().lines().any(|l| l.contains("stalled:") && l.contains("rank=0")) {
            assert!(start.elapsed() < Duration::from_secs(60), "rank 0 logged no stall warning:\n{}", captured());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let member = nexar::hostile::HostileMember::new(&ranks[3]);
        let abort = nexar::proto::message::PeerMsg::Abort {
            comm: ranks[0].comm_id(),
            seq: 1,
            reason: "rank 3 gave up on #1 (for the test)".into(),
        };
        for peer in [1, 2] {
            member.link(peer).unwrap().send(&abort, None).await.unwrap();
        }
        let mut errors: Vec<String> = Vec::new();
        for w in waiting {
            errors.push(w.await.unwrap().expect_err("a diverged collective must fail").to_string());
        }
        for (rank, e) in errors.iter().enumerate().skip(1) {
            assert!(e.contains("rank 3 gave up on #1"), "rank {rank} failed otherwise: {e}");
        }
        // Rank 0 timed out on its own, after ranks 1 and 2 had failed.
        let report = &errors[0];
        assert!(report.contains("within 8s:"), "{report}");
        assert!(report.contains("rank 3 last completed #0 and has started nothing since"), "{report}");
        assert!(
            report.contains("rank 1 last started all_reduce #1 of 1024 f32, which did not complete"),
            "rank 1's call is not named: {report}"
        );
        assert!(
            report.contains("rank 2 last started broadcast #1 of 1024 f32 (root 0), which did not complete"),
            "rank 2's call is not named: {report}"
        );
        assert!(report.contains("(it failed or was cancelled) — the ranks called different collectives"), "{report}");
        for c in ranks {
            c.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dump_trace_writes_the_last_operations_of_every_kind() {
    let dir = trace_dir("manual");
    let trace = TraceConfig { entries: 50, dir: Some(dir.clone()), ..Default::default() };
    let cfg = NexarConfig::builder().trace(trace).build().unwrap();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
        common::on_each(&ranks, |c| async move {
            for _ in 0..60 {
                c.all_reduce(&mut [1u64; 16], Sum).await.unwrap();
            }
            let peer = 1 - c.rank();
            let (mut got, out) = ([0u32; 4], [c.rank() as u32; 4]);
            let (sent, received) = tokio::join!(c.send(&out, peer, 7), c.recv(&mut got, peer, 7));
            sent.unwrap();
            received.unwrap();
        })
        .await;
        let path = ranks[0].dump_trace().unwrap();
        let dump = TraceDump::read(&path).unwrap();
        assert_eq!(dump.reason, "manual");
        assert_eq!(dump.entries.len(), 50, "the ring keeps NEXAR_TRACE_ENTRIES entries");
        let last_coll = dump.entries.iter().rfind(|e| e.class == "collective").unwrap();
        assert_eq!((last_coll.seq, last_coll.op.as_str(), last_coll.state.as_str()), (59, "all_reduce", "completed"));
        assert_eq!(last_coll.dtype.as_deref(), Some("u64"));
        assert!(last_coll.algorithm.is_some());
        let send = dump.entries.iter().find(|e| e.class == "send").unwrap();
        assert_eq!((send.peer, send.seq, send.bytes, send.state.as_str()), (Some(1), 7, 16, "completed"));
        assert!(dump.entries.iter().any(|e| e.class == "recv" && e.peer == Some(1)));
        for c in ranks {
            c.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
    let _ = std::fs::remove_dir_all(&dir);
}
