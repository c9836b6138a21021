//! End-to-end over gRPC: the real `kiln` binary serving Triton's
//! `inference.GRPCInferenceService`, driven by kiln's tonic client.

// Helpers outside the test functions unwrap too: a failed step fails the test.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use kiln_client::{ClientError, DataType, InferRequest, InputTensor, Param, ParamValue};
use kiln_server::grpc::proto::{
    self, infer_parameter::ParameterChoice, model_config::SchedulingChoice,
    model_infer_request::InferInputTensor, model_repository_parameter, InferTensorContents,
    ModelInferRequest,
};
use kiln_tests::fixtures::{
    check_echo_multi, compress, echo_multi_request, ShmObject, TempRepository,
};
use kiln_tests::{metric, requests_outcome, Kiln};
use serde_json::Value;
use tonic::Code;

fn echo_request(model: &str, id: &str, values: &[u32]) -> InferRequest {
    InferRequest {
        model: model.into(),
        id: Some(id.into()),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    }
}

/// A request for the `faulty` worker: -2 fails its batch, -3 takes 1 s.
fn faulty_request(value: i32) -> InferRequest {
    InferRequest {
        model: "faulty".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, 1],
            &[value],
        )],
        ..Default::default()
    }
}

fn failure(result: Result<impl std::fmt::Debug, ClientError>) -> (Code, String) {
    match result {
        Err(e) => (e.grpc_code().unwrap_or(Code::Unknown), e.to_string()),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

async fn rest_json(kiln: &Kiln, path: &str) -> Value {
    reqwest::get(format!("{}{path}", kiln.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_metadata_config_and_statistics() {
    let kiln = Kiln::start(&["--load", "echo:batch_size=8", "--load", "invert-image"]);
    let c = kiln.grpc().await;
    assert!(c.is_live().await.unwrap());
    assert!(c.is_ready().await.unwrap());
    assert!(c.is_model_ready("echo").await.unwrap());
    assert!(
        c.is_model_ready("ECHO").await.unwrap(),
        "names are case-insensitive"
    );
    assert!(!c.is_model_ready("nope").await.unwrap());
    let version_2 = proto::ModelReadyRequest {
        name: "echo".into(),
        version: "2".into(),
    };
    assert!(
        !c.raw()
            .model_ready(version_2)
            .await
            .unwrap()
            .into_inner()
            .ready
    );

    let meta = c.server_metadata().await.unwrap();
    assert_eq!(meta.name, "kiln");
    let rest = rest_json(&kiln, "/v2").await;
    assert_eq!(meta.version, rest["version"].as_str().unwrap());
    let rest_extensions: Vec<&str> = rest["extensions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(meta.extensions, rest_extensions);

    let echo = c.model_metadata("echo").await.unwrap();
    assert_eq!(echo.name, "echo");
    assert_eq!(echo.versions, vec!["1"]);
    assert_eq!(echo.platform, "kiln_echo");
    assert_eq!(echo.inputs[0].name, "INPUT0");
    assert_eq!(echo.inputs[0].datatype, "UINT32");
    assert_eq!(echo.inputs[0].shape, vec![-1, -1]);
    assert_eq!(echo.outputs[0].name, "OUTPUT0");
    let image = c.model_metadata("invert-image").await.unwrap();
    assert_eq!(image.inputs[0].shape, vec![-1, -1, -1], "no batch dim");

    // The configuration is the one REST serves, as protobuf.
    let config = c.model_config("echo").await.unwrap();
    let rest = rest_json(&kiln, "/v2/models/echo/config").await;
    assert_eq!(config.name, "echo");
    assert_eq!(config.platform, rest["platform"].as_str().unwrap());
    assert_eq!(config.backend, "echo");
    assert_eq!(
        i64::from(config.max_batch_size),
        rest["max_batch_size"].as_i64().unwrap()
    );
    assert_eq!(config.input[0].name, "INPUT0");
    assert_eq!(
        config.input[0].data_type,
        proto::DataType::TypeUint32 as i32
    );
    assert_eq!(config.input[0].dims, vec![-1]);
    assert!(config.input[0].allow_ragged_batch);
    assert_eq!(
        config.output[0].data_type,
        proto::DataType::TypeUint32 as i32
    );
    assert_eq!(config.instance_group[0].count, 1);
    assert_eq!(
        config.instance_group[0].kind,
        proto::model_instance_group::Kind::Cpu as i32
    );
    let Some(SchedulingChoice::DynamicBatching(batching)) = &config.scheduling_choice else {
        panic!("echo batches: {config:?}");
    };
    assert_eq!(batching.preferred_batch_size, vec![8]);
    assert_eq!(
        batching.max_queue_delay_microseconds,
        rest["dynamic_batching"]["max_queue_delay_microseconds"]
            .as_u64()
            .unwrap()
    );
    assert_eq!(
        u64::from(batching.default_queue_policy.unwrap().max_queue_size),
        rest["dynamic_batching"]["default_queue_policy"]["max_queue_size"]
            .as_u64()
            .unwrap()
    );
    let rest_params = rest["parameters"].as_object().unwrap();
    assert_eq!(config.parameters.len(), rest_params.len());
    for (key, value) in &config.parameters {
        assert_eq!(
            value.string_value,
            rest_params[key]["string_value"].as_str().unwrap(),
            "{key}"
        );
    }
    assert_eq!(config.parameters["batch_size"].string_value, "8");
    let image = c.model_config("invert-image").await.unwrap();
    assert_eq!(image.max_batch_size, 0);
    assert!(image.scheduling_choice.is_none());
    assert_eq!(image.input[0].dims, vec![-1, -1, -1]);

    // Statistics count what ran, and match REST's.
    for i in 0..5u32 {
        c.infer(&echo_request("echo", "s", &[i, i])).await.unwrap();
    }
    let stats = c.model_statistics(Some("echo")).await.unwrap();
    assert_eq!(stats.len(), 1);
    let s = &stats[0];
    assert_eq!((s.name.as_str(), s.version.as_str()), ("echo", "1"));
    assert_eq!(s.inference_count, 5);
    let inference = s.inference_stats.unwrap();
    assert_eq!(inference.success.unwrap().count, 5);
    assert_eq!(inference.fail.unwrap().count, 0);
    assert!(inference.compute_infer.unwrap().ns > 0);
    let rest = rest_json(&kiln, "/v2/models/echo/stats").await;
    let rest = &rest["model_stats"][0];
    assert_eq!(s.inference_count, rest["inference_count"].as_u64().unwrap());
    assert_eq!(s.execution_count, rest["execution_count"].as_u64().unwrap());
    assert_eq!(
        inference.queue.unwrap().ns,
        rest["inference_stats"]["queue"]["ns"].as_u64().unwrap()
    );
    let batched: u64 = s
        .batch_stats
        .iter()
        .map(|b| b.batch_size * b.compute_infer.unwrap().count)
        .sum();
    assert_eq!(batched, 5);
    let all = c.model_statistics(None).await.unwrap();
    let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, vec!["echo", "invert-image"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infer_raw_and_typed_contents_with_echo_multi() {
    let kiln = Kiln::start(&["--load", "echo-multi", "--load", "echo"]);
    let c = kiln.grpc().await;
    let mut request = echo_multi_request("multi-1");
    let r = c.infer(&request).await.unwrap();
    assert_eq!(r.id.as_deref(), Some("multi-1"));
    assert_eq!(r.model_name, "echo-multi");
    assert_eq!(r.model_version, "1");
    check_echo_multi(&r);
    // Requested outputs only.
    request.outputs = Some(vec!["OUTPUT1".into()]);
    let r = c.infer(&request).await.unwrap();
    assert_eq!(r.outputs.len(), 1);
    assert_eq!(r.outputs[0].name, "OUTPUT1");

    // The same through typed `contents` (BYTES elements as bytes_contents).
    let typed = |name: &str, datatype: &str, shape: &[i64], contents: InferTensorContents| {
        InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
            parameters: HashMap::new(),
            contents: Some(contents),
        }
    };
    let message = ModelInferRequest {
        model_name: "echo-multi".into(),
        id: "typed".into(),
        inputs: vec![
            typed(
                "INPUT0",
                "UINT32",
                &[1, 3],
                InferTensorContents {
                    uint_contents: vec![1, 2, 3],
                    ..Default::default()
                },
            ),
            typed(
                "INPUT1",
                "FP32",
                &[1, 2],
                InferTensorContents {
                    fp32_contents: vec![0.5, -1.0],
                    ..Default::default()
                },
            ),
            typed(
                "INPUT2",
                "BYTES",
                &[1, 2],
                InferTensorContents {
                    bytes_contents: vec![Bytes::from_static(b"kiln"), Bytes::new()],
                    ..Default::default()
                },
            ),
        ],
        ..Default::default()
    };
    let r = c.infer_message(message).await.unwrap();
    assert_eq!(r.id, "typed");
    assert_eq!(r.raw_output_contents.len(), 3, "answers are raw");
    assert_eq!(r.outputs[1].datatype, "FP64");
    let doubled: Vec<f64> = r.raw_output_contents[1]
        .chunks(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(doubled, vec![1.0, -2.0]);
    assert_eq!(r.raw_output_contents[2].as_ref(), b"\x04\0\0\0nlik\0\0\0\0");

    // Request parameters reach the worker: echo adds `increment`.
    let mut request = echo_request("echo", "inc", &[10, 20]);
    request.parameters = vec![Param {
        key: "increment".into(),
        value: ParamValue::Int(5),
    }];
    let r = c.infer(&request).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![15, 25]);
    let mut message = kiln_server::grpc::convert::encode_request(&request);
    message.parameters.insert(
        "increment".into(),
        proto::InferParameter {
            parameter_choice: Some(ParameterChoice::Uint64Param(7)),
        },
    );
    let r = c.infer_message(message).await.unwrap();
    assert_eq!(
        r.raw_output_contents[0].as_ref(),
        &[17, 0, 0, 0, 27, 0, 0, 0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_answers_in_order_with_ids_and_survives_errors() {
    let kiln = Kiln::start(&["--load", "echo:batch_size=16,timeout=2"]);
    let c = kiln.grpc().await;
    let mut stream = c.stream().await.unwrap();
    // One at a time.
    for i in 0..5u32 {
        let r = stream
            .infer(&echo_request("echo", &format!("one-{i}"), &[i]))
            .await
            .unwrap();
        assert_eq!(r.id.as_deref(), Some(format!("one-{i}").as_str()));
        assert_eq!(r.outputs[0].values::<u32>(), vec![i + 1]);
    }
    // Many in flight, one of them refused: answers come in order, the error with its id.
    for i in 0..200u32 {
        let model = if i == 50 { "nope" } else { "echo" };
        stream
            .send(&echo_request(model, &format!("burst-{i}"), &[i, i * 2]))
            .await
            .unwrap();
    }
    for i in 0..200u32 {
        let answer = stream.recv().await;
        if i == 50 {
            match answer {
                Err(ClientError::Stream { id, message }) => {
                    assert_eq!(id.as_deref(), Some("burst-50"));
                    assert!(message.contains("no model `nope`"), "{message}");
                }
                other => panic!("request 50 should fail: {other:?}"),
            }
            continue;
        }
        let r = answer.unwrap().unwrap();
        assert_eq!(r.id.as_deref(), Some(format!("burst-{i}").as_str()));
        assert_eq!(r.outputs[0].values::<u32>(), vec![i + 1, i * 2 + 1]);
    }
    // A misfit request answers with its error and the stream goes on.
    let mut bad = echo_request("echo", "bad-shape", &[1]);
    bad.inputs[0].shape = vec![2];
    stream.send(&bad).await.unwrap();
    match stream.recv().await {
        Err(ClientError::Stream { id, message }) => {
            assert_eq!(id.as_deref(), Some("bad-shape"));
            assert!(message.contains("expected shape"), "{message}");
        }
        other => panic!("expected a stream error: {other:?}"),
    }
    let r = stream
        .infer(&echo_request("echo", "after", &[9]))
        .await
        .unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![10]);
    // Closing our side ends the stream once everything is answered.
    stream
        .send(&echo_request("echo", "last", &[1]))
        .await
        .unwrap();
    stream.close_send();
    assert_eq!(
        stream.recv().await.unwrap().unwrap().id.as_deref(),
        Some("last")
    );
    assert!(stream.recv().await.unwrap().is_none());
    let text = kiln.client.metrics().await.unwrap();
    assert!(
        metric(&text, "kiln_batch_size_count", &[("model", "echo")]).unwrap() < 206.0,
        "one stream's requests should share batches"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_map_to_grpc_codes() {
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        "--load",
        "faulty",
        "--grpc-max-message-bytes",
        "4096",
    ]);
    let c = kiln.grpc().await;
    // Unknown model or version.
    let (code, message) = failure(c.infer(&echo_request("nope", "x", &[1])).await);
    assert_eq!(code, Code::NotFound, "{message}");
    assert!(message.contains("no model `nope`"), "{message}");
    assert_eq!(code_of(c.model_metadata("nope").await), Code::NotFound);
    assert_eq!(code_of(c.model_config("nope").await), Code::NotFound);
    assert_eq!(
        code_of(c.model_statistics(Some("nope")).await),
        Code::NotFound
    );
    let mut message = kiln_server::grpc::convert::encode_request(&echo_request("echo", "v", &[1]));
    message.model_version = "2".into();
    let (code, text) = failure(c.infer_message(message.clone()).await);
    assert_eq!(code, Code::NotFound, "{text}");
    assert!(
        text.contains("Request for unknown model: 'echo' version 2 is not found"),
        "{text}"
    );
    message.model_version = "1".into();
    c.infer_message(message.clone()).await.unwrap();

    // Requests that do not fit the model.
    let cases: Vec<(ModelInferRequest, &str)> = vec![
        (
            {
                let mut m = message.clone();
                m.inputs[0].shape = vec![2];
                m
            },
            "expected shape [-1, -1]",
        ),
        (
            {
                let mut m = message.clone();
                m.inputs[0].datatype = "FP32".into();
                m
            },
            "expected datatype UINT32",
        ),
        (
            {
                let mut m = message.clone();
                m.inputs[0].datatype = "NOPE".into();
                m
            },
            "unknown datatype `NOPE`",
        ),
        (
            {
                let mut m = message.clone();
                m.inputs[0].shape = vec![1, 3];
                m
            },
            "needs 12 bytes of data, got 4",
        ),
        (
            {
                let mut m = message.clone();
                m.raw_input_contents.push(Bytes::from_static(&[0; 4]));
                m
            },
            "2 entries for 1 inputs",
        ),
        (
            {
                let mut m = message.clone();
                m.raw_input_contents.clear();
                m.inputs[0].contents = Some(InferTensorContents {
                    fp32_contents: vec![1.0],
                    ..Default::default()
                });
                m
            },
            "goes in uint_contents, not fp32_contents",
        ),
        (
            {
                let mut m = message.clone();
                m.inputs[0].name = "X".into();
                m
            },
            "unknown input `X`",
        ),
        (
            {
                let mut m = message.clone();
                m.outputs
                    .push(proto::model_infer_request::InferRequestedOutputTensor {
                        name: "NOPE".into(),
                        parameters: HashMap::new(),
                    });
                m
            },
            "unknown output `NOPE`",
        ),
    ];
    for (request, want) in cases {
        let (code, text) = failure(c.infer_message(request).await);
        assert_eq!(code, Code::InvalidArgument, "{text}");
        assert!(text.contains(want), "`{text}` lacks `{want}`");
    }
    // A message beyond --grpc-max-message-bytes is refused as Triton refuses it.
    let big = echo_request("echo", "big", &vec![1u32; 2048]);
    let (code, text) = failure(c.infer(&big).await);
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    assert!(text.contains("the limit is: 4096 bytes"), "{text}");

    // The worker failing its batch is INTERNAL.
    let (code, text) = failure(c.infer(&faulty_request(-2)).await);
    assert_eq!(code, Code::Internal, "{text}");
    assert!(text.contains("saw -2"), "{text}");
    c.infer(&faulty_request(4)).await.unwrap();

    // No model repository is configured.
    let (code, text) = failure(c.repository_index(false).await);
    assert_eq!(code, Code::Unavailable, "{text}");
    assert_eq!(code_of(c.load_model("echo", &[]).await), Code::Unavailable);
    assert_eq!(code_of(c.unload_model("nope").await), Code::NotFound);

    // Still serving.
    let r = c.infer(&echo_request("echo", "ok", &[41])).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![42]);
    let text = kiln.client.metrics().await.unwrap();
    assert!(requests_outcome(&text, "echo", "invalid").unwrap() >= 7.0);
}

fn code_of<T: std::fmt::Debug>(result: Result<T, ClientError>) -> Code {
    failure(result).0
}

/// Over every path a message can take (`ModelInfer`, another RPC, a stream), one
/// beyond `--grpc-max-message-bytes` is `RESOURCE_EXHAUSTED`, as Triton answers it
/// (tonic's own answer is `OUT_OF_RANGE`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_over_the_size_limit_are_resource_exhausted() {
    let kiln = Kiln::start(&["--load", "echo", "--grpc-max-message-bytes", "4096"]);
    let c = kiln.grpc().await;
    let small = echo_request("echo", "small", &[1]);
    let big = echo_request("echo", "big", &vec![1u32; 2048]);
    let (code, text) = failure(c.infer(&big).await);
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    let long_name = "r".repeat(5000);
    let (code, text) = failure(
        c.register_system_shared_memory(&long_name, "/kiln-none", 0, 1)
            .await,
    );
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    // A stream answers the requests before the oversize one, then ends with its status.
    let mut stream = c.stream().await.unwrap();
    stream.send(&small).await.unwrap();
    stream.send(&big).await.unwrap();
    let first = stream.recv().await.unwrap().unwrap();
    assert_eq!(first.outputs[0].values::<u32>(), vec![2]);
    let (code, text) = failure(stream.recv().await);
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    // Still serving.
    let r = c.infer(&small).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![2]);
}

/// A plain h2 connection to kiln's gRPC port, for the tests that look at what
/// tonic's client would hide.
async fn h2_connect(kiln: &Kiln) -> h2::client::SendRequest<Bytes> {
    let addr = kiln.grpc_url.trim_start_matches("http://").to_owned();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    h2
}

/// The headers of a `ModelInfer` call, with `extra` (name, value) added.
fn model_infer_request(kiln: &Kiln, extra: &[(&str, &str)]) -> tonic::codegen::http::Request<()> {
    let mut request = tonic::codegen::http::Request::post(format!(
        "{}/inference.GRPCInferenceService/ModelInfer",
        kiln.grpc_url
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers");
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    request.body(()).unwrap()
}

/// A call still running when the client's `grpc-timeout` passes is answered
/// `DEADLINE_EXCEEDED` then, not when the worker is done. (Sent over plain h2:
/// tonic's client would give up at the deadline itself.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_deadline_is_deadline_exceeded() {
    let kiln = Kiln::start(&["--load", "faulty"]);
    let mut h2 = h2_connect(&kiln).await;
    // -3 makes the worker take 1 s.
    let message = kiln_server::grpc::convert::encode_request(&faulty_request(-3));
    let body = framed(&prost::Message::encode_to_vec(&message));
    let request = model_infer_request(&kiln, &[("grpc-timeout", "200m")]);
    let started = std::time::Instant::now();
    let (response, mut send) = h2.send_request(request, false).unwrap();
    send.send_data(Bytes::from(body), true).unwrap();
    let response = response.await.unwrap();
    let elapsed = started.elapsed();
    assert_eq!(response.status(), 200);
    // Refused before any answer: the status comes with the headers.
    assert_eq!(
        response.headers()["grpc-status"],
        (Code::DeadlineExceeded as i32).to_string().as_str()
    );
    assert!(elapsed < Duration::from_millis(900), "{elapsed:?}");
    // Without a deadline the same model answers.
    let c = kiln.grpc().await;
    let r = c.infer(&faulty_request(4)).await.unwrap();
    assert_eq!(r.outputs[0].values::<i32>(), vec![4]);
}

/// Sends one `ModelInfer` over plain h2: the headers (with `extra`), then each piece
/// of the body as its own DATA frame `pause` after the last (the last piece ends
/// the stream). Returns the answer's `grpc-status` and, when it is 0, the answer.
async fn model_infer_in_pieces(
    kiln: &Kiln,
    extra: &[(&str, &str)],
    pieces: Vec<Vec<u8>>,
    pause: Duration,
) -> (String, Option<proto::ModelInferResponse>) {
    let mut h2 = h2_connect(kiln).await;
    let request = model_infer_request(kiln, extra);
    let (response, mut send) = h2.send_request(request, false).unwrap();
    let last = pieces.len() - 1;
    for (i, piece) in pieces.into_iter().enumerate() {
        tokio::time::sleep(pause).await;
        // The server may answer from the headers alone (an encoding it does not
        // read, a size over the limit) and reset the stream: the answer counts.
        if send.send_data(Bytes::from(piece), i == last).is_err() {
            break;
        }
    }
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    if let Some(status) = response.headers().get("grpc-status") {
        return (status.to_str().unwrap().to_owned(), None);
    }
    let mut body = response.into_body();
    let mut answer = Vec::new();
    while let Some(data) = body.data().await {
        let data = data.unwrap();
        body.flow_control().release_capacity(data.len()).unwrap();
        answer.extend_from_slice(&data);
    }
    let trailers = body.trailers().await.unwrap().unwrap();
    let status = trailers["grpc-status"].to_str().unwrap().to_owned();
    let message = (status == "0").then(|| prost::Message::decode(&answer[5..]).unwrap());
    (status, message)
}

/// A length-prefixed gRPC message.
fn framed(message: &[u8]) -> Vec<u8> {
    framed_with_flag(0, message)
}

/// A length-prefixed gRPC message with its compression flag (1: compressed).
fn framed_with_flag(flag: u8, message: &[u8]) -> Vec<u8> {
    let mut body = vec![flag];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message);
    body
}

/// Compressed requests (`grpc-encoding` gzip or deflate, as tritonclient's
/// `compression_algorithm` sends them) are answered like plain ones; one that
/// inflates beyond `--grpc-max-message-bytes` is `RESOURCE_EXHAUSTED`, found while
/// inflating; an encoding kiln does not read is `UNIMPLEMENTED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_requests_are_read_and_bounded() {
    let kiln = Kiln::start(&["--load", "echo", "--grpc-max-message-bytes", "65536"]);
    let values = [7u32, 8, 9];
    let request = kiln_server::grpc::convert::encode_request(&echo_request("echo", "z", &values));
    let message = prost::Message::encode_to_vec(&request);
    for encoding in ["gzip", "deflate"] {
        let body = framed_with_flag(1, &compress(encoding, &message));
        let headers = [("grpc-encoding", encoding)];
        let (status, answer) =
            model_infer_in_pieces(&kiln, &headers, vec![body], Duration::ZERO).await;
        assert_eq!(status, "0", "{encoding}");
        let answer = answer.unwrap();
        assert_eq!(answer.id, "z");
        assert_eq!(answer.raw_output_contents[0].len(), 12);
        assert_eq!(&answer.raw_output_contents[0][..4], &8u32.to_le_bytes());
        // 16 MiB of zeros is 16 KiB compressed: refused once 64 KiB are out.
        let mut bomb = request.clone();
        bomb.raw_input_contents = vec![Bytes::from(vec![0; 16 << 20])];
        let bomb = compress(encoding, &prost::Message::encode_to_vec(&bomb));
        assert!(bomb.len() < 65536, "{}", bomb.len());
        let body = framed_with_flag(1, &bomb);
        let (status, _) = model_infer_in_pieces(&kiln, &headers, vec![body], Duration::ZERO).await;
        assert_eq!(
            status,
            (Code::ResourceExhausted as i32).to_string(),
            "{encoding}"
        );
    }
    let body = framed_with_flag(1, &message);
    let headers = [("grpc-encoding", "br")];
    let (status, _) = model_infer_in_pieces(&kiln, &headers, vec![body], Duration::ZERO).await;
    assert_eq!(status, (Code::Unimplemented as i32).to_string());
    // Still serving, plain.
    let body = framed(&message);
    let (status, _) = model_infer_in_pieces(&kiln, &[], vec![body], Duration::ZERO).await;
    assert_eq!(status, "0");
}

/// `ModelInfer` is usually queued as soon as its headers and message are read
/// together; a message that comes later, or in pieces, is answered the same, and
/// a body that is not exactly one message is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_infer_bodies_in_pieces_late_or_malformed() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let values: Vec<u32> = (0..4096).collect();
    let request = kiln_server::grpc::convert::encode_request(&echo_request("echo", "p", &values));
    let body = framed(&prost::Message::encode_to_vec(&request));
    let expect = |(status, answer): (String, Option<proto::ModelInferResponse>)| {
        assert_eq!(status, "0");
        let answer = answer.unwrap();
        assert_eq!(answer.id, "p");
        let got: Vec<u32> = answer.raw_output_contents[0]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        // echo adds one to every element.
        assert!(
            got.iter().copied().eq(values.iter().map(|v| v + 1)),
            "wrong answer"
        );
    };
    let pause = Duration::from_millis(30);
    // Whole, after the headers; then in three pieces, the first inside the prefix.
    expect(model_infer_in_pieces(&kiln, &[], vec![body.clone()], pause).await);
    let pieces = vec![
        body[..3].to_vec(),
        body[3..100].to_vec(),
        body[100..].to_vec(),
    ];
    expect(model_infer_in_pieces(&kiln, &[], pieces, pause).await);
    // Two messages in one unary call (at once, then one after the other); a
    // message cut short; no message at all.
    let internal = (Code::Internal as i32).to_string();
    for (pieces, pause) in [
        (vec![[body.clone(), body.clone()].concat()], Duration::ZERO),
        (vec![body.clone(), body.clone()], pause),
        (vec![body[..body.len() - 1].to_vec()], Duration::ZERO),
        (vec![Vec::new()], Duration::ZERO),
    ] {
        let (status, _) = model_infer_in_pieces(&kiln, &[], pieces, pause).await;
        assert_eq!(status, internal);
    }
    // The server still answers.
    expect(model_infer_in_pieces(&kiln, &[], vec![body], Duration::ZERO).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_resource_exhausted() {
    let kiln = Kiln::start(&["--load", "faulty:batch_size=1,max_buffers=1,queue_size=3"]);
    let c = kiln.grpc().await;
    // As over REST: -3 makes the worker take 1 s (each request here does) and
    // holds the only buffer set.
    let send = |v: i32| {
        let c = c.clone();
        let mut request = faulty_request(v);
        request.inputs[0] = InputTensor::from_slice("INPUT0", DataType::Int32, &[1, 2], &[v, -3]);
        tokio::spawn(async move { c.infer(&request).await })
    };
    let running = send(0);
    kiln_tests::wait_pending(&kiln.client, "faulty", 1.0).await;
    kiln_tests::wait_metric(&kiln.client, "kiln_batch_size_count", "faulty", 1.0).await;
    // Then one at a time, each accepted before the next, until one is refused:
    // exactly the queue's three (the one the batcher holds counts).
    let (accepted, refused) = kiln_tests::fill_until_refused(&kiln.client, "faulty", 3, send).await;
    assert_eq!(
        accepted.len(),
        3,
        "a queue of 3 accepted {}",
        accepted.len()
    );
    let (code, text) = failure(refused);
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    assert!(text.contains("queue of 3 is full"), "{text}");
    running.await.unwrap().unwrap();
    for (value, task) in accepted {
        assert_eq!(
            task.await.unwrap().unwrap().outputs[0].values::<i32>(),
            vec![value, -3]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repository_index_load_with_overrides_and_unload() {
    let repo = TempRepository::new(&[
        (
            "echo-a",
            "worker = \"echo\"\n[parameters]\nbatch_size = 8\n",
            &[1, 2],
        ),
        ("echo-b", "worker = \"echo\"\n", &[1]),
    ]);
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "echo-b"]);
    let c = kiln.grpc().await;
    let index = c.repository_index(false).await.unwrap();
    let states: Vec<(&str, &str, &str)> = index
        .iter()
        .map(|m| (m.name.as_str(), m.version.as_str(), m.state.as_str()))
        .collect();
    assert_eq!(
        states,
        vec![("echo-a", "2", "UNAVAILABLE"), ("echo-b", "1", "READY")]
    );
    assert_eq!(index[0].reason, "unloaded");
    let ready = c.repository_index(true).await.unwrap();
    assert_eq!(ready.len(), 1);
    assert_eq!(ready[0].name, "echo-b");

    // Overrides replace configured parameters; `version` picks the version.
    let overrides = [
        Param {
            key: "batch_size".into(),
            value: ParamValue::Int(4),
        },
        Param {
            key: "version".into(),
            value: ParamValue::Str("1".into()),
        },
    ];
    c.load_model("echo-a", &overrides).await.unwrap();
    assert!(c.is_model_ready("echo-a").await.unwrap());
    let meta = c.model_metadata("echo-a").await.unwrap();
    assert_eq!(meta.versions, vec!["1"]);
    let config = c.model_config("echo-a").await.unwrap();
    assert_eq!(config.parameters["batch_size"].string_value, "4");
    let r = c.infer(&echo_request("echo-a", "a", &[1])).await.unwrap();
    assert_eq!(
        (r.model_name.as_str(), r.model_version.as_str()),
        ("echo-a", "1")
    );
    let index = c.repository_index(true).await.unwrap();
    assert_eq!(index.len(), 2);
    assert_eq!(index[0].version, "1");

    // Unload: not ready, gone from the ready index.
    c.unload_model("echo-a").await.unwrap();
    assert!(!c.is_model_ready("echo-a").await.unwrap());
    assert_eq!(
        code_of(c.infer(&echo_request("echo-a", "gone", &[1])).await),
        Code::NotFound
    );
    assert_eq!(c.repository_index(true).await.unwrap().len(), 1);

    // Refusals.
    assert_eq!(code_of(c.load_model("nope", &[]).await), Code::NotFound);
    let version_9 = [Param {
        key: "version".into(),
        value: ParamValue::Int(9),
    }];
    assert_eq!(
        code_of(c.load_model("echo-a", &version_9).await),
        Code::NotFound
    );
    let bad_version = [Param {
        key: "version".into(),
        value: ParamValue::Str("latest".into()),
    }];
    assert_eq!(
        code_of(c.load_model("echo-a", &bad_version).await),
        Code::InvalidArgument
    );
    let bad_batch = [Param {
        key: "batch_size".into(),
        value: ParamValue::Int(0),
    }];
    assert_eq!(
        code_of(c.load_model("echo-a", &bad_batch).await),
        Code::InvalidArgument
    );
    let files = proto::RepositoryModelLoadRequest {
        repository_name: String::new(),
        model_name: "echo-a".into(),
        parameters: HashMap::from([(
            "file:1/model.onnx".to_owned(),
            proto::ModelRepositoryParameter {
                parameter_choice: Some(model_repository_parameter::ParameterChoice::BytesParam(
                    Bytes::from_static(b"x"),
                )),
            },
        )]),
    };
    let status = c.raw().repository_model_load(files).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
}

fn shm_params(region: &str, byte_size: i64, offset: i64) -> HashMap<String, proto::InferParameter> {
    let param = |choice| proto::InferParameter {
        parameter_choice: Some(choice),
    };
    let mut params = HashMap::from([
        (
            "shared_memory_region".to_owned(),
            param(ParameterChoice::StringParam(region.into())),
        ),
        (
            "shared_memory_byte_size".to_owned(),
            param(ParameterChoice::Int64Param(byte_size)),
        ),
    ]);
    if offset != 0 {
        params.insert(
            "shared_memory_offset".to_owned(),
            param(ParameterChoice::Int64Param(offset)),
        );
    }
    params
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_shared_memory_inputs_and_outputs() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let c = kiln.grpc().await;
    let object = ShmObject::new(64);
    object.write_u32(16, &[7, 8, 9]);
    c.register_system_shared_memory("io", &object.key, 0, 64)
        .await
        .unwrap();
    let regions = c.system_shared_memory_status(None).await.unwrap();
    assert_eq!(regions.len(), 1);
    assert_eq!(
        (regions[0].name.as_str(), regions[0].key.as_str()),
        ("io", object.key.as_str())
    );
    assert_eq!((regions[0].offset, regions[0].byte_size), (0, 64));
    assert_eq!(
        c.system_shared_memory_status(Some("io"))
            .await
            .unwrap()
            .len(),
        1
    );

    // Input read from offset 16 of the region, output written at offset 32.
    let mut message =
        kiln_server::grpc::convert::encode_request(&echo_request("echo", "shm", &[0, 0, 0]));
    message.raw_input_contents.clear();
    message.inputs[0].parameters = shm_params("io", 12, 16);
    message.outputs = vec![proto::model_infer_request::InferRequestedOutputTensor {
        name: "OUTPUT0".into(),
        parameters: shm_params("io", 12, 32),
    }];
    let r = c.infer_message(message.clone()).await.unwrap();
    assert_eq!(r.id, "shm");
    assert_eq!(r.outputs[0].shape, vec![1, 3]);
    assert_eq!(
        r.raw_output_contents,
        vec![Bytes::new()],
        "the data is in the region"
    );
    let placed = &r.outputs[0].parameters;
    assert_eq!(
        placed["shared_memory_region"].parameter_choice,
        Some(ParameterChoice::StringParam("io".into()))
    );
    assert_eq!(
        placed["shared_memory_byte_size"].parameter_choice,
        Some(ParameterChoice::Int64Param(12))
    );
    assert_eq!(object.read_u32(32, 3), vec![8, 9, 10]);
    // Over a stream too, and with the input raw: only the output in the region.
    let mut stream = c.stream().await.unwrap();
    let mut raw_in = message.clone();
    raw_in.inputs[0].parameters.clear();
    raw_in.raw_input_contents = vec![Bytes::from_static(&[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0])];
    stream.send_message(raw_in).await.unwrap();
    let answer = stream.recv_message().await.unwrap().unwrap();
    assert_eq!(answer.error_message, "");
    assert_eq!(object.read_u32(32, 3), vec![2, 3, 4]);

    // Refusals: an unknown region, a window past the region, an output too small.
    let mut unknown = message.clone();
    unknown.inputs[0].parameters = shm_params("nope", 12, 0);
    let (code, text) = failure(c.infer_message(unknown).await);
    assert_eq!(code, Code::InvalidArgument, "{text}");
    let mut past = message.clone();
    past.inputs[0].parameters = shm_params("io", 12, 60);
    assert_eq!(code_of(c.infer_message(past).await), Code::InvalidArgument);
    let mut small = message.clone();
    small.outputs[0].parameters = shm_params("io", 8, 32);
    let (code, text) = failure(c.infer_message(small).await);
    assert_eq!(code, Code::InvalidArgument, "{text}");
    assert!(text.contains("needs 12 bytes"), "{text}");
    let mut both = message.clone();
    both.raw_input_contents = vec![Bytes::from_static(&[0; 12])];
    both.inputs[0].contents = Some(InferTensorContents {
        uint_contents: vec![1, 2, 3],
        ..Default::default()
    });
    assert_eq!(code_of(c.infer_message(both).await), Code::InvalidArgument);

    // Registration errors, then unregister (an unknown name is not an error).
    let (code, text) = failure(
        c.register_system_shared_memory("io", &object.key, 0, 64)
            .await,
    );
    assert_eq!(code, Code::AlreadyExists, "{text}");
    assert_eq!(
        code_of(
            c.register_system_shared_memory("big", &object.key, 0, 65)
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code_of(
            c.register_system_shared_memory("bad", "/../etc/passwd", 0, 4)
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code_of(c.system_shared_memory_status(Some("nope")).await),
        Code::NotFound
    );
    c.unregister_system_shared_memory(Some("nope"))
        .await
        .unwrap();
    c.register_system_shared_memory("second", &object.key, 32, 32)
        .await
        .unwrap();
    c.unregister_system_shared_memory(Some("io")).await.unwrap();
    let names: Vec<String> = c
        .system_shared_memory_status(None)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, vec!["second"]);
    assert_eq!(
        code_of(c.infer_message(message).await),
        Code::InvalidArgument
    );
    c.unregister_system_shared_memory(None).await.unwrap();
    assert!(c
        .system_shared_memory_status(None)
        .await
        .unwrap()
        .is_empty());
}
