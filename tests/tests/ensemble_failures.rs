//! Ensembles refused at load (each graph error, naming step and tensor), a failing
//! step, and requests cancelled or past their deadline while steps run: the real
//! `kiln` binary with the real plugins.

// Helpers outside `#[test]` functions: a failed request should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_tests::ensembles::{counts, get, graph, step, IN_U32, OUT_U32};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::wait::wait_sample;
use kiln_tests::Kiln;
use serde_json::{json, Value};

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
        (
            "wrong-version",
            graph(IN_U32, OUT_U32, &echo("IN", "OUT").replace("input_map", "model_version = 2\ninput_map")),
            vec!["step 1 (model `echo`): model `echo` version 2 is not loaded (loaded: version 1)"],
        ),
        (
            // echo4 is loaded from the repository for the ensemble, then found too small.
            "rows-beyond-a-step",
            graph(IN_U32, OUT_U32, &step("echo4", r#"INPUT0 = "IN""#, r#"OUTPUT0 = "OUT""#)),
            vec!["step 1 (model `echo4`): model `echo4` takes at most 4 rows a request (its batch_size), fewer than the ensemble's max_batch_size 8"],
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
    models.push((
        "echo4",
        "worker = \"echo\"\n[parameters]\nbatch_size = 4\n",
        &[1],
    ));
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
    let labels = [("model", "faults"), ("outcome", "cancelled")];
    let within = Duration::from_secs(5);
    wait_sample(&kiln.client, "kiln_requests_total", &labels, within, |v| {
        v == n
    })
    .await;
}

/// Waits until `model` has run `n` batches (its `execution_count`, counted once a
/// batch has answered: any step it would start is under way by then).
async fn wait_executions(kiln: &Kiln, model: &str, n: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while counts(kiln, model).await.2 < n {
        assert!(
            std::time::Instant::now() < deadline,
            "`{model}` ran fewer than {n} batches"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
    // The first step's batch answered: had the second step been sent, it would
    // have been then.
    wait_executions(&kiln, "first", 1).await;
    assert_eq!(counts(&kiln, "first").await.2, 1, "the first step ran");
    assert_eq!(counts(&kiln, "second").await, (0, 0, 0));

    // gRPC: the call's `grpc-timeout` passes while the first step runs (plain h2:
    // tonic's client would give up by itself).
    assert_eq!(
        grpc_status_within(&kiln, "300m").await,
        tonic::Code::DeadlineExceeded as i32
    );
    wait_cancelled(&kiln, 2.0).await;
    wait_executions(&kiln, "first", 2).await;
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
