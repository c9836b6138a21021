//! The contract every job store (`kiln_jobs::JobQueue`) keeps, written once and
//! run against each backend (`tests/tests/jobs_embedded_store.rs` on a redb file,
//! `tests/tests/jobs_redis_store.rs` on a real `redis-server`): priority then
//! submission order, idempotent results, all-or-none submission, cancel, release,
//! paging and expiry.

use std::time::{Duration, SystemTime};

use kiln_jobs::{
    CancelResult, ClaimedJob, JobId, JobQueue, JobState, JobsError, ListFilter, NewJob, Outcome,
};

/// Job `n` of `model` at `priority` (its request: `{"n": n}`).
pub fn job(model: &str, priority: u8, n: u32) -> kiln_jobs::queue::Result<NewJob> {
    Ok(NewJob {
        model: model.into(),
        priority,
        request: format!("{{\"n\":{n}}}").into_bytes(),
    })
}

/// The ids of claimed jobs, in order.
pub fn ids_of(jobs: &[ClaimedJob]) -> Vec<JobId> {
    jobs.iter().map(|j| j.id.clone()).collect()
}

/// Claims go by priority, then submission order; the first result stored wins.
/// Leaves one job of priority 5 queued.
pub fn claims_by_priority_then_order_and_results_are_idempotent(q: &dyn JobQueue) {
    let ids = q
        .enqueue(&mut [job("a", 5, 1), job("a", 1, 2), job("b", 5, 3)].into_iter())
        .unwrap();
    assert_eq!(ids.len(), 3);
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
}

/// A submission with a bad request after 600 good ones stores none of them.
pub fn a_bad_job_stores_nothing(q: &dyn JobQueue) {
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
}

/// Cancel (queued only), release, paging with filters, expiry of finished jobs,
/// and a released job running again.
pub fn cancel_release_list_and_expire(q: &dyn JobQueue) {
    let ids = q
        .enqueue(&mut (0..10).map(|n| job(if n % 2 == 0 { "even" } else { "odd" }, 5, n)))
        .unwrap();
    assert_eq!(q.cancel(&ids[0]).unwrap(), CancelResult::Cancelled);
    assert_eq!(
        q.cancel(&ids[0]).unwrap(),
        CancelResult::NotQueued(JobState::Cancelled)
    );
    for unknown in ["999", "../x"] {
        assert_eq!(
            q.cancel(&JobId(unknown.into())).unwrap(),
            CancelResult::NotFound
        );
    }
    // The cancelled job is never claimed.
    let claimed = q.claim("c", 1).unwrap();
    assert_eq!(ids_of(&claimed), [ids[1].clone()]);
    assert_eq!(
        q.cancel(&ids[1]).unwrap(),
        CancelResult::NotQueued(JobState::Running)
    );
    q.release(&[ids[1].clone()]).unwrap();
    assert_eq!(q.get(&ids[1]).unwrap().unwrap().state, JobState::Queued);
    assert_eq!(q.counts().unwrap().queued, 9);

    // Pages of 2 over the even model: 0 (cancelled, still listed), 2 | 4, 6 | 8.
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
    // The released job runs again, its unrun claim not counted; everything left
    // drains.
    let rest = q.claim("c", 100).unwrap();
    assert_eq!(rest.len(), 9);
    assert!(rest.iter().any(|j| j.id == ids[1]));
    assert_eq!(q.get(&ids[1]).unwrap().unwrap().attempts, 1);
}
