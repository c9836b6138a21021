//! The dynamic batcher end to end: preferred sizes, proactive timeouts, per-level
//! queue limits, strict priority and cancellation (an HTTP client that disconnects,
//! and an in-process caller that drops its future) with the real server. The
//! `faulty` worker's `-3` request takes 1 s and holds the group's only buffer set, so
//! what queues behind it is decided by the batcher alone.

// `outcome` is test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kiln_client::{DataType, HttpClient, InferRequest, InputTensor, Param, ParamValue};
use kiln_tests::{
    metric, requests_outcome, thread_names, triton_config, wait_metric, wait_pending, Kiln,
};
use serde_json::json;

fn request(model: &str, values: &[i32], priority: Option<i64>) -> InferRequest {
    InferRequest {
        model: model.into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, values.len() as i64],
            values,
        )],
        parameters: priority
            .map(|p| {
                vec![Param {
                    key: "priority".into(),
                    value: ParamValue::Int(p),
                }]
            })
            .unwrap_or_default(),
        ..Default::default()
    }
}

async fn outcome(c: &HttpClient, model: &str, outcome: &str) -> f64 {
    let text = c.metrics().await.unwrap();
    requests_outcome(&text, model, outcome).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_size_goes_at_once_and_a_lone_request_after_the_delay() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let params = json!({"batcher": "dynamic", "batch_size": 8, "preferred_batch_size": "4", "max_queue_delay_microseconds": 2_000_000});
    c.load("faulty", &params).await.unwrap();
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move { c.infer(&request("faulty", &[i], None)).await.unwrap() })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let text = c.metrics().await.unwrap();
    let m = |name| metric(&text, name, &[("model", "faulty")]).unwrap();
    assert_eq!(
        (m("kiln_batch_size_count"), m("kiln_batch_size_sum")),
        (1.0, 4.0),
        "four requests, one preferred batch"
    );
    let config = c.model_metadata("faulty").await.unwrap();
    assert_eq!(config["parameters"]["batcher"], "dynamic");
    // Triton's /config reports the dynamic batcher's real settings.
    let config = triton_config(&kiln.url, "faulty").await;
    let db = &config["dynamic_batching"];
    assert_eq!(db["preferred_batch_size"], json!([4]), "{config}");
    assert_eq!(db["max_queue_delay_microseconds"], 2_000_000);
    assert_eq!(db["priority_levels"], 0);
}

/// #30: requests that come while the only instance runs a batch leave together,
/// in one batch, when it frees up (Triton's dynamic batcher), not in batches formed
/// ahead of it while buffer sets were free. Counted by the server's batch-size
/// histogram and the statistics' executions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_behind_a_busy_instance_run_as_one_batch() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    c.load("faulty", &json!({"batcher": "dynamic", "batch_size": 8}))
        .await
        .unwrap();
    let infer = |values: Vec<i32>| {
        let c = c.clone();
        tokio::spawn(async move { c.infer(&request("faulty", &values, None)).await.unwrap() })
    };
    let slow = infer(vec![-3]); // 1 s
    wait_metric(&c, "kiln_batch_size_count", "faulty", 1.0).await;
    let queued: Vec<_> = (0..5).map(|i| infer(vec![i])).collect();
    wait_pending(&c, "faulty", 6.0).await;
    slow.await.unwrap();
    for t in queued {
        t.await.unwrap();
    }
    let text = c.metrics().await.unwrap();
    let m = |name| metric(&text, name, &[("model", "faulty")]).unwrap();
    assert_eq!(
        (m("kiln_batch_size_count"), m("kiln_batch_size_sum")),
        (2.0, 6.0),
        "the slow batch, then the five queued behind it as one"
    );
    let (_, stats) = kiln_tests::ensembles::get(&kiln, "/v2/models/faulty/stats").await;
    let s = &stats["model_stats"][0];
    assert_eq!(s["execution_count"], 2, "{s}");
    assert_eq!(s["inference_count"], 6, "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_queue_limits_priority_and_cancellation() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    c.load(
        "faulty",
        &json!({
            "batcher": "dynamic", "batch_size": 1, "max_buffers": 1,
            "priority_levels": 2, "default_priority_level": 2,
            "default_queue_policy.allow_timeout_override": true,
            "priority_queue_policy.2.max_queue_size": 2,
        }),
    )
    .await
    .unwrap();
    // Each request's first value, in the order their answers came.
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let send = |values: Vec<i32>, priority: Option<i64>, timeout_us: Option<i64>| {
        let (c, done) = (c.clone(), done_tx.clone());
        tokio::spawn(async move {
            let mut r = request("faulty", &values, priority);
            if let Some(t) = timeout_us {
                r.parameters.push(Param {
                    key: "timeout".into(),
                    value: ParamValue::Int(t),
                });
            }
            let result = c.infer(&r).await;
            let _ = done.send(values[0]);
            (values[0], result)
        })
    };
    // 1. The slow request holds the only buffer set for 1 s, and a second one at
    //    the same (high) priority is queued to run next: 2 s in which to queue
    //    the rest, however slowly they arrive.
    let slow = send(vec![-3], Some(1), None);
    wait_pending(&c, "faulty", 1.0).await;
    wait_metric(&c, "kiln_batch_size_count", "faulty", 1.0).await;
    let slow_next = send(vec![-3], Some(1), None);
    wait_pending(&c, "faulty", 2.0).await;
    // 2. A request with a 100 ms timeout is answered when it expires, before the
    //    slow one finishes, and never reaches the worker.
    let expired = send(vec![5], Some(1), Some(100_000)).await.unwrap();
    assert!(!slow.is_finished(), "the timeout was not proactive");
    let err = expired.1.unwrap_err();
    assert_eq!(err.status(), Some(503), "{err}");
    assert!(err.to_string().contains("timeout expired"), "{err}");
    // 3. Level 2 holds two requests (each takes 1 s: `-3`); a third is refused with 429.
    let low_a = send(vec![21, -3], None, None);
    wait_pending(&c, "faulty", 3.0).await;
    let low_b = send(vec![22, -3], None, None);
    wait_pending(&c, "faulty", 4.0).await;
    let refused = send(vec![23], None, None).await.unwrap().1.unwrap_err();
    assert_eq!(refused.status(), Some(429), "{refused}");
    // 4. A high-priority request sent after them runs before them.
    let high = send(vec![11], Some(1), None);
    wait_pending(&c, "faulty", 5.0).await;
    assert!(
        !slow_next.is_finished(),
        "too slow to queue them all in 2 s"
    );
    // 5. An HTTP client that gives up: its request leaves the queue unbatched,
    //    counted as cancelled.
    let quitter = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    let gone = quitter
        .post(format!("{}/v2/models/faulty/infer", kiln.url))
        .body(r#"{"inputs":[{"name":"INPUT0","shape":[1,1],"datatype":"INT32","data":[99]}],"parameters":{"priority":1}}"#)
        .send()
        .await;
    assert!(gone.is_err(), "the client should have timed out");
    // After the slow request, the high-priority one runs before the two queued
    // earlier (each of those takes 1 s, so the order of the answers is the order
    // of the batches).
    for task in [slow, slow_next, high, low_a, low_b] {
        let (id, result) = task.await.unwrap();
        result.unwrap_or_else(|e| panic!("request {id}: {e}"));
    }
    drop(done_tx);
    let mut answered = Vec::new();
    while let Some(id) = done_rx.recv().await {
        answered.push(id);
    }
    let after_slow: Vec<_> = answered
        .iter()
        .copied()
        .filter(|id| [11, 21, 22].contains(id))
        .collect();
    assert_eq!(
        after_slow,
        [11, 21, 22],
        "answers in the order {answered:?}"
    );
    let text = c.metrics().await.unwrap();
    let config = triton_config(&kiln.url, "faulty").await;
    let db = &config["dynamic_batching"];
    assert_eq!(
        (
            db["priority_levels"].as_u64(),
            db["default_priority_level"].as_u64()
        ),
        (Some(2), Some(2))
    );
    assert_eq!(
        db["priority_queue_policy"]["2"]["max_queue_size"], 2,
        "{config}"
    );
    assert_eq!(db["priority_queue_policy"]["1"]["max_queue_size"], 0);
    assert_eq!(db["default_queue_policy"]["allow_timeout_override"], true);
    assert_eq!(outcome(&c, "faulty", "timeout").await, 1.0);
    assert_eq!(outcome(&c, "faulty", "rejected").await, 1.0);
    assert_eq!(outcome(&c, "faulty", "cancelled").await, 1.0);
    // Two slow + high + two low: the expired and cancelled ones never ran.
    assert_eq!(outcome(&c, "faulty", "success").await, 5.0, "{text}");
    // Every batch held one request.
    assert_eq!(
        metric(&text, "kiln_batch_size_count", &[("model", "faulty")]),
        Some(5.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_caller_goes_away_is_removed_before_batching() {
    use kiln_client::NativeClient;
    use kiln_core::{params_from_pairs, ServerConfig};
    let client = NativeClient::start(ServerConfig::default()).unwrap();
    let endpoint = client
        .load(
            "faulty",
            params_from_pairs(&[
                ("batcher", "dynamic"),
                ("batch_size", "1"),
                ("max_buffers", "1"),
            ]),
        )
        .await
        .unwrap();
    let slow = {
        let c = client.clone();
        let r = request(&endpoint, &[-3], None);
        tokio::spawn(async move { c.infer(r).await })
    };
    // Wait until the slow request's batch runs.
    let mut running = false;
    for _ in 0..1000 {
        let text = client.server().metrics_text();
        running = metric(&text, "kiln_batch_size_count", &[("model", &endpoint)]) == Some(1.0);
        if running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(running, "the slow request never ran");
    // The caller gives up after 100 ms, while the slow request holds the only set.
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        client.infer(request(&endpoint, &[7], None)),
    )
    .await;
    assert!(gave_up.is_err(), "it should still have been queued");
    slow.await.unwrap().unwrap();
    // The next request runs at once: nothing else was left in the queue.
    client.infer(request(&endpoint, &[8], None)).await.unwrap();
    let text = client.server().metrics_text();
    let m = |o| requests_outcome(&text, "faulty", o).unwrap();
    assert_eq!(m("cancelled"), 1.0, "{text}");
    assert_eq!(m("success"), 2.0, "the cancelled request never ran");
    client.shutdown().await;
}

/// With two instances, a fast batch formed after a slow one (1 s) finishes first;
/// with `preserve_ordering` its answer waits for the slow batch's. Margins are
/// hundreds of milliseconds against a 1 s batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preserve_ordering_holds_later_answers_until_earlier_ones_leave() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    for preserve in [false, true] {
        let params = json!({
            "batcher": "dynamic", "batch_size": 1, "instances": 2,
            "preserve_ordering": preserve,
        });
        let model = c.load("faulty", &params).await.unwrap();
        let config = triton_config(&kiln.url, &model).await;
        assert_eq!(config["dynamic_batching"]["preserve_ordering"], preserve);
        let slow = {
            let (c, model) = (c.clone(), model.clone());
            tokio::spawn(async move { c.infer(&request(&model, &[-3], None)).await.unwrap() })
        };
        wait_pending(&c, &model, 1.0).await;
        let sent = std::time::Instant::now();
        c.infer(&request(&model, &[1], None)).await.unwrap();
        let waited = sent.elapsed();
        if preserve {
            // Answered only once the slow batch formed before it was.
            assert!(
                waited >= Duration::from_millis(500),
                "fast answered after {waited:?}"
            );
        } else {
            // Answered at once, while the slow batch still runs.
            assert!(!slow.is_finished(), "fast answered after {waited:?}");
        }
        slow.await.unwrap();
        c.unload(&model).await.unwrap();
    }
}

/// A plain dynamic config (nothing to schedule: no delay, one level, no queue
/// policy) is batched on the instances' turns, with no `dynamic-` thread, and still
/// answers as the dynamic batcher does; anything to schedule brings the thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_dynamic_batcher_needs_no_thread_of_its_own() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let plain = c
        .load("faulty", &json!({"batcher": "dynamic", "batch_size": 8}))
        .await
        .unwrap();
    let answer = c.infer(&request(&plain, &[1, 2, 3], None)).await.unwrap();
    assert_eq!(answer.outputs[0].values::<i32>(), [1, 2, 3]);
    // Read once a request was answered: each thread has named itself by then.
    let names = thread_names(kiln.pid());
    assert!(
        names.contains(&format!("worker-{plain}-0")),
        "the instance runs: {names:?}"
    );
    assert!(
        !names.iter().any(|n| n.starts_with("dynamic-")),
        "no scheduler thread: {names:?}"
    );
    let config = triton_config(&kiln.url, &plain).await;
    assert_eq!(
        config["dynamic_batching"]["max_queue_delay_microseconds"], 0,
        "still reported as dynamic batching: {config}"
    );
    // A priority that is not one of its levels is refused as the queue refuses it.
    let err = c.infer(&request(&plain, &[1], Some(2))).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("not a level"), "{err}");
    assert_eq!(outcome(&c, &plain, "invalid").await, 1.0);
    // Each of these needs the scheduler.
    for scheduled in [
        json!({"batcher": "dynamic", "max_queue_delay_microseconds": 100}),
        json!({"batcher": "dynamic", "preferred_batch_size": [4]}),
        json!({"batcher": "dynamic", "priority_levels": 2}),
        json!({"batcher": "dynamic", "preserve_ordering": true}),
        json!({"batcher": "dynamic", "default_queue_policy.allow_timeout_override": true}),
        json!({"batcher": "dynamic", "default_queue_policy.default_timeout_microseconds": 1000}),
        json!({"batcher": "dynamic", "default_queue_policy.max_queue_size": 4}),
    ] {
        let model = c.load("faulty", &scheduled).await.unwrap();
        c.infer(&request(&model, &[1], None)).await.unwrap();
        let names = thread_names(kiln.pid());
        // Linux keeps 15 bytes of a thread's name.
        let mut thread = format!("dynamic-{model}");
        thread.truncate(15);
        assert!(names.contains(&thread), "{scheduled}: {names:?}");
        c.unload(&model).await.unwrap();
    }
}
