//! The python worker (`workers/python`): Triton python-backend `model.py` files,
//! unmodified, served from a model repository, each instance's interpreter in its
//! own worker host. `echo_python` and `ocr_cls_python` (Triton's files, in
//! `tests/fixtures/python-models`) answer what they should — ocr_cls_python what
//! the onnx worker answers for the same model file — and `upper_python` takes and
//! gives BYTES as numpy object arrays, `auto_python` declares itself in
//! `auto_complete_config`; `faults_python` fails on
//! purpose, and each failure costs only what it should while the server stays up.
//! The python backend's own examples run unmodified: `add_sub`, and its BLS
//! examples (`bls_sync`, `bls_async`) calling other models through the server.
//! The interpreter's environment is `.cache/venv` (scripts/setup-python: numpy,
//! onnxruntime).

#![allow(clippy::unwrap_used)] // helpers of tests: a failure is the test failing

use std::path::{Path, PathBuf};

use kiln_client::{ClientError, DataType, HttpClient, InferRequest, InferResponse, InputTensor};
use kiln_tests::fixtures::TempRepository;
use kiln_tests::{cache_dir, metric, repo_root, Kiln};
use kiln_worker_sdk::encode_bytes;

fn fixtures() -> PathBuf {
    repo_root().join("tests/fixtures/python-models")
}

/// A repository holding the fixture `models` (config.toml with the venv's
/// interpreter as `python`, and 1/model.py), plus `extra` models (name, config).
fn repository(models: &[&str], extra: &[(&str, &str)]) -> TempRepository {
    let python = cache_dir().join("venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup-python",
        python.display()
    );
    let configs: Vec<(String, String)> = models
        .iter()
        .map(|m| {
            let config = std::fs::read_to_string(fixtures().join(m).join("config.toml")).unwrap();
            // [parameters] is the configs' last table.
            let config = format!("{config}python = \"{}\"\n", python.display());
            (m.to_string(), config)
        })
        .chain(extra.iter().map(|(m, c)| (m.to_string(), c.to_string())))
        .collect();
    let list: Vec<(&str, &str, &[u64])> = configs
        .iter()
        .map(|(m, c)| (m.as_str(), c.as_str(), &[1u64][..]))
        .collect();
    let repo = TempRepository::new(&list);
    for m in models {
        std::fs::copy(
            fixtures().join(m).join("1/model.py"),
            repo.path().join(m).join("1/model.py"),
        )
        .unwrap();
    }
    repo
}

fn link_cls_model(repo: &Path, model: &str) {
    let onnx = repo_root().join("examples/models/ocr-cls/1/model.onnx");
    assert!(
        onnx.is_file(),
        "{} is missing: run scripts/fetch-models",
        onnx.display()
    );
    std::os::unix::fs::symlink(onnx, repo.join(model).join("1/model.onnx")).unwrap();
}

fn int32(model: &str, values: &[i32]) -> InferRequest {
    InferRequest {
        model: model.into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    }
}

async fn faults(client: &HttpClient, values: &[i32]) -> Result<InferResponse, ClientError> {
    client.infer(&int32("faults_python", values)).await
}

/// The faults model's answer to a request it serves: 2 × INPUT0, and its first
/// value as text.
fn check_served(answer: &InferResponse, values: &[i32]) {
    let doubled: Vec<i32> = values.iter().map(|v| v * 2).collect();
    assert_eq!(answer.outputs[0].values::<i32>(), doubled);
    let text = values[0].to_string();
    let mut want = (text.len() as u32).to_le_bytes().to_vec();
    want.extend_from_slice(text.as_bytes());
    assert_eq!(answer.outputs[1].dtype, DataType::Bytes);
    assert_eq!(answer.outputs[1].shape, vec![1, 1]);
    assert_eq!(&answer.outputs[1].data[..], &want[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tritons_python_models_answer_unmodified() {
    let onnx_cls = "worker = \"onnx\"\n[parameters]\nmax_batch_size = 32\nintra_op_threads = 1\n";
    let repo = repository(
        &[
            "echo_python",
            "ocr_cls_python",
            "upper_python",
            "auto_python",
        ],
        &[("ocr_cls_onnx", onnx_cls)],
    );
    link_cls_model(repo.path(), "ocr_cls_python");
    link_cls_model(repo.path(), "ocr_cls_onnx");
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "*"]);
    let client = &kiln.client;

    // echo_python: UINT32 + 1, eight clients at once (batched as they come).
    let tasks: Vec<_> = (0..8u32)
        .map(|i| {
            let client = client.clone();
            let values: Vec<u32> = (0..=i).map(|v| v * 1000 + i).collect();
            tokio::spawn(async move {
                let request = InferRequest {
                    model: "echo_python".into(),
                    inputs: vec![InputTensor::from_slice(
                        "INPUT0",
                        DataType::Uint32,
                        &[1, values.len() as i64],
                        &values,
                    )],
                    ..Default::default()
                };
                let answer = client.infer(&request).await;
                (values, answer)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    for (values, answer) in answers {
        let answer = answer.unwrap();
        let want: Vec<u32> = values.iter().map(|v| v + 1).collect();
        assert_eq!(answer.outputs[0].name, "OUTPUT0");
        assert_eq!(answer.outputs[0].values::<u32>(), want);
    }

    // upper_python: BYTES in and out as numpy object arrays (an empty element too).
    let request = InferRequest {
        model: "upper_python".into(),
        inputs: vec![InputTensor {
            name: "TEXT".into(),
            dtype: DataType::Bytes,
            shape: vec![1, 3],
            data: encode_bytes(&["kiln", "", "Fires"]).into(),
        }],
        ..Default::default()
    };
    let answer = client.infer(&request).await.unwrap();
    let upper = answer.outputs.iter().find(|o| o.name == "UPPER").unwrap();
    assert_eq!(
        (upper.dtype, &upper.shape[..]),
        (DataType::Bytes, &[1, 3][..])
    );
    assert_eq!(&upper.data[..], &encode_bytes(&["KILN", "", "FIRES"])[..]);
    let lengths = answer.outputs.iter().find(|o| o.name == "LENGTHS").unwrap();
    assert_eq!(lengths.values::<i32>(), vec![4, 0, 5]);

    // auto_python declares its tensors and batching in auto_complete_config: two
    // rows of three pass (max_batch_size 4) and are halved.
    let request = InferRequest {
        model: "auto_python".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Fp32,
            &[2, 3],
            &[1f32, 2., 3., 4., 5., 6.],
        )],
        ..Default::default()
    };
    let answer = client.infer(&request).await.unwrap();
    assert_eq!(answer.outputs[0].shape, vec![2, 3]);
    assert_eq!(
        answer.outputs[0].values::<f32>(),
        vec![0.5, 1., 1.5, 2., 2.5, 3.]
    );

    // ocr_cls_python: onnxruntime inside model.py answers as the onnx worker does.
    let line: Vec<f32> = (0..3 * 48 * 192)
        .map(|i| ((i * 7919 % 255) as f32 / 127.5) - 1.0)
        .collect();
    for rows in [1usize, 3] {
        let data: Vec<f32> = line
            .iter()
            .copied()
            .cycle()
            .take(line.len() * rows)
            .collect();
        let request = |model: &str| InferRequest {
            model: model.into(),
            inputs: vec![InputTensor::from_slice(
                "x",
                DataType::Fp32,
                &[rows as i64, 3, 48, 192],
                &data,
            )],
            ..Default::default()
        };
        let python = client.infer(&request("ocr_cls_python")).await.unwrap();
        let onnx = client.infer(&request("ocr_cls_onnx")).await.unwrap();
        assert_eq!(python.outputs[0].shape, vec![rows as i64, 2]);
        let (p, o) = (
            python.outputs[0].values::<f32>(),
            onnx.outputs[0].values::<f32>(),
        );
        assert_eq!(p.len(), rows * 2);
        for (a, b) in p.iter().zip(&o) {
            assert!((a - b).abs() < 1e-4, "python {p:?} vs onnx {o:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_failure_costs_only_what_it_should() {
    let repo = repository(&["faults_python"], &[]);
    // The same model.py whose batches are exactly three requests (hard batcher).
    let trio = repo.path().join("faults_trio");
    std::fs::create_dir_all(trio.join("1")).unwrap();
    std::fs::copy(
        fixtures().join("faults_python/1/model.py"),
        trio.join("1/model.py"),
    )
    .unwrap();
    let config = std::fs::read_to_string(repo.path().join("faults_python/config.toml")).unwrap();
    let config = config.replace("\nbatch_size = 8", "\nbatch_size = 3\nbatcher = \"hard\"");
    std::fs::write(trio.join("config.toml"), config).unwrap();
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "*"]);
    let client = &kiln.client;
    check_served(&faults(client, &[5, 6]).await.unwrap(), &[5, 6]);

    // InferenceResponse(error=...) fails its request alone: INVALID_ARG is 400,
    // others 500; its batch-mate is answered. The three make one batch.
    let (a, b, c) = (
        int32("faults_trio", &[-4]),
        int32("faults_trio", &[-5]),
        int32("faults_trio", &[3]),
    );
    let (bad, internal, good) = tokio::join!(client.infer(&a), client.infer(&b), client.infer(&c));
    let bad = bad.unwrap_err();
    assert_eq!(bad.status(), Some(400), "{bad}");
    assert!(bad.to_string().contains("request -4 is invalid"), "{bad}");
    let internal = internal.unwrap_err();
    assert_eq!(internal.status(), Some(500), "{internal}");
    assert!(
        internal.to_string().contains("request -5 failed"),
        "{internal}"
    );
    check_served(&good.unwrap(), &[3]);
    let text = client.metrics().await.unwrap();
    let batches = metric(&text, "kiln_batch_size_count", &[("model", "faults_trio")]);
    assert_eq!(batches, Some(1.0), "the three shared one batch: {text}");

    // A raised exception fails the batch with its message; the next is served.
    let raised = faults(client, &[-1]).await.unwrap_err();
    assert_eq!(raised.status(), Some(500), "{raised}");
    assert!(raised.to_string().contains("asked to raise"), "{raised}");
    check_served(&faults(client, &[7]).await.unwrap(), &[7]);

    // Too few responses fail the batch, saying so.
    let short = faults(client, &[-3]).await.unwrap_err();
    assert_eq!(short.status(), Some(500), "{short}");
    assert!(
        short
            .to_string()
            .contains("returned 0 responses for 1 requests"),
        "{short}"
    );
    check_served(&faults(client, &[8]).await.unwrap(), &[8]);

    // os._exit(1) ends the interpreter's process: its batch fails, the host is
    // started again (initialize runs again) and later requests are served.
    for round in 0..2 {
        let crashed = faults(client, &[-2]).await.unwrap_err();
        assert_eq!(crashed.status(), Some(500), "{crashed}");
        assert!(
            crashed
                .to_string()
                .contains("worker host of model `faults_python`"),
            "{crashed}"
        );
        check_served(&faults(client, &[round + 10]).await.unwrap(), &[round + 10]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_wrong_interpreters_and_clients_naming_one_are_refused() {
    let fixture = std::fs::read_to_string(fixtures().join("echo_python/config.toml")).unwrap();
    let in_process = fixture.replace("isolation = \"process\"", "isolation = \"none\"");
    let elsewhere = format!("{fixture}python = \"/nonexistent/bin/python\"\n");
    // The interpreter names a program: a client's load may not set it.
    let by_client = serde_json::json!({ "python": "/bin/sh" });
    let none = serde_json::json!({});
    for (config, parameters, want) in [
        (in_process, &none, "load it with isolation = \"process\""),
        (elsewhere, &none, "/nonexistent/bin/python"),
        (
            fixture.clone(),
            &by_client,
            "parameter `python` of worker `python` may only be set by the operator",
        ),
    ] {
        let repo = TempRepository::new(&[("echo_python", &config, &[1])]);
        std::fs::copy(
            fixtures().join("echo_python/1/model.py"),
            repo.path().join("echo_python/1/model.py"),
        )
        .unwrap();
        let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
        let e = kiln
            .client
            .load_model("echo_python", parameters)
            .await
            .unwrap_err();
        assert_eq!(e.status(), Some(400), "{e}");
        assert!(e.to_string().contains(want), "{e}");
    }
}

fn fp32(name: &str, values: &[f32; 4]) -> InputTensor {
    InputTensor::from_slice(name, DataType::Fp32, &[4], values)
}

fn add_sub_request(model: &str, callee: Option<&str>) -> InferRequest {
    let mut inputs = vec![
        fp32("INPUT0", &[1.5, 2., 3., -4.]),
        fp32("INPUT1", &[0.5, 5., -1., 4.]),
    ];
    if let Some(callee) = callee {
        inputs.insert(
            0,
            InputTensor {
                name: "MODEL_NAME".into(),
                dtype: DataType::Bytes,
                shape: vec![1],
                data: encode_bytes(&[callee]).into(),
            },
        );
    }
    InferRequest {
        model: model.into(),
        inputs,
        ..Default::default()
    }
}

/// What add_sub answers for [`add_sub_request`] (and what Triton answers for
/// the BLS examples calling it): the sum and the difference.
fn check_add_sub(answer: &InferResponse) {
    let output = |name: &str| {
        let o = answer.outputs.iter().find(|o| o.name == name).unwrap();
        assert_eq!((o.dtype, &o.shape[..]), (DataType::Fp32, &[4][..]));
        o.values::<f32>()
    };
    assert_eq!(output("OUTPUT0"), vec![2., 7., 2., 0.]);
    assert_eq!(output("OUTPUT1"), vec![1., -3., 4., -8.]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tritons_bls_examples_call_models_unmodified() {
    let repo = repository(&["add_sub", "bls_sync", "bls_async"], &[]);
    // The examples' `pytorch` model computes what add_sub does (with torch,
    // which the test environment has not): add_sub's files stand in for it.
    let pytorch = repo.path().join("pytorch");
    std::fs::create_dir_all(pytorch.join("1")).unwrap();
    for file in ["config.toml", "1/model.py"] {
        std::fs::copy(repo.path().join("add_sub").join(file), pytorch.join(file)).unwrap();
    }
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "*"]);
    let client = &kiln.client;
    check_add_sub(
        &client
            .infer(&add_sub_request("add_sub", None))
            .await
            .unwrap(),
    );

    // exec(): the callee named by MODEL_NAME answers through the server.
    for callee in ["add_sub", "pytorch"] {
        let answer = client
            .infer(&add_sub_request("bls_sync", Some(callee)))
            .await;
        check_add_sub(&answer.unwrap());
    }
    // async def execute awaiting async_exec() of both.
    check_add_sub(
        &client
            .infer(&add_sub_request("bls_async", None))
            .await
            .unwrap(),
    );

    // A missing model: exec() answers an error response (has_error()), which the
    // example raises with error().message(); the batch fails, nothing crashes.
    let missing = client
        .infer(&add_sub_request("bls_sync", Some("no_such_model")))
        .await
        .unwrap_err();
    assert_eq!(missing.status(), Some(500), "{missing}");
    assert!(
        missing.to_string().contains("no model `no_such_model`"),
        "{missing}"
    );
    // A cycle: bls_sync calling itself, or bls_async (which calls models), is
    // refused at once rather than waiting on itself.
    for (callee, want) in [
        ("bls_sync", "cannot call itself"),
        ("bls_async", "which itself calls models"),
    ] {
        let refused = client
            .infer(&add_sub_request("bls_sync", Some(callee)))
            .await
            .unwrap_err();
        assert_eq!(refused.status(), Some(500), "{refused}");
        assert!(refused.to_string().contains(want), "{refused}");
    }
    // Every host is still up and serving.
    check_add_sub(
        &client
            .infer(&add_sub_request("bls_sync", Some("add_sub")))
            .await
            .unwrap(),
    );
    let text = client.metrics().await.unwrap();
    for model in ["add_sub", "bls_sync", "bls_async"] {
        let restarts = metric(
            &text,
            "kiln_worker_host_restarts_total",
            &[("model", model)],
        );
        assert!(restarts.unwrap_or(0.0) == 0.0, "{model}: {text}");
    }
}

/// A model.py that leaks 64 MiB per request, in a host bounded by
/// `max_host_memory`: its allocations fail there (MemoryError, one batch), the
/// host is restarted, and the model serves again; another model answers all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaking_model_is_bounded_and_its_host_restarted() {
    let repo = repository(&["leak_python", "add_sub"], &[]);
    let config = repo.path().join("leak_python/config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}max_host_memory = {}\n", 1u64 << 30)).unwrap();
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "*"]);
    let client = &kiln.client;
    let leak = |i: i32| async move { client.infer(&int32("leak_python", &[i])).await };
    let output = |answer: &InferResponse, name: &str| {
        answer
            .outputs
            .iter()
            .find(|o| o.name == name)
            .unwrap()
            .clone()
    };
    let held = |answer: &InferResponse| output(answer, "HELD").values::<i64>()[0];
    let mut kept = Vec::new();
    let mut failure = None;
    for i in 0..32 {
        match leak(i).await {
            Ok(answer) => {
                assert_eq!(output(&answer, "OUTPUT0").values::<i32>(), vec![i]);
                kept.push(held(&answer));
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
        check_add_sub(
            &client
                .infer(&add_sub_request("add_sub", None))
                .await
                .unwrap(),
        );
    }
    let failure = failure.expect("64 MiB a request reaches 1 GiB within 16 requests");
    assert_eq!(failure.status(), Some(500), "{failure}");
    assert!(failure.to_string().contains("MemoryError"), "{failure}");
    let want: Vec<i64> = (1..=kept.len() as i64).map(|n| n * 64).collect();
    assert_eq!(kept, want);
    assert!(kept.len() >= 4, "the host started near its bound: {kept:?}");

    // A new host (a new interpreter, nothing kept) serves the next request.
    let answer = leak(100).await.unwrap();
    assert_eq!(held(&answer), 64);
    let text = client.metrics().await.unwrap();
    let restarts = metric(
        &text,
        "kiln_worker_host_restarts_total",
        &[("model", "leak_python")],
    );
    assert_eq!(restarts, Some(1.0), "{text}");
    check_add_sub(
        &client
            .infer(&add_sub_request("add_sub", None))
            .await
            .unwrap(),
    );
}

/// Triton's `ocr_cls_python` folder as Triton serves it — its config.pbtxt (which
/// names no interpreter) and model.py, byte for byte — runs in the environment the
/// operator gives the server (`KILN_PYTHON`, as Triton's stub takes the server's
/// PATH): model.py imports onnxruntime, which Debian's default python3 lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_triton_folder_runs_in_the_operators_environment() {
    let repo = TempRepository::new(&[]);
    let shared = repo_root().join("../shared/tools/triton/models/ocr_cls_python");
    for file in ["config.pbtxt", "1/model.py"] {
        let text = std::fs::read(fixtures().join("ocr_cls_python").join(file)).unwrap();
        if shared.is_dir() {
            assert_eq!(text, std::fs::read(shared.join(file)).unwrap(), "{file}");
        }
        let to = repo.path().join("ocr_cls_python").join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, text).unwrap();
    }
    link_cls_model(repo.path(), "ocr_cls_python");
    let python = cache_dir().join("venv/bin/python");
    let kiln = Kiln::start_with_env(
        &["--model-repository", &repo.arg()],
        &[("KILN_PYTHON", python.to_str().unwrap())],
    );
    let client = &kiln.client;
    client
        .load_model("ocr_cls_python", &serde_json::json!({}))
        .await
        .unwrap();
    let data = vec![0.25f32; 2 * 3 * 48 * 192];
    let request = InferRequest {
        model: "ocr_cls_python".into(),
        inputs: vec![InputTensor::from_slice(
            "x",
            DataType::Fp32,
            &[2, 3, 48, 192],
            &data,
        )],
        ..Default::default()
    };
    let answer = client.infer(&request).await.unwrap();
    assert_eq!(answer.outputs[0].shape, vec![2, 2]);
    // The classifier's softmax: each row's two probabilities sum to 1.
    for row in answer.outputs[0].values::<f32>().chunks(2) {
        assert!((row[0] + row[1] - 1.0).abs() < 1e-4, "{row:?}");
    }
}
