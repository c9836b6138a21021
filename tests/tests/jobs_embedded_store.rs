//! The embedded job store (redb) on a real file in a fresh folder: the stores'
//! shared contract (`kiln_tests::job_store`), and what a local file adds: jobs left
//! running by a dead process go back to the queue when the store is opened again,
//! and reclaiming another consumer's idle jobs.

// Test code: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kiln_jobs::embedded::EmbeddedQueue;
use kiln_jobs::JobQueue;
use kiln_tests::job_store::{self, job};

fn folder(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-jobs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn claims_by_priority_then_order_and_results_are_idempotent() {
    let q = EmbeddedQueue::open(&folder("order")).unwrap();
    job_store::claims_by_priority_then_order_and_results_are_idempotent(&q);
}

#[test]
fn a_bad_job_stores_nothing() {
    let q = EmbeddedQueue::open(&folder("atomic")).unwrap();
    job_store::a_bad_job_stores_nothing(&q);
}

#[test]
fn cancel_release_list_and_expire() {
    let q = EmbeddedQueue::open(&folder("life")).unwrap();
    job_store::cancel_release_list_and_expire(&q);
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
    // New ids continue after the old ones (`SEQ-SECRET`, issue 27).
    let more = q.enqueue(&mut std::iter::once(job("a", 5, 9))).unwrap();
    assert!(more[0].0.starts_with("4-"), "{}", more[0]);
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
