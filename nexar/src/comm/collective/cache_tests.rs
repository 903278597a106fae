//! Tests of the schedule cache.

use super::{CACHED_SCHEDULES, ScheduleCache, ScheduleKey};
use crate::prelude::*;
use crate::proto::algo::{Algorithm, Collective};
use crate::proto::schedule::Schedule;
use std::sync::Arc;

#[test]
fn the_schedule_cache_finds_what_it_kept_and_stays_bounded() {
    let key = |count| ScheduleKey {
        kind: Collective::AllReduce,
        algorithm: Algorithm::Ring,
        rank: 0,
        world: 2,
        count,
        elem: 4,
        hosts_known: false,
    };
    let cache = ScheduleCache::new();
    assert!(cache.get(&key(1)).is_none());
    let kept = Arc::new(Schedule::new());
    cache.keep(key(1), kept.clone());
    assert!(Arc::ptr_eq(&cache.get(&key(1)).unwrap(), &kept));
    assert!(cache.get(&key(2)).is_none(), "another count is another schedule");
    for count in 2..=CACHED_SCHEDULES + 1 {
        cache.keep(key(count), Arc::new(Schedule::new()));
    }
    assert!(crate::sync::lock(&cache.kept).len() <= CACHED_SCHEDULES);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_numbers_run_past_2_pow_32_without_collisions() {
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    for c in &ranks {
        c.comm.set_seq(u64::from(u32::MAX) - 3);
    }
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                for i in 0..10u32 {
                    let mut v = [i, c.rank() as u32];
                    c.all_reduce(&mut v, Sum).await.unwrap();
                    assert_eq!(v, [2 * i, 1]);
                }
                c.comm.next_seq()
            })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap() > u64::from(u32::MAX) + 5);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_call_reuses_its_communicators_schedule() {
    use crate::comm::exec::CollCall;
    let ranks = NexarClient::bootstrap_local(2).await.unwrap();
    let c = &ranks[0];
    let call = |count| CollCall::whole(Collective::AllReduce, Some(ReduceOp::Sum), count, 0);
    let first = c.schedule_for::<f32>(0, &call(1024), None).unwrap();
    let again = c.schedule_for::<f32>(1, &call(1024), None).unwrap();
    assert!(Arc::ptr_eq(&first, &again), "a repeated call must not be planned again");
    let other = c.schedule_for::<f32>(2, &call(1000), None).unwrap();
    assert!(!Arc::ptr_eq(&first, &other), "another count is another schedule");
    // A plan's own cache is used where one is given, and the communicator's is left alone.
    let plan = ScheduleCache::new();
    let planned = c.schedule_for::<f32>(3, &call(4096), Some(&plan)).unwrap();
    assert!(Arc::ptr_eq(&planned, &c.schedule_for::<f32>(4, &call(4096), Some(&plan)).unwrap()));
    assert_eq!(crate::sync::lock(&plan.kept).len(), 1);
    assert_eq!(crate::sync::lock(&c.comm.schedules.kept).len(), 2);
    // Runs still agree with the schedules kept.
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                for i in 0..3u32 {
                    let mut v = vec![i as f32; 1024];
                    c.all_reduce(&mut v, Sum).await.unwrap();
                    assert!(v.iter().all(|x| *x == 2.0 * i as f32));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}
