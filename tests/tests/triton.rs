//! End-to-end: Triton's model configuration and statistics extensions, from the
//! real `kiln` binary with real plugins.

// Helpers outside `#[test]` functions: a failed request should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_tests::Kiln;
use serde_json::{json, Value};

async fn get(kiln: &Kiln, path: &str) -> (u16, Value) {
    let response = reqwest::get(format!("{}{path}", kiln.url)).await.unwrap();
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    (status, body)
}

async fn get_ok(kiln: &Kiln, path: &str) -> Value {
    let (status, body) = get(kiln, path).await;
    assert_eq!(status, 200, "{path}: {body}");
    body
}

fn echo_request(rows: usize, len: usize) -> InferRequest {
    let values: Vec<u32> = (0..(rows * len) as u32).collect();
    InferRequest {
        model: "echo".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[rows as i64, len as i64],
            &values,
        )],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_describes_each_loaded_group() {
    let kiln = Kiln::start(&[
        "--load",
        "echo:batch_size=8,timeout=5",
        "--load",
        "invert-image",
        "--load",
        "echo-multi",
    ]);
    let extensions = get_ok(&kiln, "/v2").await["extensions"].clone();
    for name in ["model_configuration", "statistics", "model_repository"] {
        assert!(
            extensions.as_array().unwrap().contains(&json!(name)),
            "{extensions}"
        );
    }

    let echo = get_ok(&kiln, "/v2/models/echo/config").await;
    assert_eq!(
        get_ok(&kiln, "/v2/models/echo/versions/1/config").await,
        echo
    );
    assert_eq!(echo["name"], "echo");
    assert_eq!(echo["platform"], "kiln_echo");
    assert_eq!(echo["backend"], "echo");
    // The group's batch size, which infer enforces, not the worker's 4096.
    assert_eq!(echo["max_batch_size"], 8);
    kiln.client.infer(&echo_request(8, 1)).await.unwrap();
    let err = kiln.client.infer(&echo_request(9, 1)).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert_eq!(echo["input"][0]["name"], "INPUT0");
    assert_eq!(echo["input"][0]["data_type"], "TYPE_UINT32");
    assert_eq!(echo["input"][0]["dims"], json!([-1]));
    assert_eq!(echo["output"][0]["name"], "OUTPUT0");
    assert_eq!(echo["output"][0]["data_type"], "TYPE_UINT32");
    assert_eq!(echo["instance_group"][0]["kind"], "KIND_CPU", "{echo}");
    assert_eq!(echo["instance_group"][0]["count"], 1);
    assert_eq!(echo["dynamic_batching"]["preferred_batch_size"], json!([8]));
    assert_eq!(
        echo["dynamic_batching"]["max_queue_delay_microseconds"],
        5000
    );
    assert_eq!(echo["parameters"]["batcher"]["string_value"], "soft");
    assert_eq!(echo["parameters"]["batch_size"]["string_value"], "8");
    assert_eq!(echo["parameters"]["timeout_ms"]["string_value"], "5");
    assert_eq!(echo["parameters"]["max_buffers"]["string_value"], "3");
    assert_eq!(echo["parameters"]["queue_size"]["string_value"], "4096");

    // A worker that does not batch: full shapes, no dynamic batching.
    let invert = get_ok(&kiln, "/v2/models/invert-image/config").await;
    assert_eq!(invert["max_batch_size"], 0);
    assert_eq!(invert["input"][0]["name"], "image");
    assert_eq!(invert["input"][0]["data_type"], "TYPE_UINT8");
    assert_eq!(invert["input"][0]["dims"], json!([-1, -1, -1]));
    assert!(invert.get("dynamic_batching").is_none(), "{invert}");

    // BYTES is Triton's TYPE_STRING.
    let multi = get_ok(&kiln, "/v2/models/echo-multi/config").await;
    let types = |key: &str| -> Vec<(String, String, Value)> {
        multi[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["name"].as_str().unwrap().to_owned(),
                    t["data_type"].as_str().unwrap().to_owned(),
                    t["dims"].clone(),
                )
            })
            .collect()
    };
    assert_eq!(
        types("input"),
        vec![
            ("INPUT0".into(), "TYPE_UINT32".into(), json!([-1])),
            ("INPUT1".into(), "TYPE_FP32".into(), json!([2])),
            ("INPUT2".into(), "TYPE_STRING".into(), json!([-1])),
        ]
    );
    assert_eq!(
        types("output"),
        vec![
            ("OUTPUT0".into(), "TYPE_UINT32".into(), json!([-1])),
            ("OUTPUT1".into(), "TYPE_FP64".into(), json!([2])),
            ("OUTPUT2".into(), "TYPE_STRING".into(), json!([-1])),
        ]
    );
    assert_eq!(multi["max_batch_size"], 64);

    for path in [
        "/v2/models/nope/config",
        "/v2/models/echo/versions/2/config",
    ] {
        let (status, body) = get(&kiln, path).await;
        assert_eq!(status, 404, "{path}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_count_what_the_instances_ran() {
    let kiln = Kiln::start(&[
        "--load",
        "echo:batch_size=8,timeout=20",
        "--load",
        "invert-image",
        "--load",
        "faulty",
    ]);
    // Nothing run yet: zeros, in Triton's schema.
    let idle = get_ok(&kiln, "/v2/models/echo/stats").await;
    assert_eq!(idle["model_stats"][0]["execution_count"], 0);
    assert_eq!(idle["model_stats"][0]["batch_stats"], json!([]));

    // N concurrent requests, some of two rows.
    const N: usize = 40;
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let c = kiln.client.clone();
            tokio::spawn(async move {
                let rows = 1 + i % 2;
                let response = c.infer(&echo_request(rows, 3)).await.unwrap();
                assert_eq!(response.outputs[0].shape, vec![rows as i64, 3]);
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let rows: u64 = (0..N).map(|i| 1 + (i % 2) as u64).sum();

    let body = get_ok(&kiln, "/v2/models/echo/stats").await;
    let stats = body["model_stats"].as_array().unwrap();
    assert_eq!(stats.len(), 1);
    let s = &stats[0];
    assert_eq!(s["name"], "echo");
    assert_eq!(s["version"], "1");
    assert!(s["last_inference"].as_u64().unwrap() > 0);
    assert_eq!(s["inference_count"], rows);
    let executions = s["execution_count"].as_u64().unwrap();
    assert!((1..=N as u64).contains(&executions), "{s}");
    let i = &s["inference_stats"];
    assert_eq!(i["success"]["count"], N);
    assert_eq!(i["fail"]["count"], 0);
    for stage in ["queue", "compute_input", "compute_infer", "compute_output"] {
        assert_eq!(i[stage]["count"], N, "{stage}: {s}");
    }
    assert!(i["queue"]["ns"].as_u64().unwrap() > 0, "{s}");
    assert!(i["compute_infer"]["ns"].as_u64().unwrap() > 0, "{s}");
    // A request's time is its wait plus its batch's compute stages.
    let ns = |stage: &str| i[stage]["ns"].as_u64().unwrap();
    assert_eq!(
        ns("success"),
        ns("queue") + ns("compute_input") + ns("compute_infer") + ns("compute_output")
    );
    let batches = s["batch_stats"].as_array().unwrap();
    assert!(!batches.is_empty());
    let mut counted = 0;
    let mut batched_rows = 0;
    for b in batches {
        let size = b["batch_size"].as_u64().unwrap();
        assert!((1..=8).contains(&size), "{b}");
        let count = b["compute_infer"]["count"].as_u64().unwrap();
        assert_eq!(b["compute_input"]["count"], count);
        assert_eq!(b["compute_output"]["count"], count);
        counted += count;
        batched_rows += size * count;
    }
    assert_eq!(
        counted, executions,
        "batch_stats sum to the execution count"
    );
    assert_eq!(batched_rows, rows);
    assert_eq!(
        get_ok(&kiln, "/v2/models/echo/versions/1/stats").await["model_stats"][0]["name"],
        "echo"
    );

    // A failed batch is counted as failed requests, not as an execution.
    let failing = InferRequest {
        model: "faulty".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, 2],
            &[5i32, -2],
        )],
        ..Default::default()
    };
    assert!(kiln.client.infer(&failing).await.is_err());

    // Every model, sorted by name.
    let all = get_ok(&kiln, "/v2/models/stats").await;
    let all = all["model_stats"].as_array().unwrap();
    let names: Vec<&str> = all.iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["echo", "faulty", "invert-image"]);
    assert_eq!(all[0]["inference_count"], rows);
    let faulty = &all[1];
    assert_eq!(faulty["inference_stats"]["fail"]["count"], 1);
    assert!(faulty["inference_stats"]["fail"]["ns"].as_u64().unwrap() > 0);
    assert_eq!(faulty["inference_stats"]["success"]["count"], 0);
    assert_eq!(faulty["execution_count"], 0);
    assert_eq!(all[2]["inference_count"], 0);

    for path in ["/v2/models/nope/stats", "/v2/models/echo/versions/2/stats"] {
        let (status, body) = get(&kiln, path).await;
        assert_eq!(status, 404, "{path}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
}

/// Details Triton's own QA tests check: the same output requested twice is a bad
/// request over both protocols, and a repository-index request with a field it
/// does not know is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_outputs_and_unknown_index_fields_are_refused() {
    let repo =
        kiln_tests::fixtures::TempRepository::new(&[("echo-r", "worker = \"echo\"\n", &[1])]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load", "echo-multi"]);
    let mut request = kiln_tests::fixtures::echo_multi_request("multi");
    request.outputs = Some(vec!["OUTPUT1".into(), "OUTPUT1".into()]);
    let err = kiln.client.infer(&request).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(
        err.to_string()
            .contains("`OUTPUT1` is requested more than once"),
        "{err}"
    );
    let message = kiln_server::grpc::convert::encode_request(&request);
    let status = kiln
        .grpc()
        .await
        .raw()
        .model_infer(message)
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("more than once"), "{status:?}");
    // Two different outputs are fine.
    request.outputs = Some(vec!["OUTPUT1".into(), "OUTPUT0".into()]);
    assert_eq!(kiln.client.infer(&request).await.unwrap().outputs.len(), 2);

    let index = |body: &'static str| {
        let url = format!("{}/v2/repository/index", kiln.url);
        async move {
            let response = reqwest::Client::new()
                .post(url)
                .body(body)
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    let (status, body) = index(r#"{"ready": true, "bogus": 1}"#).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("`bogus`"),
        "{body}"
    );
    let (status, body) = index(r#"{"ready": "yes"}"#).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = index(r#"{"ready": false}"#).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body[0]["name"], "echo-r", "{body}");
    let (status, body) = index(r#"{"ready": true}"#).await;
    assert_eq!((status, body), (200, json!([])));
}
