//! Kill -9 (docs/jobs.md, "Guarantees"): 10,000 jobs submitted to the embedded
//! store, the server killed with SIGKILL at random moments three times while it
//! drains them and restarted on the same store; afterwards every job shows
//! exactly one result, its own, none lost, none duplicated.
//!
//! `--jobs-max-sys 64` keeps at most 51 jobs in flight, so the drain lasts long enough for
//! the kills to land in it. About 15–30 s in a debug build on 2 cores.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use kiln_tests::jobs::{
    echo_job, echoed, get, jobs_arg, json_lines, list_all, store_dir, submit_ok, ADMIN_ARG,
};
use kiln_tests::{metric, Kiln};
use serde_json::Value;

const JOBS: u32 = 10_000;

/// A small xorshift generator: the kill moments, reproducible from the seed printed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

async fn done_count(kiln: &Kiln) -> f64 {
    let text = kiln.client.metrics().await.unwrap();
    metric(&text, "kiln_jobs", &[("state", "done")]).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_three_times_loses_and_duplicates_nothing() {
    let dir = store_dir("crash");
    let store = jobs_arg(&dir);
    let args = [
        "--load",
        "echo",
        store.as_str(),
        "--jobs-max-sys",
        "64",
        ADMIN_ARG,
    ];
    let seed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("kill moments from seed {seed}");
    let mut rng = Rng(seed);
    let started = Instant::now();

    let mut kiln = Kiln::start(&args);
    let mut ids = Vec::new();
    for chunk in 0..10 {
        let requests: Vec<Value> = (chunk * 1000..(chunk + 1) * 1000).map(echo_job).collect();
        ids.extend(submit_ok(&kiln.url, "echo", json_lines(&requests)).await);
    }
    assert_eq!(ids.len(), JOBS as usize);
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        ids.len(),
        "distinct ids"
    );

    for kill in 1..=3 {
        tokio::time::sleep(Duration::from_millis(100 + rng.below(900))).await;
        let done = done_count(&kiln).await;
        // SIGKILL: `Child::kill`, on drop.
        drop(kiln);
        eprintln!("kill {kill}: about {done} done before it");
        assert!(done < f64::from(JOBS), "kill {kill} came after the drain");
        kiln = Kiln::start(&args);
    }

    let deadline = Instant::now() + Duration::from_secs(240);
    while done_count(&kiln).await < f64::from(JOBS) {
        assert!(Instant::now() < deadline, "the jobs did not all finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // What the API shows: every job once, done.
    let listed = list_all(&kiln.url, "", 1000).await;
    let listed_ids: Vec<&str> = listed.iter().map(|j| j["id"].as_str().unwrap()).collect();
    assert_eq!(
        listed_ids,
        ids.iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert!(
        listed.iter().all(|j| j["state"] == "done"),
        "every job done"
    );
    let retried = listed
        .iter()
        .filter(|j| j["attempts"].as_u64() > Some(1))
        .count();
    eprintln!("{retried} job(s) ran more than once (at-least-once)");

    // Each result is its own job's: 8 readers over the ids.
    let url = kiln.url.clone();
    let mut readers = Vec::new();
    for part in 0..8usize {
        let url = url.clone();
        let mine: Vec<(usize, String)> = ids
            .iter()
            .cloned()
            .enumerate()
            .filter(|(i, _)| i % 8 == part)
            .collect();
        readers.push(tokio::spawn(async move {
            for (value, id) in mine {
                let (status, job) = get(&url, &id).await;
                assert_eq!(status, 200);
                assert_eq!(job["state"], "done");
                assert_eq!(echoed(&job), value as u64 + 1, "{job}");
                assert_eq!(job["response"]["id"], format!("j{value}"));
            }
        }));
    }
    for reader in readers {
        reader.await.unwrap();
    }
    let text = kiln.client.metrics().await.unwrap();
    assert_eq!(
        metric(&text, "kiln_jobs", &[("state", "queued")]),
        Some(0.0)
    );
    assert_eq!(
        metric(&text, "kiln_jobs", &[("state", "running")]),
        Some(0.0)
    );
    eprintln!("kill -9 test: {:.1} s", started.elapsed().as_secs_f64());
    let _ = std::fs::remove_dir_all(&dir);
}
