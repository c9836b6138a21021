//! End-to-end over gRPC: the real `kiln` binary serving Triton's
//! `inference.GRPCInferenceService`, driven by kiln's tonic client: health,
//! metadata, config, statistics, inference, streaming, error codes, the repository
//! and shared memory. Limits and the HTTP/2 level are in grpc_transport.rs.

// Helpers outside the test functions unwrap too: a failed step fails the test.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use bytes::Bytes;
use kiln_client::{ClientError, Param, ParamValue};
use kiln_server::grpc::proto::{
    self, infer_parameter::ParameterChoice, model_config::SchedulingChoice,
    model_infer_request::InferInputTensor, model_repository_parameter, InferTensorContents,
    ModelInferRequest,
};
use kiln_tests::fixtures::{check_echo_multi, echo_multi_request, TempRepository};
use kiln_tests::grpc::{code_of, echo_request, failure, faulty_request};
use kiln_tests::{metric, requests_outcome, Kiln};
use serde_json::Value;
use tonic::Code;

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
