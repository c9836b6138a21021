//! Jobs on a shared Redis queue, end to end: the real `kiln` binary, a real
//! `redis-server` (scripts/setup-redis), real plugins on loopback.
//!
//! - Two replicas drain one queue; one is killed (SIGKILL) mid-way; the other
//!   takes over its claimed jobs (XAUTOCLAIM after `--jobs-claim-timeout`) and
//!   finishes everything: nothing lost, nothing shown twice.
//! - The remote target (`--jobs-target`): a dispatcher feeding another kiln over
//!   HTTP, reading its `/metrics`; its 429s put the jobs back and drop the budget;
//!   a target that is down gives a budget of 0 and loses no job; a job whose model
//!   the target lacks fails once with the target's error.
//! - A dispatcher stopped gracefully (SIGTERM) leaves no job claimed: the jobs it
//!   claimed ahead go back to the queue.

// Test code: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kiln_tests::jobs::{list_all, submit_ok, wait_finished, ADMIN_ARG};
use kiln_tests::redis::RedisServer;
use kiln_tests::wait::wait_sample;
use kiln_tests::{metric, Kiln};
use serde_json::{json, Value};

/// A cost model whose every job is one batch of ~10-50 ms (debug build).
const SLOW_COST: &str = "cost:dim=4,fixed_passes=400,batch_size=1";

fn cost_job(n: u32) -> Value {
    json!({
        "id": format!("j{n}"),
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [n as f32, 1.0, 2.0, 3.0]}]
    })
}

fn lines(jobs: impl Iterator<Item = Value>) -> String {
    jobs.map(|j| format!("{j}\n")).collect()
}

async fn metrics(url: &str) -> String {
    reqwest::get(format!("{url}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text")
}

/// A dispatcher metric (no labels, or `labels`), 0 when absent.
async fn figure(url: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric(&metrics(url).await, name, labels).unwrap_or(0.0)
}

/// Waits (up to 60 s) until `name{labels}` of `kiln` satisfies `ok`.
async fn wait_figure(kiln: &Kiln, name: &str, labels: &[(&str, &str)], ok: impl Fn(f64) -> bool) {
    wait_sample(&kiln.client, name, labels, Duration::from_secs(60), ok).await;
}

/// A kiln that validates cost jobs against its own `SLOW_COST`, queues them on
/// `redis` and feeds them to `target`, scraping it every `scrape` seconds.
fn dispatcher(redis: &RedisServer, target: &str, more: &[&str], scrape: &str) -> Kiln {
    let jobs = format!("--jobs={}", redis.url());
    let mut args = vec![
        "--load",
        SLOW_COST,
        &jobs,
        "--jobs-target",
        target,
        ADMIN_ARG,
    ];
    args.extend_from_slice(more);
    args.extend(["--jobs-target-scrape-interval", scrape]);
    Kiln::start(&args)
}

/// Every job through the API: each id once, each done with one response.
async fn assert_all_done_once(url: &str, ids: &[String]) -> Vec<Value> {
    let listed = list_all(url, "", 500).await;
    let listed_ids: Vec<&str> = listed.iter().map(|j| j["id"].as_str().unwrap()).collect();
    let unique: HashSet<&str> = listed_ids.iter().copied().collect();
    assert_eq!(listed_ids.len(), ids.len(), "each job listed once");
    assert_eq!(unique.len(), ids.len());
    let mut jobs = Vec::new();
    for id in ids {
        assert!(unique.contains(id.as_str()), "job {id} is missing");
        let job = wait_finished(url, id, Duration::from_secs(60)).await;
        assert_eq!(job["state"], "done", "{job}");
        assert_eq!(job["response"]["model_name"], "cost", "{job}");
        jobs.push(job);
    }
    jobs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_drain_one_queue_and_survive_a_kill() {
    let redis = RedisServer::start();
    let jobs = format!("--jobs={}", redis.url());
    let start = |name: &str| {
        Kiln::start(&[
            "--load",
            SLOW_COST,
            &jobs,
            "--jobs-claim-timeout",
            "1",
            "--jobs-consumer",
            name,
            ADMIN_ARG,
        ])
    };
    let a = start("replica-a");
    let mut b = start("replica-b");
    let n = 120;
    let ids = submit_ok(&a.url, "cost", lines((0..n).map(cost_job))).await;
    assert_eq!(ids.len(), n as usize);
    // Both take part; then b dies while running a job of its own.
    wait_figure(&b, "kiln_jobs_completed_total", &[], |v| v >= 5.0).await;
    wait_figure(&a, "kiln_jobs_completed_total", &[], |v| v >= 5.0).await;
    // Freeze b until it holds a claimed job, and kill it then.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pid = b.pid() as i32;
        // SAFETY: signals to the child this test started.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let held = redis
            .command(&[
                "XPENDING",
                "kiln:jobs:stream:5",
                "kiln",
                "-",
                "+",
                "10",
                "replica-b",
            ])
            .unwrap();
        if held != "*0" {
            break;
        }
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        assert!(Instant::now() < deadline, "b never held a job");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    b.kill();
    let done = assert_all_done_once(&a.url, &ids).await;
    let rerun = done
        .iter()
        .filter(|j| j["attempts"].as_u64() >= Some(2))
        .count();
    assert!(rerun >= 1, "b's claimed job ran again on a");
    // Every entry acknowledged after its result; the counts match the API.
    assert_eq!(redis.pending("kiln:jobs:stream:5", "kiln"), 0);
    wait_figure(&a, "kiln_jobs", &[("state", "done")], |v| v == n as f64).await;
    assert_eq!(
        figure(&a.url, "kiln_jobs", &[("state", "running")]).await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_feeds_a_remote_kiln_and_backs_off_on_429() {
    let redis = RedisServer::start();
    // The target: a small queue (2) and one slow instance.
    let target = Kiln::start(&["--load", &format!("{SLOW_COST},queue_size=2")]);
    // The dispatcher believes the target takes 40 at once: most get 429.
    let dispatcher = dispatcher(&redis, &target.url, &["--jobs-max-sys", "50"], "0.2");
    let n = 60;
    let ids = submit_ok(&dispatcher.url, "cost", lines((0..n).map(cost_job))).await;
    assert_all_done_once(&dispatcher.url, &ids).await;
    let d = &dispatcher.url;
    let overloads = figure(d, "kiln_dispatch_overloads_total", &[]).await;
    let released = figure(d, "kiln_jobs_released_total", &[("reason", "overloaded")]).await;
    assert!(overloads >= 1.0, "the target answered 429");
    assert!(released >= 1.0, "a refused job went back to the queue");
    assert_eq!(figure(d, "kiln_jobs_failed_total", &[]).await, 0.0);
    // The jobs ran on the target, not on the dispatcher's own model.
    let t = metrics(&target.url).await;
    let ran = kiln_tests::requests_outcome(&t, "cost", "success").unwrap_or(0.0);
    assert!(ran >= n as f64, "the target ran {ran}");
    let own = kiln_tests::requests_outcome(&metrics(d).await, "cost", "success").unwrap_or(0.0);
    assert_eq!(own, 0.0);
    // The target's rejections are the dispatcher's overloads (each one counted once).
    let rejected = kiln_tests::requests_outcome(&t, "cost", "rejected").unwrap_or(0.0);
    assert_eq!(rejected, overloads);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_is_down_gets_nothing_and_loses_nothing() {
    let redis = RedisServer::start();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let target_url = format!("http://127.0.0.1:{port}");
    let dispatcher = dispatcher(&redis, &target_url, &[], "0.05");
    let d = &dispatcher.url;
    let ids = submit_ok(d, "cost", lines((0..20).map(cost_job))).await;
    // Nothing listens there: no reading, so no budget, and the jobs wait.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let text = metrics(d).await;
        assert_eq!(metric(&text, "kiln_dispatch_budget", &[]), Some(0.0));
        assert_eq!(metric(&text, "kiln_jobs_dispatched_total", &[]), Some(0.0));
    }
    wait_figure(&dispatcher, "kiln_jobs", &[("state", "queued")], |v| {
        v == 20.0
    })
    .await;
    // The target comes up where it was named: everything drains.
    let target = Kiln::start_on(port, &["--load", SLOW_COST], &[]);
    assert_all_done_once(d, &ids).await;
    assert_eq!(figure(d, "kiln_jobs_failed_total", &[]).await, 0.0);
    let ran = kiln_tests::requests_outcome(&metrics(&target.url).await, "cost", "success");
    assert_eq!(ran, Some(20.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_model_the_target_lacks_fails_once_with_its_error() {
    let redis = RedisServer::start();
    // The target serves echo only; the dispatcher validates cost jobs against
    // its own cost model and feeds them to the target, which answers 404.
    let target = Kiln::start(&["--load", "echo"]);
    let dispatcher = dispatcher(&redis, &target.url, &[], "0.05");
    let d = &dispatcher.url;
    let ids = submit_ok(d, "cost", lines((0..3).map(cost_job))).await;
    for id in &ids {
        let job = wait_finished(d, id, Duration::from_secs(60)).await;
        assert_eq!(job["state"], "failed", "{job}");
        let error = job["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("cost"),
            "the target's error names the model: {job}"
        );
        assert_eq!(job["attempts"], 1, "failed at once, not retried: {job}");
    }
    assert_eq!(figure(d, "kiln_jobs_failed_total", &[]).await, 3.0);
    let released = figure(d, "kiln_jobs_released_total", &[("reason", "unavailable")]).await;
    assert_eq!(released, 0.0, "a missing model is not a wait");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_dispatcher_leaves_no_job_claimed() {
    let redis = RedisServer::start();
    let jobs = format!("--jobs={}", redis.url());
    // max_sys 10: 8 jobs in flight and up to 8 more claimed ahead of them. Ten
    // times SLOW_COST's work a job, and 300 jobs: far more than can run while
    // the server stops (its HTTP and gRPC servers first, then the dispatcher).
    let model = "cost:dim=4,fixed_passes=4000,batch_size=1";
    let mut first = Kiln::start(&["--load", model, &jobs, "--jobs-max-sys", "10"]);
    let ids = submit_ok(&first.url, "cost", lines((0..300).map(cost_job))).await;
    wait_figure(&first, "kiln_jobs_completed_total", &[], |v| v >= 5.0).await;
    // A graceful stop: the jobs in flight finish and are stored, the ones claimed
    // ahead go back to the queue (not left to the claim timeout).
    assert_eq!(unsafe { libc::kill(first.pid() as i32, libc::SIGTERM) }, 0);
    assert!(
        first.exit_within(Duration::from_secs(30)).is_some(),
        "kiln did not stop"
    );
    // Another server on the same queue that runs nothing sees what was left.
    let second = Kiln::start(&["--load", model, &jobs, "--jobs-max-sys", "0", ADMIN_ARG]);
    let listed = list_all(&second.url, "", 500).await;
    assert_eq!(listed.len(), ids.len());
    let running: Vec<&Value> = listed.iter().filter(|j| j["state"] == "running").collect();
    assert!(running.is_empty(), "left claimed: {running:?}");
    let done = listed.iter().filter(|j| j["state"] == "done").count();
    let queued = listed.iter().filter(|j| j["state"] == "queued").count();
    assert_eq!(done + queued, ids.len(), "{listed:?}");
    assert!(done >= 5 && queued > 0, "done {done}, queued {queued}");
}
