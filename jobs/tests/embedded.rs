//! The embedded store's semantics, on a real redb file in a fresh folder.

use std::time::{Duration, SystemTime};

use kiln_jobs::embedded::EmbeddedQueue;
use kiln_jobs::{CancelResult, JobId, JobQueue, JobState, JobsError, ListFilter, NewJob, Outcome};

fn folder(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-jobs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn job(model: &str, priority: u8, n: u32) -> kiln_jobs::queue::Result<NewJob> {
    Ok(NewJob {
        model: model.into(),
        priority,
        request: format!("{{\"n\":{n}}}").into_bytes(),
    })
}

#[test]
fn claims_by_priority_then_order_and_results_are_idempotent() {
    let dir = folder("order");
    let q = EmbeddedQueue::open(&dir).unwrap();
    let ids = q
        .enqueue(&mut [job("a", 5, 1), job("a", 1, 2), job("b", 5, 3)].into_iter())
        .unwrap();
    assert_eq!(ids.len(), 3);
    let claimed = q.claim("c1", 2).unwrap();
    assert_eq!(claimed[0].id, ids[1], "priority 1 first");
    assert_eq!(claimed[1].id, ids[0]);
    assert_eq!(claimed[1].request, b"{\"n\":1}");
    assert_eq!(q.get(&ids[0]).unwrap().unwrap().state, JobState::Running);
    q.complete(&[(ids[0].clone(), Outcome::Done(b"first".to_vec()))])
        .unwrap();
    q.complete(&[(ids[0].clone(), Outcome::Done(b"second".to_vec()))])
        .unwrap();
    let done = q.get(&ids[0]).unwrap().unwrap();
    assert_eq!(done.state, JobState::Done);
    assert_eq!(done.response.as_deref(), Some(&b"first"[..]));
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

#[test]
fn a_bad_job_stores_nothing() {
    let dir = folder("atomic");
    let q = EmbeddedQueue::open(&dir).unwrap();
    let mut input = [
        job("a", 5, 1),
        Err(JobsError::Invalid("line 2: bad".into())),
    ]
    .into_iter();
    assert_eq!(
        q.enqueue(&mut input),
        Err(JobsError::Invalid("line 2: bad".into()))
    );
    assert_eq!(q.counts().unwrap().queued, 0);
    assert!(q
        .list(&ListFilter::default(), None, 10)
        .unwrap()
        .jobs
        .is_empty());
}

#[test]
fn cancel_release_list_and_expire() {
    let dir = folder("life");
    let q = EmbeddedQueue::open(&dir).unwrap();
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
    let claimed = q.claim("c", 1).unwrap();
    assert_eq!(claimed[0].id, ids[1]);
    assert_eq!(
        q.cancel(&ids[1]).unwrap(),
        CancelResult::NotQueued(JobState::Running)
    );
    q.release(&[ids[1].clone()]).unwrap();
    assert_eq!(q.get(&ids[1]).unwrap().unwrap().state, JobState::Queued);

    // Pages of 3 over the even model: ids 2, 4 | 6, 8 (0 is cancelled but listed).
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
}

#[test]
fn running_jobs_go_back_to_the_queue_when_reopened() {
    let dir = folder("reopen");
    let ids = {
        let q = EmbeddedQueue::open(&dir).unwrap();
        let ids = q.enqueue(&mut (0..3).map(|n| job("a", 5, n))).unwrap();
        assert_eq!(q.claim("dead", 2).unwrap().len(), 2);
        ids
    };
    let q = EmbeddedQueue::open(&dir).unwrap();
    let counts = q.counts().unwrap();
    assert_eq!((counts.queued, counts.running), (3, 0));
    let again = q.claim("alive", 3).unwrap();
    assert_eq!(again.iter().map(|j| j.id.clone()).collect::<Vec<_>>(), ids);
    assert_eq!(q.get(&ids[0]).unwrap().unwrap().attempts, 2);
    // New ids continue after the old ones.
    let more = q.enqueue(&mut std::iter::once(job("a", 5, 9))).unwrap();
    assert_eq!(more[0], JobId("4".into()));
}

#[test]
fn reclaim_takes_back_other_consumers_idle_jobs() {
    let dir = folder("reclaim");
    let q = EmbeddedQueue::open(&dir).unwrap();
    q.enqueue(&mut (0..2).map(|n| job("a", 5, n))).unwrap();
    q.claim("other", 1).unwrap();
    q.claim("me", 1).unwrap();
    assert_eq!(
        q.reclaim("me", Duration::from_secs(3600)).unwrap(),
        0,
        "not idle long enough"
    );
    assert_eq!(
        q.reclaim("me", Duration::ZERO).unwrap(),
        1,
        "only the other's"
    );
    let counts = q.counts().unwrap();
    assert_eq!((counts.queued, counts.running), (1, 1));
}
