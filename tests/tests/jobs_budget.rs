//! The dispatch budget gates jobs (docs/jobs.md, "The budget"): with a slow
//! `cost` model that realtime load keeps full, no job is dispatched while
//! `D ≤ 0`; once realtime stops the jobs drain, and the jobs in flight never
//! exceed `floor(max_sys × u)` — all read from the server's metrics.
//!
//! The model: 4 instances of batch_size 1 → max_sys = 4, an idle budget of
//! floor(4 × 0.8) = 3; two priority levels, so jobs run at level 2 behind
//! realtime's level 1. Twelve realtime callers keep at least 4 requests in it
//! (F_sys + F_q ≥ 1, so D < 0).

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_tests::jobs::{get, jobs_arg, json_lines, store_dir, submit_ok};
use kiln_tests::{metric, Kiln};
use serde_json::{json, Value};

const MODEL_SPEC: &str = "cost:dim=4,fixed_passes=1500,batch_size=1,instances=4,\
                          max_buffers=4,priority_levels=2,default_priority_level=1";

fn cost_request(v: f32) -> Value {
    json!({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [v, v, v, v]}]})
}

/// The dispatcher's gauges and counters now.
struct Sample {
    budget: f64,
    d: f64,
    in_flight: f64,
    dispatched: f64,
    done: f64,
}

async fn sample(kiln: &Kiln) -> Sample {
    let text = kiln.client.metrics().await.unwrap();
    let read = |name: &str| metric(&text, name, &[]).unwrap_or(f64::NAN);
    let s = Sample {
        budget: read("kiln_dispatch_budget"),
        d: read("kiln_dispatch_headroom"),
        in_flight: read("kiln_dispatch_in_flight"),
        dispatched: read("kiln_jobs_dispatched_total"),
        done: metric(&text, "kiln_jobs", &[("state", "done")]).unwrap_or(0.0),
    };
    // Never more in flight than the idle budget, whatever the moment.
    assert!(
        s.in_flight <= 3.0,
        "{} jobs in flight, over floor(4 × 0.8)",
        s.in_flight
    );
    assert!(s.budget <= 3.0, "budget {}", s.budget);
    s
}

/// Samples until `ok`, for up to 60 s.
async fn sample_until(kiln: &Kiln, what: &str, ok: impl Fn(&Sample) -> bool) -> Sample {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = sample(kiln).await;
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "never {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_job_is_dispatched_while_realtime_fills_the_server() {
    let dir = store_dir("budget");
    let kiln = Kiln::start(&["--load", MODEL_SPEC, &jobs_arg(&dir)]);
    let idle = sample_until(&kiln, "an idle budget of 3", |s| s.budget == 3.0).await;
    assert!((idle.d - 0.95).abs() < 1e-9, "D idle: {}", idle.d);

    let stop = Arc::new(AtomicBool::new(false));
    let mut callers = Vec::new();
    for c in 0..12 {
        let (url, stop) = (kiln.url.clone(), stop.clone());
        callers.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut answered = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let r = client
                    .post(format!("{url}/v2/models/cost/infer"))
                    .json(&cost_request(c as f32))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), 200);
                answered += 1;
            }
            answered
        }));
    }
    sample_until(&kiln, "a budget of 0 under realtime load", |s| {
        s.budget == 0.0 && s.d <= 0.0
    })
    .await;

    let requests: Vec<Value> = (0..20).map(|v| cost_request(v as f32)).collect();
    let ids = submit_ok(&kiln.url, "cost", json_lines(&requests)).await;
    // While realtime keeps D ≤ 0 (one second of samples), nothing is dispatched.
    let until = Instant::now() + Duration::from_secs(1);
    let mut samples = 0;
    while Instant::now() < until {
        let s = sample(&kiln).await;
        assert_eq!(s.dispatched, 0.0, "a job was dispatched while D = {}", s.d);
        assert!(
            s.d <= 0.0 && s.budget == 0.0,
            "realtime load eased: D = {}",
            s.d
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(samples > 5);
    let (_, job) = get(&kiln.url, &ids[0]).await;
    assert_eq!(job["state"], "queued");

    stop.store(true, Ordering::SeqCst);
    for caller in callers {
        assert!(caller.await.unwrap() > 0);
    }
    let drained = sample_until(&kiln, "all jobs done", |s| s.done == 20.0).await;
    assert_eq!(drained.dispatched, 20.0);
    for (v, id) in ids.iter().enumerate() {
        let (_, job) = get(&kiln.url, id).await;
        assert_eq!(job["state"], "done", "{job}");
        assert_eq!(job["response"]["outputs"][0]["shape"], json!([1, 4]));
        let out = job["response"]["outputs"][0]["data"].as_array().unwrap();
        assert!(
            v == 0 || out.iter().any(|x| x.as_f64() != Some(0.0)),
            "{job}"
        );
    }
}
