//! Real models on CPU: PP-OCR (detection, direction classifier, recognizer) and Silero
//! VAD served by the onnx worker, compared with the onnxruntime Python package run on
//! the same inputs (`tests/golden/reference.py`).

// `start` and `check` are test support: a failure should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use kiln_client::{DataType, InferRequest, InputTensor, Param, ParamValue};
use kiln_tests::golden::{bytemuck_f32, golden, max_abs_diff, silero_streams, Case, SileroStreams};
use kiln_tests::{metric, model_repository, Kiln};
use serde_json::json;

const TOLERANCE: f32 = 1e-4;

fn start() -> Kiln {
    let repo = model_repository();
    Kiln::start(&[
        "--model-repository",
        repo.to_str().unwrap(),
        "--load-model",
        "*",
    ])
}

fn request(case: &Case) -> InferRequest {
    InferRequest {
        model: case.model.clone(),
        inputs: case.inputs.iter().map(|t| t.input()).collect(),
        ..Default::default()
    }
}

/// Serves `case` and checks every output against the reference.
async fn check(kiln: &Kiln, case: &Case) {
    let response = kiln.client.infer(&request(case)).await.unwrap();
    assert_eq!(response.outputs.len(), case.outputs.len(), "{}", case.tag);
    for (got, want) in response.outputs.iter().zip(&case.outputs) {
        assert_eq!(got.name, want.name, "{}", case.tag);
        assert_eq!(got.shape, want.shape, "{} {}", case.tag, got.name);
        let diff = max_abs_diff(&bytemuck_f32(&got.data), &want.floats());
        assert!(
            diff <= TOLERANCE,
            "{} {}: max |diff| {diff}",
            case.tag,
            got.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ocr_models_match_the_reference_runtime() {
    let golden = golden();
    let kiln = start();
    for model in ["ocr-det", "ocr-cls", "ocr-rec"] {
        for case in golden.cases_for(model) {
            check(&kiln, case).await;
        }
    }
    // The detector really sees the text: high probability on the text lines, none
    // on the blank lower half of the page.
    let det = golden.cases_for("ocr-det").next().unwrap();
    let map = det.outputs[0].floats();
    let row = |y: usize| &map[y * 640..(y + 1) * 640];
    let text_peak = (60..400)
        .flat_map(|y| row(y).iter().copied())
        .fold(0.0f32, f32::max);
    let blank_peak = (450..640)
        .flat_map(|y| row(y).iter().copied())
        .fold(0.0f32, f32::max);
    assert!(text_peak > 0.5, "text peak {text_peak}");
    assert!(blank_peak < 0.1, "blank peak {blank_peak}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_and_unbatched_serving_give_the_same_outputs() {
    let golden = golden();
    let kiln = start();
    let cases: Vec<&Case> = golden.cases_for("ocr-cls").collect();
    // One at a time: every batch holds one request.
    for case in &cases {
        check(&kiln, case).await;
    }
    // Reload with a long soft timeout so concurrent requests share batches.
    kiln.client
        .load_model("ocr-cls", &json!({"timeout": 300}))
        .await
        .unwrap();
    let before = kiln.client.metrics().await.unwrap();
    let count =
        |text: &str| metric(text, "kiln_batch_size_count", &[("model", "ocr-cls")]).unwrap_or(0.0);
    let batches_before = count(&before);
    let tasks: Vec<_> = cases
        .iter()
        .map(|case| {
            let (client, request, want) =
                (kiln.client.clone(), request(case), case.outputs[0].floats());
            let tag = case.tag.clone();
            tokio::spawn(async move {
                let response = client.infer(&request).await.unwrap();
                let diff = max_abs_diff(&bytemuck_f32(&response.outputs[0].data), &want);
                assert!(diff <= TOLERANCE, "{tag} batched: max |diff| {diff}");
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let batches = count(&kiln.client.metrics().await.unwrap()) - batches_before;
    assert!(
        batches < cases.len() as f64,
        "{} requests ran in {batches} batches: none shared",
        cases.len()
    );
}

/// One chunk of a Silero stream as a request of sequence `stream`.
fn vad_chunk(streams: &SileroStreams, s: usize, c: usize) -> InferRequest {
    InferRequest {
        model: "silero-vad".into(),
        inputs: vec![InputTensor::from_slice(
            "input",
            DataType::Fp32,
            &[1, streams.samples as i64],
            streams.input(s, c),
        )],
        parameters: vec![
            Param {
                key: "sequence_id".into(),
                value: ParamValue::Int(s as i64 + 1),
            },
            Param {
                key: "sequence_start".into(),
                value: ParamValue::Bool(c == 0),
            },
            Param {
                key: "sequence_end".into(),
                value: ParamValue::Bool(c + 1 == streams.chunks),
            },
        ],
        ..Default::default()
    }
}

/// Silero VAD served statefully: 64 audio streams at once, chunk by chunk (half over
/// HTTP, half over gRPC streams), batched across streams by the sequence batcher
/// with the state kept by kiln. Each stream's probabilities equal running it alone
/// and in order through onnxruntime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silero_vad_64_streams_batched_with_implicit_state() {
    const STREAMS: usize = 64;
    let reference = Arc::new(silero_streams(STREAMS, 30));
    // The state matters on this audio: losing it would move probabilities far more
    // than the tolerance.
    assert!(
        reference.reset_max_abs_diff > 0.1,
        "{}",
        reference.reset_max_abs_diff
    );
    let kiln = start();
    // A batch waits up to 50 ms (not the example's 2 ms) for every live stream's
    // next chunk, so how many streams share a batch does not depend on how busy
    // this machine is; a batch still goes the moment all 64 are ready.
    kiln.client
        .load_model(
            "silero-vad",
            &json!({"max_queue_delay_microseconds": 50_000}),
        )
        .await
        .unwrap();
    let meta = kiln.client.model_metadata("silero-vad").await.unwrap();
    assert_eq!(
        meta["inputs"],
        json!([{"name": "input", "datatype": "FP32", "shape": [-1, -1]}])
    );
    let mut tasks = Vec::new();
    for s in 0..STREAMS {
        let reference = Arc::clone(&reference);
        let mut caller = kiln.caller(s % 2 == 1).await;
        tasks.push(tokio::spawn(async move {
            let mut worst = 0.0f32;
            for c in 0..reference.chunks {
                let request = vad_chunk(&reference, s, c);
                let response = caller.infer(&request).await.unwrap();
                let got = bytemuck_f32(&response.outputs[0].data)[0];
                worst = worst.max((got - reference.probability(s, c)).abs());
            }
            worst
        }));
    }
    for (s, task) in tasks.into_iter().enumerate() {
        let worst = task.await.unwrap();
        assert!(worst <= 1e-5, "stream {s}: max |diff| {worst}");
    }
    let text = kiln.client.metrics().await.unwrap();
    let batches = metric(&text, "kiln_batch_size_count", &[("model", "silero-vad")]).unwrap();
    let requests = metric(&text, "kiln_batch_size_sum", &[("model", "silero-vad")]).unwrap();
    assert_eq!(requests, (STREAMS * reference.chunks) as f64);
    assert!(
        requests / batches >= 8.0,
        "{requests} chunks ran in {batches} batches"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_inputs_are_refused_with_the_expected_shape() {
    let kiln = start();
    let c = &kiln.client;
    let floats = |n: usize| vec![0.5f32; n];
    let cases = [
        (
            InputTensor::from_slice("x", DataType::Fp32, &[1, 3, 48], &floats(3 * 48)),
            "input `x`: expected shape [-1, 3, -1, -1]",
        ),
        (
            InputTensor::from_slice("x", DataType::Fp32, &[1, 1, 48, 192], &floats(48 * 192)),
            "expected shape [-1, 3, -1, -1]",
        ),
        (
            InputTensor::from_slice("x", DataType::Fp64, &[1, 3, 2, 2], &[0.5f64; 12]),
            "input `x`: expected datatype FP32, got FP64",
        ),
        (
            InputTensor::from_slice("image", DataType::Fp32, &[1, 3, 2, 2], &floats(12)),
            "unknown input `image`",
        ),
        (
            InputTensor::from_slice("x", DataType::Fp32, &[65, 3, 1, 1], &floats(65 * 3)),
            "outside 1..=32",
        ),
    ];
    for (input, want) in cases {
        let err = c
            .infer(&InferRequest {
                model: "ocr-cls".into(),
                inputs: vec![input],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.status(), Some(400), "{err}");
        assert!(err.to_string().contains(want), "`{err}` lacks `{want}`");
    }
    // The server still serves the model.
    let golden = golden();
    check(&kiln, golden.cases_for("ocr-cls").next().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repository_index_load_unload_and_config_errors() {
    let repo = model_repository();
    let kiln = Kiln::start(&["--model-repository", repo.to_str().unwrap()]);
    let c = &kiln.client;
    let index = c.repository_index().await.unwrap();
    let names: Vec<&str> = index.iter().filter_map(|m| m["name"].as_str()).collect();
    assert_eq!(
        names,
        vec![
            "echo",
            "echo-chain",
            "echo-diamond",
            "echo-multi",
            "invert-video",
            "ocr",
            "ocr-cls",
            "ocr-det",
            "ocr-rec",
            "ocr-rgb",
            "silero-vad"
        ]
    );
    assert!(index.iter().all(|m| m["state"] == "UNAVAILABLE"));
    c.load_model("silero-vad", &json!({})).await.unwrap();
    let meta = c.model_metadata("silero-vad").await.unwrap();
    // `sr` is set in the config and the state is kept by kiln: only the audio is an input.
    assert_eq!(meta["inputs"].as_array().unwrap().len(), 1, "{meta}");
    assert_eq!(meta["parameters"]["max_batch_size"], 64);
    let err = c.load_model("nope", &json!({})).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    // Files and libraries are the operator's to name, not a load request's.
    for overrides in [
        json!({"model": "../ocr-det/1/model.onnx"}),
        json!({"runtime": "/nonexistent/libonnxruntime.so"}),
    ] {
        let err = c.load_model("ocr-cls", &overrides).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{err}");
        assert!(
            err.to_string().contains("may only be set by the operator"),
            "{err}"
        );
    }
    c.unload_model("silero-vad").await.unwrap();
    assert_eq!(
        c.model_metadata("silero-vad").await.unwrap_err().status(),
        Some(404)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_foreign_runtime_is_a_clear_load_error() {
    let zlib = [
        "/usr/lib/x86_64-linux-gnu/libz.so.1",
        "/lib/x86_64-linux-gnu/libz.so.1",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("zlib is present on Debian");
    // The operator names the runtime, in the models' config.toml.
    let config =
        |runtime: &str| format!("worker = \"onnx\"\n[parameters]\nruntime = \"{runtime}\"\n");
    let (missing, foreign) = (config("/nonexistent/libonnxruntime.so"), config(zlib));
    let repo = kiln_tests::fixtures::TempRepository::new(&[
        ("missing", &missing, &[1]),
        ("foreign", &foreign, &[1]),
        ("good", "worker = \"onnx\"\n", &[1]),
    ]);
    let model = model_repository().join("ocr-cls/1/model.onnx");
    for name in ["missing", "foreign", "good"] {
        std::os::unix::fs::symlink(&model, repo.path().join(name).join("1/model.onnx")).unwrap();
    }
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    for (name, want) in [
        ("missing", "file not found"),
        ("foreign", "cannot load ONNX Runtime"),
    ] {
        let err = c.load_model(name, &json!({})).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{err}");
        assert!(err.to_string().contains(want), "{name}: {err}");
    }
    // A failed runtime load leaves nothing behind: the right one still loads.
    c.load_model("good", &json!({})).await.unwrap();
    assert!(c.is_ready().await.unwrap());
}

/// The intra-op threads of its own pool each `init` of `model` logged, in order.
fn intra_op_threads_logged(log: &str, model: &str) -> Vec<usize> {
    log.lines()
        .filter(|l| l.contains(&format!("{model}/1/model.onnx")))
        .filter_map(|l| {
            let (before, _) = l.split_once(" intra-op thread(s)")?;
            let (_, before) = before.rsplit_once("own pool of")?;
            before.rsplit(' ').next()?.parse().ok()
        })
        .collect()
}

/// Without thread settings a session runs on the process's shared pool (one
/// thread per physical core); `intra_op_threads` or `allow_spinning` give it a pool
/// of its own, whose threads default to the cores divided among the group's
/// instances (the server passes their count to every `init`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_share_one_pool_unless_threads_are_set() {
    let repo = model_repository();
    let kiln = Kiln::start(&["--model-repository", repo.to_str().unwrap()]);
    let c = &kiln.client;
    c.load_model("ocr-cls", &json!({})).await.unwrap();
    let log = kiln.log();
    let shared = log
        .lines()
        .rfind(|l| l.contains("ocr-cls/1/model.onnx"))
        .unwrap();
    let (_, pool) = shared.split_once("shared pool of ").unwrap();
    let cores: usize = pool.split(' ').next().unwrap().parse().unwrap();
    let available = std::thread::available_parallelism().unwrap().get();
    assert!(cores >= 1 && cores <= available, "{shared}");
    assert!(intra_op_threads_logged(&log, "ocr-cls").is_empty(), "{log}");
    c.load_model("ocr-cls", &json!({"instances": 2, "allow_spinning": true}))
        .await
        .unwrap();
    let logged = intra_op_threads_logged(&kiln.log(), "ocr-cls");
    // One signature-reading init per instance, each told of both.
    assert_eq!(logged, [(cores / 2).max(1); 2], "{logged:?}");
    let overrides = json!({"instances": 2, "intra_op_threads": 3});
    c.load_model("ocr-cls", &overrides).await.unwrap();
    let logged = intra_op_threads_logged(&kiln.log(), "ocr-cls");
    assert_eq!(logged[2..], [3, 3], "{logged:?}");
}

/// The shared pool needs no spinning setting; an operator may still give a model
/// its own pool without spinning, or one that stops spinning between runs, and a
/// value that is not a boolean is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spinning_settings_are_load_parameters() {
    let repo = model_repository();
    let kiln = Kiln::start(&["--model-repository", repo.to_str().unwrap()]);
    let c = &kiln.client;
    let inits = |kiln: &Kiln| -> Vec<String> {
        kiln.log()
            .lines()
            .filter(|l| l.contains("ocr-rec/1/model.onnx") && l.contains("intra-op"))
            .map(str::to_owned)
            .collect()
    };
    c.load_model("ocr-rec", &json!({})).await.unwrap();
    let logged = inits(&kiln);
    assert!(logged.last().unwrap().contains("shared pool"), "{logged:?}");
    c.load_model("ocr-rec", &json!({"allow_spinning": false}))
        .await
        .unwrap();
    let logged = inits(&kiln);
    assert!(
        logged.last().unwrap().contains("own pool")
            && logged.last().unwrap().contains("(no spinning)"),
        "{logged:?}"
    );
    c.load_model("ocr-rec", &json!({"force_spinning_stop": true}))
        .await
        .unwrap();
    let logged = inits(&kiln);
    assert!(
        logged.last().unwrap().contains("own pool")
            && logged
                .last()
                .unwrap()
                .contains("(spinning stops between runs)"),
        "{logged:?}"
    );
    for key in ["allow_spinning", "force_spinning_stop"] {
        let err = c
            .load_model("ocr-rec", &json!({ key: "sometimes" }))
            .await
            .unwrap_err();
        assert_eq!(err.status(), Some(400), "{err}");
        assert!(err.to_string().contains(key), "{err}");
    }
}

/// The example repository's PP-OCR models send what is queued when an instance is
/// free (`timeout` 0): with the soft batcher's former 2 ms a lone `ocr-cls`
/// request waited 2 ms for company (4.5 ms a request against Python's 1.7 ms,
/// #32).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pp_ocr_models_never_hold_a_lone_request() {
    let kiln = Kiln::serve_examples(&["ocr-det", "ocr-cls", "ocr-rec"]);
    for model in ["ocr-det", "ocr-cls", "ocr-rec"] {
        let config = kiln_tests::triton_config(&kiln.url, model).await;
        let parameters = &config["parameters"];
        assert_eq!(
            parameters["batcher"]["string_value"], "soft",
            "{model}: {config}"
        );
        assert_eq!(
            parameters["timeout_ms"]["string_value"], "0",
            "{model}: {config}"
        );
    }
}
