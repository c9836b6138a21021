//! The Redis Streams job store's semantics against a real `redis-server` (one per
//! test, on a free loopback port): the same guarantees as the embedded store
//! (priority then submission order, idempotent results, all-or-none submission,
//! cancel, release, paging, expiry), plus what a shared queue adds: two stores
//! (two replicas) never claim the same job, and a dead consumer's jobs are taken
//! over with XAUTOCLAIM after the claim timeout.

// Test code: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, SystemTime};

use kiln_jobs::redis_streams::RedisQueue;
use kiln_jobs::{CancelResult, JobId, JobQueue, JobState, JobsError, ListFilter, NewJob, Outcome};
use kiln_tests::redis::RedisServer;

fn job(model: &str, priority: u8, n: u32) -> kiln_jobs::queue::Result<NewJob> {
    Ok(NewJob {
        model: model.into(),
        priority,
        request: format!("{{\"n\":{n}}}").into_bytes(),
    })
}

fn ids_of(jobs: &[kiln_jobs::ClaimedJob]) -> Vec<JobId> {
    jobs.iter().map(|j| j.id.clone()).collect()
}

#[test]
fn claims_by_priority_then_order_and_results_are_idempotent() {
    let redis = RedisServer::start();
    let q = RedisQueue::open(&redis.url()).unwrap();
    let ids = q
        .enqueue(&mut [job("a", 5, 1), job("a", 1, 2), job("b", 5, 3)].into_iter())
        .unwrap();
    assert_eq!(ids.len(), 3);
    // The request lives in the job's hash: the stream entries hold ids only.
    assert_eq!(redis.integer(&["XLEN", "kiln:jobs:stream:5"]), 2);
    let claimed = q.claim("c1", 2).unwrap();
    assert_eq!(claimed[0].id, ids[1], "priority 1 first");
    assert_eq!(claimed[1].id, ids[0]);
    assert_eq!(claimed[1].request, b"{\"n\":1}");
    assert_eq!(claimed[1].model, "a");
    assert_eq!(q.get(&ids[0]).unwrap().unwrap().state, JobState::Running);
    q.complete(&[(ids[0].clone(), Outcome::Done(b"first".to_vec()))])
        .unwrap();
    q.complete(&[(ids[0].clone(), Outcome::Done(b"second".to_vec()))])
        .unwrap();
    let done = q.get(&ids[0]).unwrap().unwrap();
    assert_eq!(done.state, JobState::Done);
    assert_eq!(done.response.as_deref(), Some(&b"first"[..]));
    assert_eq!(done.attempts, 1);
    q.complete(&[(ids[1].clone(), Outcome::Failed("boom".into()))])
        .unwrap();
    assert_eq!(
        q.get(&ids[1]).unwrap().unwrap().error.as_deref(),
        Some("boom")
    );
    let counts = q.counts().unwrap();
    assert_eq!(
        (counts.queued, counts.running, counts.done, counts.failed),
        (1, 0, 1, 1)
    );
    // Acknowledged only with the result: nothing pending, the entries gone.
    assert_eq!(redis.integer(&["XLEN", "kiln:jobs:stream:1"]), 0);
    assert_eq!(redis.integer(&["XLEN", "kiln:jobs:stream:5"]), 1);
}

#[test]
fn a_bad_job_stores_nothing() {
    let redis = RedisServer::start();
    let q = RedisQueue::open(&redis.url()).unwrap();
    // More than one chunk (512) written before the bad one.
    let mut input =
        (0..600)
            .map(|n| job("a", 5, n))
            .chain(std::iter::once(Err(JobsError::Invalid(
                "line 601: bad".into(),
            ))));
    assert_eq!(
        q.enqueue(&mut input),
        Err(JobsError::Invalid("line 601: bad".into()))
    );
    assert_eq!(q.counts().unwrap().queued, 0);
    assert!(q
        .list(&ListFilter::default(), None, 10)
        .unwrap()
        .jobs
        .is_empty());
    assert!(q.claim("c", 10).unwrap().is_empty());
    assert!(redis.integer(&["DBSIZE"]) <= 12, "staged jobs removed");
}

#[test]
fn cancel_release_list_and_expire() {
    let redis = RedisServer::start();
    let q = RedisQueue::open(&redis.url()).unwrap();
    let ids = q
        .enqueue(&mut (0..10).map(|n| job(if n % 2 == 0 { "even" } else { "odd" }, 5, n)))
        .unwrap();
    assert_eq!(q.cancel(&ids[0]).unwrap(), CancelResult::Cancelled);
    assert_eq!(
        q.cancel(&ids[0]).unwrap(),
        CancelResult::NotQueued(JobState::Cancelled)
    );
    assert_eq!(
        q.cancel(&JobId("999".into())).unwrap(),
        CancelResult::NotFound
    );
    assert_eq!(
        q.cancel(&JobId("../x".into())).unwrap(),
        CancelResult::NotFound
    );
    // The cancelled job's entry is dropped unrun by the claim.
    let claimed = q.claim("c", 1).unwrap();
    assert_eq!(ids_of(&claimed), [ids[1].clone()]);
    assert_eq!(
        q.cancel(&ids[1]).unwrap(),
        CancelResult::NotQueued(JobState::Running)
    );
    q.release(&[ids[1].clone()]).unwrap();
    assert_eq!(q.get(&ids[1]).unwrap().unwrap().state, JobState::Queued);
    assert_eq!(q.counts().unwrap().queued, 9);

    let filter = ListFilter {
        model: Some("even".into()),
        state: None,
    };
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = q.list(&filter, after.as_deref(), 2).unwrap();
        seen.extend(page.jobs.iter().map(|j| j.id.clone()));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, [0, 2, 4, 6, 8].map(|i| ids[i].clone()));
    let cancelled = ListFilter {
        model: None,
        state: Some(JobState::Cancelled),
    };
    assert_eq!(q.list(&cancelled, None, 100).unwrap().jobs.len(), 1);
    assert!(matches!(
        q.list(&ListFilter::default(), Some("x"), 10),
        Err(JobsError::Invalid(_))
    ));

    assert_eq!(
        q.expire(SystemTime::now() - Duration::from_secs(60))
            .unwrap(),
        0
    );
    assert_eq!(
        q.expire(SystemTime::now() + Duration::from_secs(1))
            .unwrap(),
        1
    );
    assert!(q.get(&ids[0]).unwrap().is_none());
    assert_eq!(q.counts().unwrap().cancelled, 0);
    // The released job runs again; everything left drains.
    let rest = q.claim("c", 100).unwrap();
    assert_eq!(rest.len(), 9);
    assert!(rest.iter().any(|j| j.id == ids[1]));
    assert_eq!(q.get(&ids[1]).unwrap().unwrap().attempts, 2);
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
