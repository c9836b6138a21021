//! Server-wide limits (finding 8 of the hardening issue): instances, batcher threads
//! and buffer memory, per model and in total. A load beyond one is refused with 400
//! and `{"error": ...}` naming the flag and its value; nothing of it remains, and a
//! load within the limits still works.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_client::{ClientError, DataType, HttpClient, InferRequest, InputTensor};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;
use serde_json::{json, Value};

/// Loads `worker` with `params` and expects a 400 naming `limit` (flag = value).
async fn refused(c: &HttpClient, worker: &str, params: Value, limit: &str) {
    match c.load(worker, &params).await {
        Err(ClientError::Status { status, message }) => {
            assert_eq!(status, 400, "{message}");
            assert!(message.contains(limit), "`{message}` should name {limit}");
        }
        other => panic!("load of {worker} {params} should be refused, got {other:?}"),
    }
}

async fn models(c: &HttpClient) -> Vec<String> {
    c.models().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_per_model_and_in_total() {
    let repo = TempRepository::new(&[(
        "wide",
        "worker = \"echo\"\n[parameters]\ninstances = 3\n",
        &[1],
    )]);
    let kiln = Kiln::start(&[
        "--max-instances-per-model",
        "2",
        "--max-instances",
        "3",
        "--model-repository",
        &repo.arg(),
    ]);
    let c = kiln.client.clone();
    refused(
        &c,
        "echo",
        json!({"instances": 3}),
        "--max-instances-per-model = 2",
    )
    .await;
    assert_eq!(
        c.load("echo", &json!({"instances": 2})).await.unwrap(),
        "echo"
    );
    // share=false adds an instance to the group: over the per-model limit.
    refused(
        &c,
        "echo",
        json!({"instances": 2, "share": false}),
        "--max-instances-per-model = 2",
    )
    .await;
    // Another model of one instance fits (3 in all); one more does not.
    let second = c.load("faulty", &json!({})).await.unwrap();
    refused(&c, "echo", json!({"batch_size": 4}), "--max-instances = 3").await;
    // The repository path is checked alike.
    match c.load_model("wide", &json!({})).await {
        Err(ClientError::Status { status, message }) => {
            assert_eq!(status, 400, "{message}");
            assert!(
                message.contains("--max-instances-per-model = 2"),
                "{message}"
            );
        }
        other => panic!("repository load should be refused, got {other:?}"),
    }
    // Over gRPC a load beyond a limit is RESOURCE_EXHAUSTED.
    let refused = kiln.grpc().await.load_model("wide", &[]).await.unwrap_err();
    assert_eq!(
        refused.grpc_code(),
        Some(tonic::Code::ResourceExhausted),
        "{refused}"
    );
    assert!(
        refused
            .to_string()
            .contains("--max-instances-per-model = 2"),
        "{refused}"
    );
    assert_eq!(models(&c).await, vec!["echo".to_owned(), second.clone()]);
    // An unload frees its share.
    c.unload(&second).await.unwrap();
    assert_eq!(
        c.load("echo", &json!({"batch_size": 4})).await.unwrap(),
        "echo-0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batcher_threads_per_model_and_in_total() {
    let kiln = Kiln::start(&[
        "--max-batcher-threads-per-model",
        "2",
        "--max-batcher-threads",
        "3",
    ]);
    let c = kiln.client.clone();
    refused(
        &c,
        "echo",
        json!({"batchers": 3}),
        "--max-batcher-threads-per-model = 2",
    )
    .await;
    c.load("echo", &json!({"batchers": 2})).await.unwrap();
    refused(
        &c,
        "echo",
        json!({"batchers": 2, "batch_size": 4}),
        "--max-batcher-threads = 3",
    )
    .await;
    // The dynamic batcher runs one scheduler thread, whatever `batchers` says.
    c.load("echo", &json!({"batcher": "dynamic", "batchers": 2}))
        .await
        .unwrap();
    assert_eq!(models(&c).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffer_memory_per_model_and_in_total() {
    // A `faulty` set is two 4 KiB buffers (INPUT0 and OUTPUT0 have a dynamic shape):
    // 8 KiB. Per model at most 5 sets, in all at most 8.
    let kiln = Kiln::start(&[
        "--max-buffer-bytes-per-model",
        "40960",
        "--max-buffer-bytes",
        "65536",
    ]);
    let c = kiln.client.clone();
    refused(
        &c,
        "faulty",
        json!({"max_buffers": 6}),
        "--max-buffer-bytes-per-model = 40960",
    )
    .await;
    c.load("faulty", &json!({"max_buffers": 5})).await.unwrap();
    refused(
        &c,
        "faulty",
        json!({"max_buffers": 4, "batch_size": 2}),
        "--max-buffer-bytes = 65536",
    )
    .await;
    let within = c
        .load("faulty", &json!({"max_buffers": 3, "batch_size": 2}))
        .await
        .unwrap();
    // The loaded models serve.
    let request = InferRequest {
        model: within,
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, 1],
            &[7i32],
        )],
        ..Default::default()
    };
    let answer = c.infer(&request).await.unwrap();
    assert_eq!(answer.outputs[0].values::<i32>(), vec![7]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_loads_never_exceed_the_total() {
    let kiln = Kiln::start(&["--max-instances", "3"]);
    let c = kiln.client.clone();
    // Six different configurations at once, one instance each: three fit.
    let loads: Vec<_> = (1..=6)
        .map(|n| {
            let c = c.clone();
            tokio::spawn(async move { c.load("echo", &json!({"batch_size": n})).await })
        })
        .collect();
    let mut loaded = 0;
    for load in loads {
        match load.await.unwrap() {
            Ok(_) => loaded += 1,
            Err(ClientError::Status { status, message }) => {
                assert_eq!(status, 400, "{message}");
                assert!(message.contains("--max-instances = 3"), "{message}");
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(loaded, 3);
    assert_eq!(models(&c).await.len(), 3);
}
