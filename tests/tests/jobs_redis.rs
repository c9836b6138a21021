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
//! - A large submission never holds Redis in one step (issue 27, finding 12):
//!   `MONITOR` counts the commands of every `MULTI/EXEC` and script; a reader
//!   polling during the POST sees none of it before its commit, all of it after.
//! - A stored result larger than `--max-client-bytes` is refused (429) before it
//!   is read: the server's peak RSS does not grow by it.

// Test code: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_jobs::redis_streams::CHUNK_JOBS;
use kiln_tests::jobs::{get, list_all, submit, submit_ok, wait_finished, ADMIN_ARG};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_cut_at_the_exit_timeout_go_back_to_the_queue() {
    let redis = RedisServer::start();
    let jobs = format!("--jobs={}", redis.url());
    // Jobs of several seconds each (50 times SLOW_COST's work), two in flight;
    // the exit timeout (1 s) cuts them.
    let model = "cost:dim=4,fixed_passes=20000,batch_size=1";
    let mut first = Kiln::start(&[
        "--load",
        model,
        &jobs,
        "--jobs-max-sys",
        "2",
        "--exit-timeout-secs",
        "1",
    ]);
    let ids = submit_ok(&first.url, "cost", lines((0..4).map(cost_job))).await;
    wait_figure(&first, "kiln_jobs_dispatched_total", &[], |v| v >= 1.0).await;
    assert_eq!(unsafe { libc::kill(first.pid() as i32, libc::SIGTERM) }, 0);
    assert!(
        first.exit_within(Duration::from_secs(30)).is_some(),
        "kiln did not stop"
    );
    // Nothing left claimed: what was cut is queued again, its claim not counted.
    let second = Kiln::start(&["--load", model, &jobs, "--jobs-max-sys", "0", ADMIN_ARG]);
    let listed = list_all(&second.url, "", 500).await;
    assert_eq!(listed.len(), ids.len());
    let running: Vec<&Value> = listed.iter().filter(|j| j["state"] == "running").collect();
    assert!(running.is_empty(), "left claimed: {running:?}");
    assert_eq!(redis.pending("kiln:jobs:stream:5", "kiln"), 0);
}

/// What consumers can see of the store: jobs counted queued, listed, in the
/// priority-5 stream.
fn visible(redis: &RedisServer) -> (i64, i64, i64) {
    let queued = "return tonumber(redis.call('HGET', KEYS[1], 'queued') or '0')";
    (
        redis.integer(&["EVAL", queued, "1", "kiln:jobs:counts"]),
        redis.integer(&["ZCARD", "kiln:jobs:index"]),
        redis.integer(&["XLEN", "kiln:jobs:stream:5"]),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_submission_never_holds_redis_and_shows_all_at_once() {
    let redis = Arc::new(RedisServer::start());
    let jobs = format!("--jobs={}", redis.url());
    // Nothing runs (max_sys 0): what the store shows is what was submitted.
    let kiln = Kiln::start(&[
        "--load",
        SLOW_COST,
        &jobs,
        "--jobs-max-sys",
        "0",
        "--jobs-max-per-submission",
        "30000",
    ]);
    let n = 30_000;
    let body = lines((0..n).map(cost_job));
    let monitor = redis.monitor();
    // A reader polling what consumers see, until one look after the 202.
    let answered = Arc::new(AtomicBool::new(false));
    let reader = std::thread::spawn({
        let (redis, answered) = (redis.clone(), answered.clone());
        move || {
            let mut seen = Vec::new();
            loop {
                let after = answered.load(Ordering::SeqCst);
                seen.push((after, visible(&redis)));
                if after {
                    return seen;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    });
    let (status, answer) = submit(&kiln.url, "cost", "", body).await;
    answered.store(true, Ordering::SeqCst);
    let seen = reader.join().unwrap();
    let monitored = monitor.finish();
    assert_eq!(status, 202, "{answer}");
    let ids = answer["ids"].as_array().unwrap();
    assert_eq!(ids.len(), n as usize);
    // No step of Redis ran more than a chunk's commands (3 a job to publish).
    let bound = 3 * CHUNK_JOBS + 10;
    assert!(
        monitored.largest_step <= bound,
        "one atomic step ran {} commands (bound {bound}); commands: {:?}",
        monitored.largest_step,
        monitored.counts
    );
    // Before the 202: nothing, or the whole submission committed (counted
    // queued at once; its entries may still be being added). After: all.
    let n = i64::from(n);
    let before: Vec<_> = seen.iter().filter(|(after, _)| !after).collect();
    assert!(!before.is_empty(), "the reader looked during the POST");
    for (_, (queued, listed, streamed)) in &before {
        let nothing = (*queued, *listed, *streamed) == (0, 0, 0);
        assert!(
            nothing || (*queued == n && *listed <= n && *streamed <= n),
            "seen before the 202: {queued} queued, {listed} listed, {streamed} in the stream"
        );
    }
    assert_eq!(seen.last().unwrap().1, (n, n, n), "all of it after the 202");
    for id in [&ids[0], &ids[ids.len() - 1]] {
        let (status, job) = get(&kiln.url, id.as_str().unwrap()).await;
        assert_eq!((status, &job["state"]), (200, &json!("queued")), "{job}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_result_over_the_budget_is_refused_before_it_is_read() {
    let redis = RedisServer::start();
    let jobs = format!("--jobs={}", redis.url());
    let budget = (16u64 << 20).to_string();
    let kiln = Kiln::start(&[
        "--load",
        SLOW_COST,
        &jobs,
        "--jobs-max-sys",
        "0",
        "--max-client-bytes",
        &budget,
    ]);
    let ids = submit_ok(&kiln.url, "cost", lines((0..1).map(cost_job))).await;
    let seq = ids[0].split('-').next().unwrap();
    // Its result as a run stores it: 24 MiB, over the 16 MiB budget.
    let result = format!("{{\"outputs\":\"{}\"}}", "x".repeat(24 << 20));
    let key = format!("kiln:jobs:job:{seq}");
    let stored = redis.command(&["HSET", &key, "state", "done", "response", &result]);
    assert_eq!(stored.as_deref(), Some(":1"));
    let peak = kiln_tests::peak_rss_bytes(kiln.pid());
    for _ in 0..3 {
        let (status, answer) = get(&kiln.url, &ids[0]).await;
        assert_eq!(status, 429, "{answer}");
    }
    let grown = kiln_tests::peak_rss_bytes(kiln.pid()).saturating_sub(peak);
    assert!(
        grown < 8 << 20,
        "peak RSS grew by {grown} bytes reading a result it refused"
    );
    // Within a budget that holds it, the same result is served.
    let larger = Kiln::start(&["--load", SLOW_COST, &jobs, "--jobs-max-sys", "0"]);
    let (status, job) = get(&larger.url, &ids[0]).await;
    assert_eq!(status, 200);
    assert_eq!(
        job["response"]["outputs"].as_str().map(str::len),
        Some(24 << 20)
    );
}
