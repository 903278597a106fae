//! Large allreduces run as consecutive segments (`NexarConfig::segment_bytes`):
//! the results equal the sequential reference, ranks that split differently fail on the first
//! segment before anything is reduced, and a buffer with its own segment stage (as device
//! memory has) is driven so that the copies of neighbouring segments overlap each segment's
//! network time.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nexar::prelude::*;
use nexar::{CollectiveError, DeviceError, HostStage, HostView, NexarConfig, RecvBuf, SegmentStage, SendBuf};

use crate::common::{TEST_LIMIT, logs, on_each, value};

/// A cluster whose collectives split buffers of more than `bytes`.
async fn cluster(n: usize, bytes: usize) -> Vec<NexarClient> {
    let config = NexarConfig::builder().segment_bytes(bytes).build().unwrap();
    NexarClient::bootstrap_local_with(n, config).await.unwrap()
}

async fn shutdown_all(ranks: Vec<NexarClient>) {
    on_each(&ranks, |c| async move { c.shutdown().await }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_allreduces_equal_the_reference() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        // 4,000-byte segments: 500 i64 or 1,000 f32 elements.
        let ranks = cluster(3, 4000).await;
        on_each(&ranks, |c| async move {
            let (r, w) = (c.rank(), c.world_size());
            for count in [501usize, 1000, 7919, 100_003] {
                let mine: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
                let sum: Vec<i64> = (0..count).map(|i| (0..w).map(|q| value(q, i)).sum()).collect();

                let mut buf = mine.clone();
                c.all_reduce(&mut buf, Sum).await.unwrap();
                assert_eq!(buf, sum, "all_reduce, count {count}");
                let mut f: Vec<f32> = mine.iter().map(|v| *v as f32).collect();
                c.all_reduce(&mut f, ReduceOp::Max).await.unwrap();
                let max = |i: usize| (0..w).map(|q| value(q, i)).max().unwrap() as f32;
                assert!(f.iter().enumerate().all(|(i, v)| *v == max(i)), "all_reduce f32 max, count {count}");

                // Rank 0 starts it in the background, the others call it: the same split.
                let out = if r == 0 {
                    c.all_reduce_start(Buf::from_vec(mine.clone()), Sum).await.unwrap().into_vec()
                } else {
                    let mut v = mine.clone();
                    c.all_reduce(&mut v, Sum).await.unwrap();
                    v
                };
                assert_eq!(out, sum, "blocking and non-blocking forms, count {count}");
            }
        })
        .await;
        shutdown_all(ranks).await;
        // Segments whose messages take the TCP lane: 2 MiB, the last one shorter.
        let ranks = cluster(2, 2 << 20).await;
        on_each(&ranks, |c| async move {
            let count = 1_000_003;
            let mut buf: Vec<f32> = (0..count).map(|i| (value(c.rank(), i) % 64) as f32).collect();
            c.all_reduce(&mut buf, Sum).await.unwrap();
            let want = |i: usize| ((value(0, i) % 64) + (value(1, i) % 64)) as f32;
            assert!(buf.iter().enumerate().all(|(i, v)| *v == want(i)));
        })
        .await;
        shutdown_all(ranks).await;
    })
    .await
    .expect("test timed out");
}

/// Rank `odd` passes `odd_count` elements, the others `count`: every rank fails within 2 s on
/// the first segment naming both counts, and the next call works.
async fn disagree_on_count(count: usize, odd_count: usize) {
    let ranks = cluster(4, 1000).await; // 250 i32 per segment
    let results = on_each(&ranks, move |c| async move {
        let n = if c.rank() == 1 { odd_count } else { count };
        let mut buf: Vec<i32> = (0..n).map(|i| value(c.rank(), i) as i32).collect();
        let start = Instant::now();
        let err = c.all_reduce(&mut buf, Sum).await.expect_err("a disagreement must fail on every rank");
        let took = start.elapsed();
        let mut next = vec![c.rank() as u64; 1001];
        c.all_reduce(&mut next, Sum).await.unwrap();
        assert_eq!(next, vec![6; 1001], "the next (split) call works");
        (c.rank(), err, took)
    })
    .await;
    for (rank, err, took) in &results {
        assert!(*took < Duration::from_secs(2), "rank {rank} took {took:?} to fail: {err}");
        assert!(
            matches!(err, CollectiveError::Mismatch { .. } | CollectiveError::Aborted { .. }),
            "rank {rank}: {err}"
        );
    }
    let text = results.iter().map(|(_, e, _)| e.to_string()).collect::<Vec<_>>().join("\n");
    assert!(text.contains(&format!("passed {odd_count}")), "{text}");
    shutdown_all(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_split_differently_fail_before_reducing_anything() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        disagree_on_count(2600, 2000).await; // 11 against 8 segments
        disagree_on_count(2600, 200).await; // split against whole
        disagree_on_count(251, 250).await; // two segments against one
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_configured_to_split_differently_are_told_so() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let configs = [1000, 1000, 0]
            .map(|segment_bytes| NexarConfig::builder().segment_bytes(segment_bytes).build().unwrap())
            .to_vec();
        let ranks = NexarClient::bootstrap_local_each(configs).await.unwrap();
        let results = on_each(&ranks, |c| async move {
            let start = Instant::now();
            let err = c.all_reduce(&mut vec![1i32; 600], Sum).await.expect_err("every rank fails");
            let took = start.elapsed();
            let mut next = vec![1i32; 200]; // split by nobody
            c.all_reduce(&mut next, Sum).await.unwrap();
            assert_eq!(next, vec![3; 200]);
            (c.rank(), err, took)
        })
        .await;
        for (rank, err, took) in &results {
            assert!(*took < Duration::from_secs(2), "rank {rank} took {took:?}: {err}");
            assert!(err.to_string().contains("NEXAR_SEGMENT_BYTES differs"), "rank {rank}: {err}");
        }
        let text = results.iter().map(|(_, e, _)| e.to_string()).collect::<Vec<_>>().join("\n");
        assert!(text.contains("runs it whole") && text.contains("segments of 250 elements"), "{text}");
        shutdown_all(ranks).await;
    })
    .await
    .expect("test timed out");
}

/// What a [`Mirror`]'s stage was asked, in order.
#[derive(Clone, Debug, PartialEq)]
enum Event {
    Prefetch(Range<usize>),
    Host(Range<usize>),
    WriteBack(Range<usize>),
    Finish,
}

/// A buffer kept away from the collective, as device memory is: it is only reached through
/// copies its stage makes, and the stage records what it was asked. `fail_at` makes the
/// stage fail to bring that segment to host memory.
struct Mirror {
    far: Vec<i64>,
    log: Arc<Mutex<Vec<Event>>>,
    fail_at: Option<usize>,
}

impl SendBuf for Mirror {
    type Elem = i64;
    fn elems(&self) -> usize {
        self.far.len()
    }
    fn host_view(&self) -> Result<HostView<'_, i64>, DeviceError> {
        Ok(HostView::Copied(self.far.clone()))
    }
}

impl RecvBuf for Mirror {
    fn host_stage(&mut self) -> Result<HostStage<'_, i64>, DeviceError> {
        Ok(HostStage::borrowed(&mut self.far))
    }

    fn segment_stage(&mut self, _segment: usize) -> Result<Box<dyn SegmentStage<i64> + Send + '_>, DeviceError> {
        Ok(Box::new(MirrorStage { mirror: self, staged: VecDeque::new(), done: 0 }))
    }
}

struct MirrorStage<'a> {
    mirror: &'a mut Mirror,
    /// Segments copied to "host memory" and not yet written back.
    staged: VecDeque<(Range<usize>, Vec<i64>)>,
    done: usize,
}

impl MirrorStage<'_> {
    fn log(&self, e: Event) {
        self.mirror.log.lock().unwrap().push(e);
    }
}

impl SegmentStage<i64> for MirrorStage<'_> {
    fn len(&self) -> usize {
        self.mirror.far.len()
    }
    fn prefetch(&mut self, range: Range<usize>) -> Result<(), DeviceError> {
        assert!(self.staged.len() < 2, "at most two segments in flight");
        self.log(Event::Prefetch(range.clone()));
        let copy = self.mirror.far[range.clone()].to_vec();
        self.staged.push_back((range, copy));
        Ok(())
    }
    fn host(&mut self) -> Result<&mut [i64], DeviceError> {
        let range = self.staged.front().unwrap().0.clone();
        self.log(Event::Host(range));
        if self.mirror.fail_at == Some(self.done) {
            return Err(DeviceError::Driver { op: "copying a segment to the host", device: 0, reason: "test".into() });
        }
        Ok(&mut self.staged.front_mut().unwrap().1)
    }
    fn write_back(&mut self) -> Result<(), DeviceError> {
        let (range, data) = self.staged.pop_front().unwrap();
        self.log(Event::WriteBack(range.clone()));
        self.mirror.far[range].copy_from_slice(&data);
        self.done += 1;
        Ok(())
    }
    fn finish(&mut self) -> Result<(), DeviceError> {
        self.log(Event::Finish);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_buffer_copies_the_next_segment_before_this_one_goes_out() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = cluster(2, 800).await; // 100 i64 per segment
        let logs = on_each(&ranks, |c| async move {
            let (r, w) = (c.rank(), c.world_size());
            let count = 350;
            let log = Arc::new(Mutex::new(Vec::new()));
            let mut m = Mirror { far: (0..count).map(|i| value(r, i)).collect(), log: log.clone(), fail_at: None };
            c.all_reduce(&mut m, Sum).await.unwrap();
            let sum: Vec<i64> = (0..count).map(|i| (0..w).map(|q| value(q, i)).sum()).collect();
            assert_eq!(m.far, sum);
            // Other collectives stage it whole.
            let mut b = Mirror { far: vec![r as i64; count], log: Arc::default(), fail_at: None };
            c.broadcast(&mut b, 0).await.unwrap();
            assert_eq!(b.far, vec![0; count]);
            assert!(b.log.lock().unwrap().is_empty(), "a broadcast is not split");
            log.lock().unwrap().clone()
        })
        .await;
        let seg = |k: usize| k * 100..((k + 1) * 100).min(350);
        use Event::*;
        let want = vec![
            Prefetch(seg(0)),
            Prefetch(seg(1)),
            Host(seg(0)),
            WriteBack(seg(0)),
            Prefetch(seg(2)),
            Host(seg(1)),
            WriteBack(seg(1)),
            Prefetch(seg(3)),
            Host(seg(2)),
            WriteBack(seg(2)),
            Host(seg(3)),
            WriteBack(seg(3)),
            Finish,
        ];
        for log in logs {
            assert_eq!(log, want);
        }
        shutdown_all(ranks).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_fails_midway_fails_every_rank_and_the_next_call_works() {
    logs();
    tokio::time::timeout(TEST_LIMIT, async {
        let ranks = cluster(3, 800).await;
        let results = on_each(&ranks, |c| async move {
            let fail_at = (c.rank() == 2).then_some(2);
            let mut m = Mirror { far: vec![1; 1000], log: Arc::default(), fail_at };
            let start = Instant::now();
            let err = c.all_reduce(&mut m, Sum).await.expect_err("every rank fails");
            let took = start.elapsed();
            // Rank 2 finished segments 0 and 1; the others may not have received all of
            // segment 1 before its abort. Each segment holds its result or its old values,
            // and none from segment 2 on was written anywhere.
            let done: Vec<i64> =
                m.far.chunks(100).map(|s| if s.iter().all(|v| *v == s[0]) { s[0] } else { -1 }).collect();
            assert!(done[..2].iter().all(|v| [1, 3].contains(v)), "rank {}: {done:?}", c.rank());
            assert!(done[2..].iter().all(|v| *v == 1), "rank {}: {done:?}", c.rank());
            if c.rank() == 2 {
                assert_eq!(done[..2], [3, 3], "rank 2 wrote back what it finished");
            }
            let mut next = vec![1u8; 5000];
            c.all_reduce(&mut next, Sum).await.unwrap();
            assert_eq!(next, vec![3; 5000]);
            (c.rank(), err, took)
        })
        .await;
        for (rank, err, took) in &results {
            assert!(*took < Duration::from_secs(2), "rank {rank} took {took:?}: {err}");
            let want = if *rank == 2 { "test" } else { "rank 2" };
            assert!(err.to_string().contains(want), "rank {rank}: {err}");
        }
        assert!(matches!(results[2].1, CollectiveError::Device { .. }), "{}", results[2].1);
        shutdown_all(ranks).await;
    })
    .await
    .expect("test timed out");
}
