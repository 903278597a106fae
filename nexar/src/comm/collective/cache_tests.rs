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
