//! Triton's auto-completion, `sequence_batching` and the python backend, served
//! from Triton-written model folders by the real server and workers:
//!
//! - a PP-OCR classifier folder with no `config.pbtxt` at all, and one whose file
//!   names only the platform: both load, `/config` shows what Triton completes
//!   (the model's tensors, `max_batch_size` 4, `dynamic_batching`), and the
//!   answers equal onnxruntime's in Python (`tests/golden`); Silero, which cannot
//!   batch, completes to `max_batch_size` 0;
//! - Silero VAD with `sequence_batching { state [...] }`: kiln keeps each stream's
//!   LSTM state, and the probabilities over a sequence of chunks equal running each
//!   stream alone through onnxruntime (`tests/golden/silero_reference.py`);
//! - Triton's `echo_python` (`backend: "python"`, its config.pbtxt and model.py as
//!   they are in shared/tools/triton) served by the python worker.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use kiln_client::{DataType, InferRequest, InputTensor, Param, ParamValue};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::golden::{bytemuck_f32, golden, max_abs_diff, silero_streams, SileroStreams};
use kiln_tests::{model_repository, repo_root, triton_config, Kiln};
use serde_json::json;

/// `files` (path in the repository, contents) and model files linked in.
fn repository(files: &[(&str, &str)], models: &[(&str, &str)]) -> TempRepository {
    let repo = TempRepository::new(&[]);
    for (path, text) in files {
        let path = repo.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    for (path, model) in models {
        let path = repo.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let source = model_repository().join(model);
        assert!(
            source.is_file(),
            "{}: run scripts/fetch-models",
            source.display()
        );
        std::os::unix::fs::symlink(source, path).unwrap();
    }
    repo
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onnx_models_are_completed_from_the_model_as_triton_does() {
    let repo = repository(
        &[("partial/config.pbtxt", "platform: \"onnxruntime_onnx\"\n")],
        &[
            ("bare/1/model.onnx", "ocr-cls/1/model.onnx"),
            ("partial/1/model.onnx", "ocr-cls/1/model.onnx"),
            ("vad/1/model.onnx", "silero-vad/1/model.onnx"),
        ],
    );
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    // A folder with nothing but its model is a model of the repository.
    let index = c.repository_index().await.unwrap();
    for model in ["bare", "partial", "vad"] {
        assert!(index.iter().any(|m| m["name"] == model), "{index:?}");
        c.load_model(model, &json!({})).await.unwrap();
    }
    for model in ["bare", "partial"] {
        let config = triton_config(&kiln.url, model).await;
        assert_eq!(config["max_batch_size"], json!(4), "{model}: {config}");
        let input = &config["input"];
        assert_eq!(input.as_array().unwrap().len(), 1, "{model}: {config}");
        assert_eq!(input[0]["name"], json!("x"), "{model}: {config}");
        assert_eq!(
            input[0]["data_type"],
            json!("TYPE_FP32"),
            "{model}: {config}"
        );
        assert_eq!(input[0]["dims"], json!([3, -1, -1]), "{model}: {config}");
        assert_eq!(config["output"][0]["dims"], json!([2]), "{model}: {config}");
        assert_eq!(
            config["output"][0]["data_type"],
            json!("TYPE_FP32"),
            "{model}: {config}"
        );
        // Triton adds `dynamic_batching {}` to a model it completes to batch.
        assert!(config["dynamic_batching"].is_object(), "{model}: {config}");
        for case in golden().cases_for("ocr-cls") {
            let request = InferRequest {
                model: model.into(),
                inputs: case.inputs.iter().map(|t| t.input()).collect(),
                ..Default::default()
            };
            let response = c.infer(&request).await.unwrap();
            let diff = max_abs_diff(
                &bytemuck_f32(&response.outputs[0].data),
                &case.outputs[0].floats(),
            );
            assert!(diff <= 1e-4, "{model} {}: max |diff| {diff}", case.tag);
        }
    }
    // Silero's state has a fixed first dim: no batch dimension, as Triton decides.
    let vad = triton_config(&kiln.url, "vad").await;
    assert_eq!(vad["max_batch_size"], json!(0), "{vad}");
    assert_eq!(vad["input"].as_array().unwrap().len(), 3, "{vad}");

    // Triton's --disable-auto-complete-config: the file alone.
    let strict = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--disable-auto-complete-config",
    ]);
    let index = strict.client.repository_index().await.unwrap();
    assert!(!index.iter().any(|m| m["name"] == "bare"), "{index:?}");
    let err = strict
        .client
        .load_model("bare", &json!({}))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    let err = strict
        .client
        .load_model("partial", &json!({}))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("declares no input `x`"), "{err}");
}

/// Silero VAD as a Triton user writes it: no batch dimension (the model's state
/// carries its batch on axis 1), the inputs left to auto-completion, the LSTM state
/// an implicit state of the sequence batcher.
const SILERO: &str = r#"
name: "vad"
backend: "onnxruntime"
max_batch_size: 0
output [ { name: "output" data_type: TYPE_FP32 dims: [ -1, 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 10000000
  direct { }
  state [
    {
      input_name: "state"
      output_name: "stateN"
      data_type: TYPE_FP32
      dims: [ 2, 1, 128 ]
      initial_state: { data_type: TYPE_FP32 dims: [ 2, 1, 128 ] zero_data: true name: "zeros" }
    }
  ]
}
instance_group [ { count: 1, kind: KIND_CPU } ]
"#;

/// Chunk `c` of stream `s`, with the sample rate Triton's clients send.
fn vad_chunk(streams: &SileroStreams, s: usize, c: usize) -> InferRequest {
    let flag = |key: &str, value: bool| Param {
        key: key.into(),
        value: ParamValue::Bool(value),
    };
    InferRequest {
        model: "vad".into(),
        inputs: vec![
            InputTensor::from_slice(
                "input",
                DataType::Fp32,
                &[1, streams.samples as i64],
                streams.input(s, c),
            ),
            InputTensor::from_slice("sr", DataType::Int64, &[], &[16000i64]),
        ],
        parameters: vec![
            Param {
                key: "sequence_id".into(),
                value: ParamValue::Int(s as i64 + 1),
            },
            flag("sequence_start", c == 0),
            flag("sequence_end", c + 1 == streams.chunks),
        ],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silero_with_triton_state_answers_as_onnxruntime() {
    const STREAMS: usize = 4;
    let reference = Arc::new(silero_streams(STREAMS, 20));
    // Losing the state would move the probabilities far beyond the tolerance.
    assert!(reference.reset_max_abs_diff > 0.1);
    // The same with a state type that is not the model's: refused at load.
    let lying = SILERO.replace("\"vad\"", "\"lying\"").replace(
        "data_type: TYPE_FP32\n      dims",
        "data_type: TYPE_FP16\n      dims",
    );
    let repo = repository(
        &[("vad/config.pbtxt", SILERO), ("lying/config.pbtxt", &lying)],
        &[
            ("vad/1/model.onnx", "silero-vad/1/model.onnx"),
            ("lying/1/model.onnx", "silero-vad/1/model.onnx"),
        ],
    );
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let err = kiln
        .client
        .load_model("lying", &json!({}))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(
        err.to_string()
            .contains("sequence_batching input `state`: the config declares Fp16"),
        "{err}"
    );
    kiln.client.load_model("vad", &json!({})).await.unwrap();
    let config = triton_config(&kiln.url, "vad").await;
    let state = &config["sequence_batching"]["state"][0];
    assert_eq!(state["input_name"], json!("state"), "{config}");
    assert_eq!(state["output_name"], json!("stateN"), "{config}");
    assert_eq!(state["dims"], json!([2, 1, 128]), "{config}");
    // Clients send the audio and the rate; the state is kiln's.
    let names: Vec<&str> = config["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["input", "sr"], "{config}");
    let mut tasks = Vec::new();
    for s in 0..STREAMS {
        let reference = Arc::clone(&reference);
        let client = kiln.client.clone();
        tasks.push(tokio::spawn(async move {
            let mut worst = 0.0f32;
            for c in 0..reference.chunks {
                let response = client.infer(&vad_chunk(&reference, s, c)).await.unwrap();
                let got = bytemuck_f32(&response.outputs[0].data)[0];
                worst = worst.max((got - reference.probability(s, c)).abs());
            }
            worst
        }));
    }
    for (s, task) in tasks.into_iter().enumerate() {
        let worst = task.await.unwrap();
        assert!(worst <= 1e-4, "stream {s}: max |diff| {worst}");
    }
}

/// Copies Triton's `echo_python` folder (config.pbtxt, 1/model.py) into `repo`.
/// The fixture is shared/tools/triton's, byte for byte (checked where shared/ is
/// beside the repository, as in CI).
fn copy_echo_python(repo: &Path) {
    let fixture = repo_root().join("tests/fixtures/python-models/echo_python");
    let shared = repo_root().join("../shared/tools/triton/models/echo_python");
    for file in ["config.pbtxt", "1/model.py"] {
        let text = std::fs::read(fixture.join(file)).unwrap();
        if shared.is_dir() {
            assert_eq!(text, std::fs::read(shared.join(file)).unwrap(), "{file}");
        }
        let to = repo.join("echo_python").join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, text).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tritons_echo_python_is_served_by_the_python_worker() {
    let repo = TempRepository::new(&[]);
    copy_echo_python(repo.path());
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    c.load_model("echo_python", &json!({})).await.unwrap();
    let values = [0u32, 41, u32::MAX - 1];
    let request = InferRequest {
        model: "echo_python".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, 3],
            &values,
        )],
        ..Default::default()
    };
    let response = c.infer(&request).await.unwrap();
    let got: Vec<u32> = response.outputs[0]
        .data
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, [1, 42, u32::MAX]);
    assert_eq!(response.outputs[0].name, "OUTPUT0");
    let config = triton_config(&kiln.url, "echo_python").await;
    assert_eq!(config["max_batch_size"], json!(64), "{config}");
    assert_eq!(config["input"][0]["dims"], json!([-1]), "{config}");
    assert_eq!(
        config["output"][0]["data_type"],
        json!("TYPE_UINT32"),
        "{config}"
    );
}
