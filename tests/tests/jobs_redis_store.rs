//! The Redis Streams job store against a real `redis-server` (one per test, on a
//! free loopback port): the stores' shared contract (`kiln_tests::job_store`) and
//! how Redis holds it (requests in the jobs' hashes, entries acknowledged with the
//! result), plus what a shared queue adds: two stores (two replicas) never claim
//! the same job, and a dead consumer's jobs are taken over with XAUTOCLAIM after
//! the claim timeout; a submission whose submitter died is never claimed while
//! staged, and is deleted (staged) or published (committed) by a reclaim round
//! once its lease lapsed.

// Test code: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use kiln_jobs::redis_streams::{RedisQueue, CHUNK_JOBS};
use kiln_jobs::{JobQueue, JobState, JobsError, ListFilter, Outcome};
use kiln_tests::job_store::{self, ids_of, job};
use kiln_tests::redis::RedisServer;

#[test]
fn claims_by_priority_then_order_and_results_are_idempotent() {
    let redis = RedisServer::start();
    let q = RedisQueue::open(&redis.url()).unwrap();
    job_store::claims_by_priority_then_order_and_results_are_idempotent(&q);
    // Acknowledged and deleted only with the result: the one job left queued is
    // the only entry; the requests live in the jobs' hashes.
    assert_eq!(redis.integer(&["XLEN", "kiln:jobs:stream:1"]), 0);
    assert_eq!(redis.integer(&["XLEN", "kiln:jobs:stream:5"]), 1);
    assert_eq!(redis.pending("kiln:jobs:stream:5", "kiln"), 0);
}

#[test]
fn a_bad_job_stores_nothing() {
    let redis = RedisServer::start();
    let q = RedisQueue::open(&redis.url()).unwrap();
    // More than one chunk is written before the bad one: staged, then removed.
    job_store::a_bad_job_stores_nothing(&q);
    assert!(redis.integer(&["DBSIZE"]) <= 12, "staged jobs removed");
}

#[test]
fn cancel_release_list_and_expire() {
    let redis = RedisServer::start();
    let q = RedisQueue::open(&redis.url()).unwrap();
    job_store::cancel_release_list_and_expire(&q);
}

#[test]
fn two_replicas_share_the_queue_and_a_dead_ones_jobs_are_reclaimed() {
    let redis = RedisServer::start();
    let a = RedisQueue::open(&redis.url()).unwrap();
    let b = RedisQueue::open(&redis.url()).unwrap();
    let ids = a.enqueue(&mut (0..20).map(|n| job("m", 5, n))).unwrap();
    let from_a = a.claim("a", 6).unwrap();
    let from_b = b.claim("b", 100).unwrap();
    assert_eq!(from_a.len() + from_b.len(), 20);
    assert!(from_a.iter().all(|j| !from_b.contains(j)), "no job twice");
    // `a` finishes two, then dies with four running.
    a.complete(&[
        (from_a[0].id.clone(), Outcome::Done(b"a0".to_vec())),
        (from_a[1].id.clone(), Outcome::Done(b"a1".to_vec())),
    ])
    .unwrap();
    drop(a);
    assert_eq!(
        b.reclaim("b", Duration::from_secs(3600)).unwrap(),
        0,
        "not idle long enough"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(redis.pending("kiln:jobs:stream:5", "kiln"), 18);
    // b's own running jobs stay its own (kept fresh); a's four come back.
    assert_eq!(b.reclaim("b", Duration::from_millis(20)).unwrap(), 4);
    let counts = b.counts().unwrap();
    assert_eq!((counts.queued, counts.running), (4, 14));
    let again = b.claim("b", 100).unwrap();
    assert_eq!(
        ids_of(&again),
        ids_of(&from_a[2..]),
        "the dead one's jobs, again"
    );
    let all: Vec<_> = from_b.iter().chain(&again).collect();
    b.complete(
        &all.iter()
            .map(|j| (j.id.clone(), Outcome::Done(j.id.0.clone().into_bytes())))
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let page = b.list(&ListFilter::default(), None, 100).unwrap();
    assert_eq!(page.jobs.len(), 20);
    assert!(page.jobs.iter().all(|j| j.state == JobState::Done));
    assert_eq!(b.counts().unwrap().done, 20);
    // Every entry acknowledged: nothing pending in the group.
    assert_eq!(redis.pending("kiln:jobs:stream:5", "kiln"), 0);
    assert_eq!(redis.integer(&["XLEN", "kiln:jobs:stream:5"]), 0);
    let _ = ids;
}

#[test]
fn a_restarted_consumer_gets_its_previous_lifes_jobs_back() {
    let redis = RedisServer::start();
    let old = RedisQueue::open(&redis.url()).unwrap();
    old.enqueue(&mut (0..3).map(|n| job("m", 5, n))).unwrap();
    let first = old.claim("kiln-a", 3).unwrap();
    drop(old);
    std::thread::sleep(Duration::from_millis(20));
    // The same consumer name, a new process.
    let new = RedisQueue::open(&redis.url()).unwrap();
    assert_eq!(new.reclaim("kiln-a", Duration::from_millis(1)).unwrap(), 3);
    let again = new.claim("kiln-a", 3).unwrap();
    assert_eq!(ids_of(&again), ids_of(&first));
    // A late result from the first run and one from the second: the first stored wins.
    new.complete(&[(first[0].id.clone(), Outcome::Done(b"late".to_vec()))])
        .unwrap();
    new.complete(&[(again[0].id.clone(), Outcome::Done(b"again".to_vec()))])
        .unwrap();
    let job = new.get(&first[0].id).unwrap().unwrap();
    assert_eq!(job.response.as_deref(), Some(&b"late"[..]));
    assert_eq!(job.attempts, 2);
    assert_eq!(new.counts().unwrap().done, 1);
}

#[test]
fn an_unreachable_redis_is_a_clear_error() {
    let redis = RedisServer::start();
    let url = redis.url();
    let q = RedisQueue::open(&url).unwrap();
    drop(redis);
    match q.enqueue(&mut std::iter::once(job("m", 5, 0))) {
        Err(JobsError::Store(msg)) => assert!(msg.contains("redis"), "{msg}"),
        other => panic!("expected a store error, got {other:?}"),
    }
    assert!(matches!(
        RedisQueue::open(&url),
        Err(JobsError::Config(msg)) if msg.contains("cannot connect")
    ));
}

/// Stages a submission of `n` jobs whose submitter dies (a panic stands for the
/// process's end) before its commit.
fn stage_and_die(q: &RedisQueue, n: usize) {
    let died = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut input = (0..).map(|i| match i < n {
            true => job("m", 5, i as u32),
            false => panic!("the submitter dies"),
        });
        q.enqueue(&mut input)
    }));
    assert!(died.is_err());
}

/// Lets the lease of every submission in `set` (`staging`, `publishing`) lapse.
fn lapse(redis: &RedisServer, set: &str) -> i64 {
    let lapse = "local ts = redis.call('ZRANGE', KEYS[1], 0, -1) \
                 for _, t in ipairs(ts) do redis.call('ZADD', KEYS[1], 1, t) end return #ts";
    redis.integer(&["EVAL", lapse, "1", &format!("kiln:jobs:{set}")])
}

fn job_hashes(redis: &RedisServer) -> i64 {
    redis.integer(&["EVAL", "return #redis.call('KEYS', 'kiln:jobs:job:*')", "0"])
}

#[test]
fn a_submission_its_submitter_left_is_never_claimed_and_is_tidied_up() {
    let redis = RedisServer::start();
    let q = RedisQueue::open(&redis.url()).unwrap();
    let staged = 2 * CHUNK_JOBS + 10;
    stage_and_die(&q, staged);
    // Staged (two chunks), and invisible: nothing to claim, list or count.
    assert_eq!(job_hashes(&redis), 2 * CHUNK_JOBS as i64);
    assert!(q.claim("c", 100).unwrap().is_empty());
    assert_eq!(q.counts().unwrap().queued, 0);
    let page = q.list(&ListFilter::default(), None, 100).unwrap();
    assert!(page.jobs.is_empty());
    // Within its lease a reclaim round leaves it (its submitter may be alive).
    q.reclaim("c", Duration::from_millis(1)).unwrap();
    assert_eq!(job_hashes(&redis), 2 * CHUNK_JOBS as i64);
    // Once it lapsed, a reclaim round deletes it.
    assert_eq!(lapse(&redis, "staging"), 1);
    q.reclaim("c", Duration::from_millis(1)).unwrap();
    assert_eq!(job_hashes(&redis), 0);
    for key in ["staging", "aborting", "publishing"] {
        assert_eq!(redis.integer(&["EXISTS", &format!("kiln:jobs:{key}")]), 0);
    }

    // A submission committed (as `COMMIT` does) whose submitter died before it
    // was published: accepted, so a reclaim round publishes it once it lapsed.
    stage_and_die(&q, CHUNK_JOBS + 1);
    let commit = "local t = redis.call('ZRANGE', KEYS[1], 0, 0)[1] \
                  redis.call('ZREM', KEYS[1], t) \
                  local n = redis.call('LLEN', 'kiln:jobs:sub:' .. t) \
                  redis.call('HINCRBY', 'kiln:jobs:counts', 'queued', n) \
                  redis.call('ZADD', KEYS[2], 1, t) return n";
    let committed = redis.integer(&[
        "EVAL",
        commit,
        "2",
        "kiln:jobs:staging",
        "kiln:jobs:publishing",
    ]);
    assert_eq!(committed, CHUNK_JOBS as i64);
    assert_eq!(q.counts().unwrap().queued, CHUNK_JOBS as u64);
    assert!(q.claim("c", 1).unwrap().is_empty(), "not published yet");
    q.reclaim("c", Duration::from_millis(1)).unwrap();
    let claimed = q.claim("c", 2 * CHUNK_JOBS).unwrap();
    assert_eq!(claimed.len(), CHUNK_JOBS, "every committed job, once");
    let requests: Vec<&[u8]> = claimed.iter().map(|j| j.request.as_slice()).collect();
    assert_eq!(requests[0], b"{\"n\":0}", "in submission order");
    assert_eq!(redis.integer(&["EXISTS", "kiln:jobs:publishing"]), 0);
    let page = q.list(&ListFilter::default(), None, 1000).unwrap();
    assert_eq!(page.jobs.len(), CHUNK_JOBS);
}
