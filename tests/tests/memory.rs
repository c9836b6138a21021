//! Memory is returned after a flood (finding 7 of the hardening issue): glibc kept
//! what a flood of large requests freed in its per-thread arenas, so the server
//! stayed at gigabytes with nothing pending. Housekeeping trims once the server is
//! quiet; here a scaled-down flood must be given back within 30 s.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kiln_tests::wait::wait_pending;
use kiln_tests::{rss_bytes, Kiln};
use serde_json::json;

/// Values per request: 4 MiB of INT32, well above glibc's initial mmap threshold.
const VALUES: usize = 1 << 20;
/// Requests of the flood, all pending at once: 160 MiB of tensors.
const FLOOD: usize = 40;

/// Sends one request of `VALUES` INT32 values as a binary tensor, answered binary;
/// returns the status.
async fn big(http: &reqwest::Client, url: &str, model: &str) -> u16 {
    let header = json!({
        "inputs": [{"name": "INPUT0", "shape": [1, VALUES], "datatype": "INT32",
                    "parameters": {"binary_data_size": VALUES * 4}}],
        "parameters": {"binary_data_output": true},
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    body.extend(std::iter::repeat_n(7u8, VALUES * 4));
    http.post(format!("{url}/v2/models/{model}/infer"))
        .header("Inference-Header-Content-Length", header.len())
        .header("Content-Type", "application/octet-stream")
        .body(body)
        .send()
        .await
        .expect("an answer")
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_is_returned_after_a_flood() {
    // Debug level: housekeeping logs each trim (shown if the test fails).
    let kiln = Kiln::start(&["--log-level", "debug"]);
    let c = kiln.client.clone();
    let pid = kiln.pid();
    // `faulty` answers at once; `faulty-0` holds everything in its dynamic batcher's
    // queue (a 100 s delay, batches of 64 rows) until it is unloaded.
    c.load("faulty", &json!({})).await.unwrap();
    let held = c
        .load(
            "faulty",
            &json!({"batcher": "dynamic", "batch_size": 64, "max_buffers": 1,
                    "queue_size": 100, "max_queue_delay_microseconds": 100_000_000}),
        )
        .await
        .unwrap();
    // A few large requests one after another, as a server sees before a flood: glibc
    // raises its mmap threshold, so the flood's buffers come from its arenas.
    let http = reqwest::Client::new();
    for _ in 0..4 {
        assert_eq!(big(&http, &kiln.url, "faulty").await, 200);
    }
    drop(http);
    let before = rss_bytes(pid);
    let http = reqwest::Client::new();
    let flood: Vec<_> = (0..FLOOD)
        .map(|_| {
            let (http, url, model) = (http.clone(), kiln.url.clone(), held.clone());
            tokio::spawn(async move { big(&http, &url, &model).await })
        })
        .collect();
    wait_pending(&c, &held, FLOOD as f64).await;
    let peak = rss_bytes(pid);
    assert!(
        peak > 3 * before,
        "the flood should be large against the server: {} MiB before, {} MiB at its peak",
        before >> 20,
        peak >> 20
    );
    // The unload answers everything queued; the flood is over.
    c.unload(&held).await.unwrap();
    for task in flood {
        assert_eq!(task.await.unwrap(), 200);
    }
    drop(http);
    let ended = Instant::now();
    let mut now = rss_bytes(pid);
    while now >= 2 * before && ended.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        now = rss_bytes(pid);
    }
    let log = kiln.log();
    let trims: Vec<&str> = log.lines().filter(|l| l.contains("housekeeping")).collect();
    assert!(
        now < 2 * before,
        "30 s after the flood the server still holds {} MiB (before: {} MiB, peak {} MiB); \
         housekeeping: {trims:#?}",
        now >> 20,
        before >> 20,
        peak >> 20
    );
    println!(
        "RSS before {} MiB, peak {} MiB, {} MiB {:?} after the flood",
        before >> 20,
        peak >> 20,
        now >> 20,
        ended.elapsed()
    );
}
