//! Ensembles (Triton's `platform: "ensemble"`): repository models wired from other
//! models by tensor names, served by the real `kiln` binary with the real plugins.

// Helpers outside `#[test]` functions: a failed request should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kiln_client::{DataType, InferRequest, InferResponse, InputTensor, NativeClient};
use kiln_server::ServerConfig;
use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;
use kiln_worker_sdk::encode_bytes;
use serde_json::{json, Value};

/// Two echo steps: OUT = IN + 2.
const CHAIN: &str = r#"
platform = "ensemble"
max_batch_size = 8
input = [{ name = "IN", data_type = "TYPE_UINT32", dims = [-1] }]
output = [{ name = "OUT", data_type = "TYPE_UINT32", dims = [-1] }]

[[ensemble_scheduling.step]]
model_name = "echo"
model_version = -1
input_map = { INPUT0 = "IN" }
output_map = { OUTPUT0 = "mid" }

[[ensemble_scheduling.step]]
model_name = "echo"
input_map = { INPUT0 = "mid" }
output_map = { OUTPUT0 = "OUT" }
"#;

/// The worker models the ensembles run on, and `chain` and `diamond` (the
/// example's own configuration).
fn repository(extra: &[(&str, &str, &[u64])]) -> TempRepository {
    let diamond = std::fs::read_to_string(
        kiln_tests::repo_root().join("examples/models/echo-diamond/config.toml"),
    )
    .unwrap();
    let mut models: Vec<(&str, &str, &[u64])> = vec![
        ("echo", "worker = \"echo\"\n", &[1]),
        ("echo-multi", "worker = \"echo-multi\"\n", &[1]),
        ("chain", CHAIN, &[]),
        ("diamond", &diamond, &[]),
    ];
    models.extend_from_slice(extra);
    TempRepository::new(&models)
}

fn chain_request(values: &[u32]) -> InferRequest {
    InferRequest {
        model: "chain".into(),
        id: Some("c1".into()),
        inputs: vec![InputTensor::from_slice(
            "IN",
            DataType::Uint32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    }
}

fn diamond_request() -> InferRequest {
    InferRequest {
        model: "diamond".into(),
        inputs: vec![
            InputTensor::from_slice("IN", DataType::Uint32, &[2, 2], &[1u32, 2, 10, 20]),
            InputTensor::from_slice("SCALE", DataType::Fp32, &[2, 2], &[0.5f32, 1.5, -1.0, 4.0]),
            InputTensor::from_slice(
                "TEXT",
                DataType::Bytes,
                &[2, 1],
                &encode_bytes(&["kiln", "ensemble"]),
            ),
        ],
        ..Default::default()
    }
}

fn check_diamond(r: &InferResponse) {
    assert_eq!(r.model_name, "diamond");
    let out = |name: &str| r.outputs.iter().find(|o| o.name == name).unwrap();
    assert_eq!(out("OUT").values::<u32>(), vec![4, 5, 13, 23]);
    assert_eq!(out("OUT").shape, vec![2, 2]);
    assert_eq!(out("DOUBLED").dtype, DataType::Fp64);
    assert_eq!(out("DOUBLED").values::<f64>(), vec![1.0, 3.0, -2.0, 8.0]);
    assert_eq!(
        out("TEXT_OUT").data.as_ref(),
        encode_bytes(&["kiln", "ensemble"]).as_slice()
    );
}

async fn get(kiln: &Kiln, path: &str) -> (u16, Value) {
    let response = reqwest::get(format!("{}{path}", kiln.url)).await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A model's `inference_stats` counts: (success, fail) and its execution count.
async fn counts(kiln: &Kiln, model: &str) -> (u64, u64, u64) {
    let (status, stats) = get(kiln, &format!("/v2/models/{model}/stats")).await;
    assert_eq!(status, 200, "{stats}");
    let s = &stats["model_stats"][0];
    (
        s["inference_stats"]["success"]["count"].as_u64().unwrap(),
        s["inference_stats"]["fail"]["count"].as_u64().unwrap(),
        s["execution_count"].as_u64().unwrap(),
    )
}

/// POSTs a JSON inference; its status and body.
async fn post_infer(kiln: &Kiln, model: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("{}/v2/models/{model}/infer", kiln.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn int32_body(values: &[i32]) -> Value {
    json!({"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1, values.len()], "data": values}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_and_diamond_over_every_ingress() {
    let repo = repository(&[]);
    // Loading the ensembles loads their step models from the repository.
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load-model",
        "chain",
        "--load-model",
        "diamond",
    ]);
    let c = &kiln.client;
    let r = c.infer(&chain_request(&[1, 2, 3])).await.unwrap();
    assert_eq!(r.outputs[0].name, "OUT");
    assert_eq!(r.outputs[0].values::<u32>(), vec![3, 4, 5]);
    assert_eq!(
        (
            r.model_name.as_str(),
            r.model_version.as_str(),
            r.id.as_deref()
        ),
        ("chain", "1", Some("c1"))
    );
    let r = c.infer_binary(&chain_request(&[7])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![9]);
    let g = kiln.grpc().await;
    let r = g.infer(&chain_request(&[40, 41])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![42, 43]);
    let mut stream = g.stream().await.unwrap();
    let r = stream.infer(&chain_request(&[5])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![7]);
    check_diamond(&c.infer(&diamond_request()).await.unwrap());
    check_diamond(&g.infer(&diamond_request()).await.unwrap());
    // Only the outputs asked for.
    let mut only = diamond_request();
    only.outputs = Some(vec!["DOUBLED".into()]);
    let r = c.infer(&only).await.unwrap();
    assert_eq!(r.outputs.len(), 1);
    assert_eq!(r.outputs[0].name, "DOUBLED");

    // A request that does not fit the ensemble's own inputs: 400, nothing run.
    let wrong = InferRequest {
        inputs: vec![InputTensor::from_slice(
            "IN",
            DataType::Fp32,
            &[1, 1],
            &[1.0f32],
        )],
        ..chain_request(&[])
    };
    let err = c.infer(&wrong).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("`IN`"), "{err}");

    // Readiness, metadata, index.
    assert_eq!(get(&kiln, "/v2/models/diamond/ready").await.0, 200);
    assert!(g.is_model_ready("chain").await.unwrap());
    let meta = c.model_metadata("diamond").await.unwrap();
    assert_eq!(meta["platform"], "ensemble");
    assert_eq!(meta["parameters"], json!({"max_batch_size": 8}));
    let tensors = |key: &str| -> Vec<(String, String, Value)> {
        meta[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["name"].as_str().unwrap().to_owned(),
                    t["datatype"].as_str().unwrap().to_owned(),
                    t["shape"].clone(),
                )
            })
            .collect()
    };
    assert_eq!(
        tensors("inputs"),
        vec![
            ("IN".into(), "UINT32".into(), json!([-1, -1])),
            ("SCALE".into(), "FP32".into(), json!([-1, 2])),
            ("TEXT".into(), "BYTES".into(), json!([-1, -1])),
        ]
    );
    assert_eq!(
        tensors("outputs")[1],
        ("DOUBLED".into(), "FP64".into(), json!([-1, 2]))
    );
    let grpc_meta = g.model_metadata("chain").await.unwrap();
    assert_eq!(grpc_meta.platform, "ensemble");
    assert_eq!(grpc_meta.inputs[0].name, "IN");
    let index = c.repository_index().await.unwrap();
    for name in ["chain", "diamond", "echo", "echo-multi"] {
        let entry = index.iter().find(|m| m["name"] == name).unwrap();
        assert_eq!(entry["state"], "READY", "{entry}");
    }

    // Statistics: each ensemble's own requests; each step counted by its model.
    assert_eq!(counts(&kiln, "chain").await, (4, 0, 4));
    assert_eq!(counts(&kiln, "diamond").await.0, 3);
    // echo: 2 steps × 4 chain requests, 2 (fork, left) × 3 diamond requests.
    assert_eq!(counts(&kiln, "echo").await.0, 14);
    assert_eq!(counts(&kiln, "echo-multi").await.0, 6);
    let metrics = c.metrics().await.unwrap();
    assert_eq!(
        kiln_tests::requests_outcome(&metrics, "chain", "success"),
        Some(4.0)
    );
    assert_eq!(
        kiln_tests::requests_outcome(&metrics, "chain", "invalid"),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_ensemble() {
    let repo = repository(&[]);
    let client = NativeClient::start(ServerConfig {
        plugin_dirs: vec![kiln_tests::build_dir()],
        model_repository: Some(repo.path().to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    client
        .server()
        .load_model("diamond", None, Vec::new())
        .await
        .unwrap();
    check_diamond(&client.infer(diamond_request()).await.unwrap());
    client.shutdown().await;
}

/// A one-step ensemble over `echo`.
fn via_echo() -> String {
    graph(
        IN_U32,
        OUT_U32,
        &step("echo", "INPUT0 = \"IN\"", "OUTPUT0 = \"OUT\""),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_requests_batch_with_direct_requests() {
    // The dynamic batcher holds a batch open 500 ms: every request sent at once
    // lands in it, from the ensemble or not.
    let repo = TempRepository::new(&[
        (
            "echo",
            "worker = \"echo\"\n[parameters]\nbatcher = \"dynamic\"\n\
             max_queue_delay_microseconds = 500000\n",
            &[1],
        ),
        ("via-echo", &via_echo(), &[]),
    ]);
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load-model",
        "via-echo",
    ]);
    let tasks: Vec<_> = (0..8u32)
        .map(|i| {
            let client = kiln.client.clone();
            tokio::spawn(async move {
                let (model, input) = if i % 2 == 0 {
                    ("echo", "INPUT0")
                } else {
                    ("via-echo", "IN")
                };
                let r = client
                    .infer(&InferRequest {
                        model: model.into(),
                        inputs: vec![InputTensor::from_slice(
                            input,
                            DataType::Uint32,
                            &[1, 1],
                            &[i],
                        )],
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                assert_eq!(r.outputs[0].values::<u32>(), vec![i + 1]);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let (_, stats) = get(&kiln, "/v2/models/echo/stats").await;
    let s = &stats["model_stats"][0];
    assert_eq!(s["inference_count"], 8, "{s}");
    assert_eq!(s["execution_count"], 1, "one batch held all eight: {s}");
    assert_eq!(s["batch_stats"][0]["batch_size"], 8, "{s}");
    assert_eq!(counts(&kiln, "via-echo").await, (4, 0, 4));
}

/// An ensemble over echo and echo-multi with `steps` (TOML) and these tensors.
fn graph(inputs: &str, outputs: &str, steps: &str) -> String {
    format!(
        "platform = \"ensemble\"\nmax_batch_size = 8\ninput = [{inputs}]\noutput = [{outputs}]\n{steps}"
    )
}

fn step(model: &str, inputs: &str, outputs: &str) -> String {
    format!(
        "[[ensemble_scheduling.step]]\nmodel_name = \"{model}\"\ninput_map = {{ {inputs} }}\n\
         output_map = {{ {outputs} }}\n"
    )
}

const IN_U32: &str = r#"{ name = "IN", data_type = "TYPE_UINT32", dims = [-1] }"#;
const OUT_U32: &str = r#"{ name = "OUT", data_type = "TYPE_UINT32", dims = [-1] }"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graph_errors_are_refused_at_load_naming_step_and_tensor() {
    let echo = |i: &str, o: &str| {
        step(
            "echo",
            &format!("INPUT0 = \"{i}\""),
            &format!("OUTPUT0 = \"{o}\""),
        )
    };
    let multi_in = r#"{ name = "IN", data_type = "TYPE_UINT32", dims = [-1] }, { name = "F", data_type = "TYPE_FP32", dims = [3] }, { name = "T", data_type = "TYPE_STRING", dims = [-1] }"#;
    let cases: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "unknown-model",
            graph(IN_U32, OUT_U32, &step("nope", "INPUT0 = \"IN\"", "OUTPUT0 = \"OUT\"")),
            vec!["step 1 (model `nope`)", "model `nope` is not loaded"],
        ),
        (
            "missing-tensor",
            graph(IN_U32, OUT_U32, &(echo("IN", "mid") + &echo("ghost", "OUT"))),
            vec!["step 2 (model `echo`) input `INPUT0` reads tensor `ghost`"],
        ),
        (
            "produced-twice",
            graph(IN_U32, OUT_U32, &(echo("IN", "mid") + &echo("IN", "mid") + &echo("mid", "OUT"))),
            vec!["tensor `mid` is produced twice", "step 1 (model `echo`)", "step 2 (model `echo`) output `OUTPUT0`"],
        ),
        (
            "cycle",
            graph(IN_U32, OUT_U32, &(echo("x", "y") + &echo("y", "x") + &echo("IN", "OUT"))),
            vec!["cycle", "step 1 (model `echo`) reads `x`, written by step 2 (model `echo`)", "step 2 (model `echo`) reads `y`, written by step 1"],
        ),
        (
            "dtype-mismatch",
            graph(
                &multi_in.replace(r#"{ name = "F", data_type = "TYPE_FP32", dims = [3] }, "#, ""),
                r#"{ name = "OUT", data_type = "TYPE_UINT32", dims = [-1] }"#,
                &step("echo-multi", r#"INPUT0 = "IN", INPUT1 = "IN", INPUT2 = "T""#, r#"OUTPUT0 = "OUT""#),
            ),
            vec!["step 1 (model `echo-multi`) input `INPUT1` (FP32 [-1, 2]) does not match tensor `IN` (UINT32 [-1, -1])"],
        ),
        (
            "shape-mismatch",
            graph(
                multi_in,
                r#"{ name = "OUT", data_type = "TYPE_UINT32", dims = [-1] }"#,
                &step("echo-multi", r#"INPUT0 = "IN", INPUT1 = "F", INPUT2 = "T""#, r#"OUTPUT0 = "OUT""#),
            ),
            vec!["step 1 (model `echo-multi`) input `INPUT1` (FP32 [-1, 2]) does not match tensor `F` (FP32 [-1, 3])"],
        ),
        (
            "output-mismatch",
            graph(IN_U32, r#"{ name = "OUT", data_type = "TYPE_FP32", dims = [-1] }"#, &echo("IN", "OUT")),
            vec!["ensemble output `OUT` (FP32 [-1, -1]) does not match tensor `OUT` (UINT32 [-1, -1]), written by step 1 (model `echo`) output `OUTPUT0`"],
        ),
        (
            "unmapped-input",
            graph(IN_U32, OUT_U32, &step("echo-multi", r#"INPUT0 = "IN""#, r#"OUTPUT0 = "OUT""#)),
            vec!["step 1 (model `echo-multi`): input `INPUT1` of model `echo-multi` is not in the step's `input_map`"],
        ),
        (
            "not-an-output",
            graph(IN_U32, OUT_U32, &step("echo", r#"INPUT0 = "IN""#, r#"OUTPUT9 = "OUT""#)),
            vec!["step 1 (model `echo`): `output_map` names `OUTPUT9` (for tensor `OUT`)"],
        ),
        (
            "unknown-key",
            graph(IN_U32, OUT_U32, &echo("IN", "OUT")).replace("input_map", "inputs_map"),
            vec!["inputs_map"],
        ),
        (
            "unread-input",
            graph(&format!("{IN_U32}, {{ name = \"SPARE\", data_type = \"UINT32\", dims = [1] }}"), OUT_U32, &echo("IN", "OUT")),
            vec!["ensemble input `SPARE` is read by no step"],
        ),
    ];
    let texts: Vec<(String, String)> = cases
        .iter()
        .map(|(n, t, _)| (n.to_string(), t.clone()))
        .collect();
    let mut models: Vec<(&str, &str, &[u64])> = texts
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str(), &[][..]))
        .collect();
    models.push(("echo", "worker = \"echo\"\n", &[1]));
    models.push(("echo-multi", "worker = \"echo-multi\"\n", &[1]));
    let repo = TempRepository::new(&models);
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load",
        "echo",
        "--load",
        "echo-multi",
    ]);
    for (name, _, wanted) in &cases {
        let err = kiln.client.load_model(name, &json!({})).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{name}: {err}");
        let message = err.to_string();
        for part in wanted {
            assert!(message.contains(part), "{name}: `{part}` not in: {message}");
        }
        assert_eq!(
            get(&kiln, &format!("/v2/models/{name}/ready")).await.0,
            404,
            "{name}"
        );
    }
    // gRPC answers the same refusal as INVALID_ARGUMENT.
    let err = kiln
        .grpc()
        .await
        .load_model("cycle", &[])
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kiln_client::ClientError::Grpc { code: tonic::Code::InvalidArgument, message } if message.contains("cycle")),
        "{err}"
    );
}

/// `first` then `second`, both the faulty worker (INT32).
fn faults() -> String {
    let int32 =
        |name: &str| format!("{{ name = \"{name}\", data_type = \"TYPE_INT32\", dims = [-1] }}");
    let steps = step("first", "INPUT0 = \"IN\"", "OUTPUT0 = \"mid\"")
        + &step("second", "INPUT0 = \"mid\"", "OUTPUT0 = \"OUT\"");
    graph(&int32("IN"), &int32("OUT"), &steps)
}

fn faulty_repository() -> TempRepository {
    TempRepository::new(&[
        ("first", "worker = \"faulty\"\n", &[1]),
        ("second", "worker = \"faulty\"\n", &[1]),
        ("faults", &faults(), &[]),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_fails_the_request_with_its_error() {
    let repo = faulty_repository();
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "faults"]);
    let (status, body) = post_infer(&kiln, "faults", int32_body(&[-2])).await;
    assert_eq!(status, 500, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("ensemble `faults` step 1 (model `first`)")
            && error.contains("faulty worker saw -2"),
        "{error}"
    );
    let (status, body) = post_infer(&kiln, "faults", int32_body(&[-7])).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("step 1 (model `first`): faulty worker refused -7"),
        "{body}"
    );
    // gRPC: the step's status code.
    let err = kiln
        .grpc()
        .await
        .infer(&InferRequest {
            model: "faults".into(),
            inputs: vec![InputTensor::from_slice(
                "IN",
                DataType::Int32,
                &[1, 1],
                &[-8i32],
            )],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kiln_client::ClientError::Grpc { code: tonic::Code::Internal, message } if message.contains("faulty worker failed on -8")),
        "{err}"
    );
    // Nothing reached the second step; the ensemble counts its failures.
    assert_eq!(counts(&kiln, "second").await, (0, 0, 0));
    assert_eq!(counts(&kiln, "faults").await.1, 3);
    let (status, body) = post_infer(&kiln, "faults", int32_body(&[5, 6])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outputs"][0]["data"], json!([5, 6]));
    assert_eq!(counts(&kiln, "second").await.0, 1);
}

/// Waits until `faults` has counted `n` requests cancelled.
async fn wait_cancelled(kiln: &Kiln, n: f64) {
    let mut cancelled = None;
    for _ in 0..500 {
        let metrics = kiln.client.metrics().await.unwrap();
        cancelled = kiln_tests::requests_outcome(&metrics, "faults", "cancelled");
        if cancelled == Some(n) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("`faults` counted {cancelled:?} cancelled, not {n}");
}

/// A `ModelInfer` of `faults` with IN = [-3] (the first step takes 1 s) sent over
/// plain HTTP/2 with `grpc-timeout: timeout`; the answer's `grpc-status`.
async fn grpc_status_within(kiln: &Kiln, timeout: &str) -> i32 {
    let request = InferRequest {
        model: "faults".into(),
        inputs: vec![InputTensor::from_slice(
            "IN",
            DataType::Int32,
            &[1, 1],
            &[-3i32],
        )],
        ..Default::default()
    };
    let message =
        prost::Message::encode_to_vec(&kiln_server::grpc::convert::encode_request(&request));
    let mut body = vec![0u8];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(&message);
    let tcp = tokio::net::TcpStream::connect(kiln.grpc_url.trim_start_matches("http://"))
        .await
        .unwrap();
    let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let headers = tonic::codegen::http::Request::post(format!(
        "{}/inference.GRPCInferenceService/ModelInfer",
        kiln.grpc_url
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .header("grpc-timeout", timeout)
    .body(())
    .unwrap();
    let (response, mut send) = h2.send_request(headers, false).unwrap();
    send.send_data(bytes::Bytes::from(body), true).unwrap();
    let response = response.await.unwrap();
    response.headers()["grpc-status"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_and_deadlines_stop_the_remaining_steps() {
    let repo = faulty_repository();
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "faults"]);
    // -3: the first step takes 1 s; the client leaves after 300 ms.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let sent = impatient
        .post(format!("{}/v2/models/faults/infer", kiln.url))
        .json(&int32_body(&[-3]))
        .send()
        .await;
    assert!(sent.is_err(), "the client gave up");
    // The first step's batch ends after 1 s; the second step is never sent.
    wait_cancelled(&kiln, 1.0).await;
    // Past the first step's 1 s: had the second step been sent, it would have run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(counts(&kiln, "first").await.2, 1, "the first step ran");
    assert_eq!(counts(&kiln, "second").await, (0, 0, 0));

    // gRPC: the call's `grpc-timeout` passes while the first step runs (plain h2:
    // tonic's client would give up by itself).
    assert_eq!(
        grpc_status_within(&kiln, "300m").await,
        tonic::Code::DeadlineExceeded as i32
    );
    wait_cancelled(&kiln, 2.0).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(counts(&kiln, "first").await.2, 2);
    assert_eq!(counts(&kiln, "second").await, (0, 0, 0));

    // Triton's `timeout` (µs) bounds the whole ensemble: the second step would
    // start after it.
    let mut body = int32_body(&[-3]);
    body["parameters"] = json!({"timeout": 300_000});
    let (status, body) = post_infer(&kiln, "faults", body).await;
    assert_eq!(status, 503, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("step 2 (model `second`)") && error.contains("timeout expired"),
        "{error}"
    );
    assert_eq!(counts(&kiln, "second").await, (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_in_triton_form_over_rest_and_grpc() {
    let repo = repository(&[]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "chain"]);
    let (status, config) = get(&kiln, "/v2/models/chain/config").await;
    assert_eq!(status, 200, "{config}");
    assert_eq!(config["platform"], "ensemble");
    assert_eq!(config["max_batch_size"], 8);
    assert_eq!(config["instance_group"], json!([]));
    assert!(config.get("dynamic_batching").is_none(), "{config}");
    assert_eq!(config["input"][0]["name"], "IN");
    assert_eq!(config["input"][0]["data_type"], "TYPE_UINT32");
    assert_eq!(config["input"][0]["dims"], json!([-1]));
    assert_eq!(
        config["ensemble_scheduling"],
        json!({"step": [
            {"model_name": "echo", "model_version": -1, "input_map": {"INPUT0": "IN"},
             "output_map": {"OUTPUT0": "mid"}, "model_namespace": ""},
            {"model_name": "echo", "model_version": -1, "input_map": {"INPUT0": "mid"},
             "output_map": {"OUTPUT0": "OUT"}, "model_namespace": ""},
        ]})
    );
    let config = kiln.grpc().await.model_config("chain").await.unwrap();
    assert_eq!(config.platform, "ensemble");
    assert!(config.instance_group.is_empty());
    use kiln_server::grpc::proto::model_config::SchedulingChoice;
    let Some(SchedulingChoice::EnsembleScheduling(e)) = config.scheduling_choice else {
        panic!("not an ensemble: {config:?}");
    };
    assert_eq!(e.step.len(), 2);
    assert_eq!(e.step[1].model_name, "echo");
    assert_eq!(e.step[1].model_version, -1);
    assert_eq!(
        e.step[1].input_map.get("INPUT0").map(String::as_str),
        Some("mid")
    );
    assert_eq!(
        e.step[1].output_map.get("OUTPUT0").map(String::as_str),
        Some("OUT")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unloading_a_step_model_makes_the_ensemble_unavailable_until_reloaded() {
    let repo = repository(&[]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "chain"]);
    let c = &kiln.client;
    c.unload_model("echo").await.unwrap();
    assert_eq!(get(&kiln, "/v2/models/chain/ready").await.0, 503);
    let err = c.infer(&chain_request(&[1])).await.unwrap_err();
    assert_eq!(err.status(), Some(503), "{err}");
    assert!(
        err.to_string()
            .contains("step 1 (model `echo`): model `echo` is not loaded"),
        "{err}"
    );
    let index = c.repository_index().await.unwrap();
    let chain = index.iter().find(|m| m["name"] == "chain").unwrap();
    assert_eq!(chain["state"], "UNAVAILABLE", "{chain}");
    assert_eq!(chain["reason"], "a step's model is not loaded or not ready");
    c.load_model("echo", &json!({})).await.unwrap();
    assert_eq!(get(&kiln, "/v2/models/chain/ready").await.0, 200);
    let r = c.infer(&chain_request(&[1])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![3]);
}

#[test]
fn tritonclient_reads_and_runs_an_ensemble() {
    let repo = repository(&[]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "chain"]);
    kiln_tests::pytest::run_pytest(&kiln, "tests/tritonclient-ensemble", &[]);
}
