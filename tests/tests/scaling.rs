//! Scaling a loaded model while it serves (issue #31, item 4): its instances
//! raised and lowered over REST (`POST /v2/repository/models/{m}/scale`, and a
//! repository load whose only change is `instances`) and gRPC
//! (`RepositoryModelLoad` with `instances`), with 16 clients calling throughout and
//! every answer counted; the buffer pool and the metrics follow the count.
//! Loads the `echo`, `faulty` and `fpga-sim` plugins (build them and `kiln` first).

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_client::{DataType, GrpcClient, InferRequest, InputTensor, Param, ParamValue};
use kiln_tests::clients::Clients;
use kiln_tests::wait::wait_metric;
use kiln_tests::{metric, triton_config, Kiln};
use serde_json::json;

/// A model repository in a temp dir: `echo` (the echo worker) and `slow` (the
/// faulty worker, one request per batch: a batch holding -3 takes 1 s).
struct Repository(PathBuf);

impl Repository {
    fn new(test: &str) -> Repository {
        let root = std::env::temp_dir().join(format!("kiln-scaling-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (model, config) in [
            ("echo", "worker = \"echo\"\n"),
            (
                "slow",
                "worker = \"faulty\"\n[parameters]\nbatch_size = 1\n",
            ),
        ] {
            std::fs::create_dir_all(root.join(model).join("1")).unwrap();
            std::fs::write(root.join(model).join("config.toml"), config).unwrap();
        }
        Repository(root)
    }

    fn serve(&self, models: &str) -> Kiln {
        Kiln::start(&[
            "--model-repository",
            self.0.to_str().unwrap(),
            "--load-model",
            models,
        ])
    }
}

impl Drop for Repository {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The model's instance count and pool size, as its metrics and configuration say.
async fn instances_and_sets(kiln: &Kiln, model: &str) -> (f64, f64, u64) {
    let text = kiln.client.metrics().await.unwrap();
    let of = |name| metric(&text, name, &[("model", model)]).unwrap();
    let config = triton_config(&kiln.url, model).await;
    (
        of("kiln_worker_instances"),
        of("kiln_buffer_pool_size"),
        config["instance_group"][0]["count"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scaled_1_4_1_under_16_clients_no_request_fails_and_the_pool_follows() {
    let repo = Repository::new("under-load");
    let kiln = repo.serve("echo");
    let c = &kiln.client;
    let mut clients = Clients::start(c, "echo", 16);
    // The direct route, then a repository load whose only change is `instances`;
    // each step serves (more answers) before the next.
    let up = c.scale_model("echo", 4).await.unwrap();
    assert_eq!(up, json!({"instances": 4, "buffer_sets": 9}));
    assert_eq!(instances_and_sets(&kiln, "echo").await, (4.0, 9.0, 4));
    let answered = clients.answered_past(0).await;
    let down = c.scale_model("echo", 1).await.unwrap();
    assert_eq!(down, json!({"instances": 1, "buffer_sets": 3}));
    let answered = clients.answered_past(answered).await;
    c.load_model("echo", &json!({"instances": 4}))
        .await
        .unwrap();
    let answered = clients.answered_past(answered).await;
    c.load_model("echo", &json!({"instances": 1}))
        .await
        .unwrap();
    clients.answered_past(answered).await;
    clients.none_failed("scaled 1→4→1 twice").await;
    // The three instances told to leave have left; the pool is back to 3 sets.
    wait_metric(c, "kiln_worker_instances", "echo", 1.0).await;
    assert_eq!(instances_and_sets(&kiln, "echo").await, (1.0, 3.0, 1));
    // Scaled in place each time: never reloaded.
    let log = kiln.log();
    assert_eq!(log.matches("scaled `echo` from 1 to 4").count(), 2, "{log}");
    assert_eq!(log.matches("scaled `echo` from 4 to 1").count(), 2, "{log}");
    assert!(!log.contains("replaced `echo`"), "{log}");
}

/// The instances' busy time of `model` so far (`kiln_instance_busy_seconds`).
async fn busy_seconds(kiln: &Kiln, model: &str) -> f64 {
    let text = kiln.client.metrics().await.unwrap();
    metric(
        &text,
        "kiln_instance_busy_seconds_total",
        &[("model", model)],
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scaled_up_over_grpc_the_model_runs_batches_on_4_instances_at_once() {
    let repo = Repository::new("concurrency");
    let kiln = repo.serve("slow");
    let grpc = GrpcClient::connect(&kiln.grpc_url).await.unwrap();
    let instances = Param {
        key: "instances".into(),
        value: ParamValue::Int(4),
    };
    grpc.load_model("slow", &[instances]).await.unwrap();
    assert_eq!(instances_and_sets(&kiln, "slow").await, (4.0, 9.0, 4));
    assert!(kiln.log().contains("scaled `slow` from 1 to 4"));
    // 4 requests of one slow batch each (1 s in the worker), sent together. One
    // instance would be busy at most as long as they take in all; 4 at once are
    // busy about 4 times that.
    let before = busy_seconds(&kiln, "slow").await;
    let started = Instant::now();
    let calls: Vec<_> = (0..4)
        .map(|_| {
            let client = kiln.client.clone();
            tokio::spawn(async move {
                let request = InferRequest {
                    model: "slow".into(),
                    inputs: vec![InputTensor::from_slice(
                        "INPUT0",
                        DataType::Int32,
                        &[1, 1],
                        &[-3],
                    )],
                    ..Default::default()
                };
                client.infer(&request).await
            })
        })
        .collect();
    for call in calls {
        assert_eq!(
            call.await.unwrap().unwrap().outputs[0].values::<i32>(),
            [-3]
        );
    }
    let wall = started.elapsed().as_secs_f64();
    let busy = busy_seconds(&kiln, "slow").await - before;
    assert!(busy >= 3.9, "4 slow batches ran: {busy} s of instance time");
    assert!(
        busy > 1.5 * wall,
        "{busy:.2} s of instance time in {wall:.2} s: the batches did not run at once"
    );
    println!("4 slow batches: {busy:.2} s of instance time in {wall:.2} s");
}

#[tokio::test]
async fn scaling_is_in_the_restricted_model_repository_category_and_checks_its_input() {
    let repo = Repository::new("restricted");
    let kiln = Kiln::start(&[
        "--model-repository",
        repo.0.to_str().unwrap(),
        "--load-model",
        "echo",
        "--http-restricted-api",
        "model-repository:admin-key=s3cret",
    ]);
    let http = reqwest::Client::new();
    let scale = |body: serde_json::Value, key: Option<&str>| {
        let mut request = http
            .post(format!("{}/v2/repository/models/echo/scale", kiln.url))
            .json(&body);
        if let Some(key) = key {
            request = request.header("admin-key", key);
        }
        async move {
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    let (status, body) = scale(json!({"instances": 2}), None).await;
    assert_eq!(status, 403, "{body}");
    for bad in [
        json!({}),
        json!({"instances": 0}),
        json!({"instances": "2"}),
        json!({"instances": 2, "x": 1}),
    ] {
        let (status, body) = scale(bad.clone(), Some("s3cret")).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, body) = scale(json!({"instances": 100_000}), Some("s3cret")).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("--max-instances-per-model"), "{body}");
    let (status, body) = scale(json!({"instances": 2}), Some("s3cret")).await;
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer, json!({"instances": 2, "buffer_sets": 5}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_asynchronous_worker_scales_with_its_outstanding_batches_in_the_pool() {
    // fpga-sim: each instance keeps up to `max_outstanding` batches submitted, so
    // each takes max_outstanding + 1 buffer sets.
    let kiln = Kiln::start(&[]);
    let c = &kiln.client;
    let params =
        json!({"k": 16, "m": 8, "setup_us": 2000, "row_ns": 100_000, "max_outstanding": 2});
    let model = c.load("fpga-sim", &params).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..8i8)
        .map(|n| {
            let (client, stop, model) = (c.clone(), stop.clone(), model.clone());
            tokio::spawn(async move {
                let x: Vec<i8> = (0..16).map(|i| i - n).collect();
                let request = InferRequest {
                    model,
                    inputs: vec![InputTensor::from_slice("X", DataType::Int8, &[1, 16], &x)],
                    ..Default::default()
                };
                let (mut answered, mut failed) = (0u64, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    match client.infer(&request).await {
                        Ok(_) => answered += 1,
                        Err(e) => failed.push(e.to_string()),
                    }
                }
                (answered, failed)
            })
        })
        .collect();
    for (n, sets) in [(3, 10), (1, 4), (2, 7), (1, 4)] {
        let answer = c.scale_model(&model, n).await.unwrap();
        assert_eq!(answer, json!({"instances": n, "buffer_sets": sets}));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        let (answered, failed) = caller.await.unwrap();
        assert!(failed.is_empty(), "{failed:?}");
        assert!(answered > 0);
    }
    wait_metric(c, "kiln_worker_instances", &model, 1.0).await;
    assert_eq!(instances_and_sets(&kiln, &model).await, (1.0, 4.0, 1));
}
