//! Triton's model control against the real server: `--model-control-mode`
//! (`none`, `poll`, `explicit` with `--load-model`), `--strict-readiness`,
//! `--disable-auto-complete-config`, and the repository load as KServe's gRPC
//! message lays it out. Repositories of Triton's `config.pbtxt` over the fetched
//! PP-OCR classifier, changed on disk while the server polls; every wait is for
//! what the server reports (index, readiness, config, log), never a fixed sleep.

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::time::Duration;

use kiln_server::grpc::proto;
use kiln_tests::fixtures::{triton_pipe, TempRepository};
use kiln_tests::{model_repository, triton_config, Kiln};
use prost::Message;
use serde_json::{json, Value};

/// A Triton config over the PP-OCR direction classifier.
fn ocr_cls(max_batch_size: u32) -> String {
    format!(
        r#"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] }} ]
output [ {{ name: "save_infer_model/scale_0.tmp_1" data_type: TYPE_FP32 dims: [ 2 ] }} ]
"#
    )
}

/// `ocr-cls` (max_batch_size 16), `pipe` over it, and `auto`, whose tensors come
/// from the model.
fn repository() -> TempRepository {
    let repo = TempRepository::new(&[]);
    repo.write_triton("ocr-cls", &ocr_cls(16), &[1]);
    repo.write_triton("pipe", &triton_pipe(4), &[1]);
    repo.write_triton(
        "auto",
        "backend: \"onnxruntime\"\nmax_batch_size: 8\n",
        &[1],
    );
    repo
}

/// Waits (up to 60 s) until `check` returns something; returns it.
async fn until<T, F: Future<Output = Option<T>>>(what: &str, mut check: impl FnMut() -> F) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The repository index: model → state.
async fn states(kiln: &Kiln) -> Vec<(String, String)> {
    let index = kiln.client.repository_index().await.unwrap();
    index
        .iter()
        .map(|m| {
            let field = |k: &str| m[k].as_str().unwrap_or_default().to_owned();
            (field("name"), field("state"))
        })
        .collect()
}

fn state_of(states: &[(String, String)], model: &str) -> Option<String> {
    states
        .iter()
        .find(|(name, _)| name == model)
        .map(|(_, s)| s.clone())
}

/// `GET /v2/health/ready`'s status.
async fn ready(kiln: &Kiln) -> u16 {
    reqwest::get(format!("{}/v2/health/ready", kiln.url))
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// One request to the classifier (or to `pipe`, whose input is `IMAGE`).
async fn classify(kiln: &Kiln, model: &str) -> Result<(), kiln_client::ClientError> {
    let case = kiln_tests::golden::golden()
        .cases_for("ocr-cls")
        .next()
        .unwrap();
    let mut request = kiln_client::InferRequest {
        model: model.into(),
        inputs: case.inputs.iter().map(|t| t.input()).collect(),
        ..Default::default()
    };
    if model == "pipe" {
        request.inputs[0].name = "IMAGE".into();
    }
    kiln.client.infer(&request).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_follows_the_repository_and_keeps_a_model_whose_reload_fails() {
    let repo = TempRepository::new(&[]);
    repo.write_triton("ocr-cls", &ocr_cls(16), &[1]);
    repo.write_triton("pipe", &triton_pipe(4), &[1]);
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        "0.1",
    ]);
    // Everything loaded at start.
    let at_start = states(&kiln).await;
    assert_eq!(state_of(&at_start, "ocr-cls").as_deref(), Some("READY"));
    assert_eq!(state_of(&at_start, "pipe").as_deref(), Some("READY"));
    assert_eq!(ready(&kiln).await, 200);
    classify(&kiln, "pipe").await.unwrap();

    // Added: loaded.
    repo.write_triton(
        "auto",
        "backend: \"onnxruntime\"\nmax_batch_size: 8\n",
        &[1],
    );
    until("`auto` is loaded", || async {
        (state_of(&states(&kiln).await, "auto").as_deref() == Some("READY")).then_some(())
    })
    .await;
    classify(&kiln, "auto").await.unwrap();

    // Changed: loaded again, with the new config.
    std::fs::write(repo.path().join("ocr-cls/config.pbtxt"), ocr_cls(8)).unwrap();
    until("`ocr-cls` serves max_batch_size 8", || async {
        (triton_config(&kiln.url, "ocr-cls").await["max_batch_size"] == json!(8)).then_some(())
    })
    .await;
    classify(&kiln, "pipe").await.unwrap();

    // Broken: the reload fails, the model loaded before keeps serving.
    std::fs::write(
        repo.path().join("ocr-cls/config.pbtxt"),
        "platform: \"onnxruntime_onnx\"\nmax_batch_size: \"eight\"\n",
    )
    .unwrap();
    let log = kiln.log_with("`ocr-cls` changed: not loaded");
    assert!(log.contains("`ocr-cls` changed: not loaded"), "{log}");
    assert_eq!(
        triton_config(&kiln.url, "ocr-cls").await["max_batch_size"],
        json!(8)
    );
    classify(&kiln, "ocr-cls").await.unwrap();
    assert_eq!(ready(&kiln).await, 200);

    // Removed: unloaded. The index drops the folder as soon as it is gone, the
    // poller unloads the model on its next round: wait for the unload itself.
    std::fs::remove_dir_all(repo.path().join("auto")).unwrap();
    until("`auto` is unloaded", || async {
        let gone = classify(&kiln, "auto").await.err()?;
        (gone.status() == Some(404)).then_some(())
    })
    .await;
    assert_eq!(state_of(&states(&kiln).await, "auto"), None);

    // The ensemble's step removed: the ensemble is not ready, so neither is the
    // server (strict readiness, Triton's default).
    std::fs::remove_dir_all(repo.path().join("ocr-cls")).unwrap();
    until("the server is not ready", || async {
        (ready(&kiln).await == 503).then_some(())
    })
    .await;
    let after = states(&kiln).await;
    assert_eq!(state_of(&after, "pipe").as_deref(), Some("UNAVAILABLE"));
    assert_eq!(state_of(&after, "ocr-cls"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_reloads_a_model_rewritten_in_place_and_shows_why_a_load_failed() {
    // Auto-completed: the tensors come from the model file alone, so a rewritten
    // model.onnx changes what the server reports while its parameters (the
    // config, the folder) stay the same.
    let repo = TempRepository::new(&[]);
    let config = "backend: \"onnxruntime\"\nmax_batch_size: 8\n";
    repo.write_triton("swap", config, &[1]);
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        "0.1",
    ]);
    let output = |m: Value| {
        m["outputs"][0]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let before = output(kiln.client.model_metadata("swap").await.unwrap());
    assert_eq!(before, "save_infer_model/scale_0.tmp_1");
    // The same path rewritten (same inode, same folder): the detector's model.
    let det = std::fs::read(model_repository().join("ocr-det/1/model.onnx")).unwrap();
    std::fs::write(repo.path().join("swap/1/model.onnx"), det).unwrap();
    until("`swap` serves the rewritten model", || async {
        let now = output(kiln.client.model_metadata("swap").await.ok()?);
        (now != before).then_some(())
    })
    .await;

    // A model whose load fails: the index says why, not `unloaded`. Written
    // beside the repository and moved in whole, so no scan sees half of it.
    let staging = TempRepository::new(&[]);
    staging.write_triton(
        "broken",
        "platform: \"onnxruntime_onnx\"\nmax_batch_size: \"eight\"\n",
        &[1],
    );
    std::fs::rename(staging.path().join("broken"), repo.path().join("broken")).unwrap();
    // The poller notes the failure before it logs it.
    kiln.log_with("`broken` added: not loaded");
    let index = kiln.client.repository_index().await.unwrap();
    let row = index.iter().find(|m| m["name"] == json!("broken")).unwrap();
    let reason = (
        row["state"].clone(),
        row["reason"].as_str().unwrap().to_owned(),
    );
    assert_eq!(reason.0, json!("UNAVAILABLE"));
    assert!(reason.1.contains("config.pbtxt"), "{}", reason.1);
    assert!(reason.1.contains("eight"), "{}", reason.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_reloads_a_model_whose_warmup_alone_changed_and_warms_it_again() {
    // Only `model_warmup` differs between the two files (the same size, written
    // in place): the poll must build the model again and run the new warmup.
    let warmed = |count: u32| {
        format!(
            "{}model_warmup [ {{ name: \"zeros\" batch_size: 1 count: {count} inputs {{ \
             key: \"x\" value: {{ data_type: TYPE_FP32 dims: [ 3, 48, 192 ] zero_data: true }} }} }} ]\n",
            ocr_cls(8)
        )
    };
    let repo = TempRepository::new(&[]);
    repo.write_triton("warm", &warmed(1), &[1]);
    let kiln = Kiln::start(&[
        "--model-store",
        &repo.arg(),
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        "0.1",
    ]);
    // Each build's group counts its own inferences: its warmup's, as no client
    // has asked anything.
    let inferences = || async {
        let stats: Value = reqwest::get(format!("{}/v2/models/warm/stats", kiln.url))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        stats["model_stats"][0]["inference_count"].as_u64()
    };
    assert_eq!(inferences().await, Some(1));
    std::fs::write(repo.path().join("warm/config.pbtxt"), warmed(3)).unwrap();
    until(
        "the poll reloads `warm` and runs its new warmup",
        || async { (inferences().await? == 3).then_some(()) },
    )
    .await;
    kiln.log_with("`warm` changed: loaded");
}

/// The refusal Triton answers in `none` and `poll` modes.
const REFUSED: &str = "explicit model load / unload is not allowed if polling is enabled";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn none_mode_loads_everything_and_refuses_the_repository_api_as_triton() {
    let repo = repository();
    let kiln = Kiln::start(&["--model-store", &repo.arg(), "--model-control-mode", "none"]);
    let at_start = states(&kiln).await;
    for model in ["auto", "ocr-cls", "pipe"] {
        assert_eq!(
            state_of(&at_start, model).as_deref(),
            Some("READY"),
            "{at_start:?}"
        );
    }
    // REST: 503 and Triton's words, for a load and an unload.
    for action in ["load", "unload"] {
        let response = reqwest::Client::new()
            .post(format!("{}/v2/repository/models/auto/{action}", kiln.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 503, "{action}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body, json!({ "error": REFUSED }), "{action}");
    }
    // gRPC: UNAVAILABLE, the same words.
    let mut grpc = kiln.grpc().await.raw();
    let load = grpc
        .repository_model_load(proto::RepositoryModelLoadRequest {
            model_name: "auto".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        (load.code(), load.message()),
        (tonic::Code::Unavailable, REFUSED)
    );
    let unload = grpc
        .repository_model_unload(proto::RepositoryModelUnloadRequest {
            model_name: "auto".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(unload.code(), tonic::Code::Unavailable);
    // Still served.
    classify(&kiln, "auto").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_mode_loads_only_the_models_named() {
    let repo = repository();
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--model-control-mode=EXPLICIT",
        "--load-model",
        "ocr-cls",
    ]);
    let at_start = states(&kiln).await;
    assert_eq!(state_of(&at_start, "ocr-cls").as_deref(), Some("READY"));
    assert_eq!(state_of(&at_start, "auto").as_deref(), Some("UNAVAILABLE"));
    assert_eq!(state_of(&at_start, "pipe").as_deref(), Some("UNAVAILABLE"));
    // The API is open.
    kiln.client.load_model("auto", &json!({})).await.unwrap();
    classify(&kiln, "auto").await.unwrap();
    kiln.client.unload_model("auto").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_readiness_follows_the_models_unless_turned_off() {
    for (strict, ready_without_step) in [("true", 503), ("false", 200)] {
        let repo = repository();
        let kiln = Kiln::start(&[
            "--model-repository",
            &repo.arg(),
            "--load-model",
            "pipe",
            "--strict-readiness",
            strict,
        ]);
        assert_eq!(ready(&kiln).await, 200, "strict {strict}");
        // The ensemble's step unloaded: the ensemble is loaded but not ready.
        kiln.client.unload_model("ocr-cls").await.unwrap();
        assert_eq!(
            ready(&kiln).await,
            ready_without_step,
            "strict {strict}: {:?}",
            states(&kiln).await
        );
        kiln.client.load_model("ocr-cls", &json!({})).await.unwrap();
        until("the ensemble is ready again", || async {
            (ready(&kiln).await == 200).then_some(())
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_auto_completion_a_config_declares_every_tensor() {
    let repo = repository();
    // The input declared, the output not.
    repo.write_triton(
        "half",
        "platform: \"onnxruntime_onnx\"\nmax_batch_size: 4\n\
         input [ { name: \"x\" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] } ]\n",
        &[1],
    );
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--disable-auto-complete-config",
    ]);
    for (model, missing) in [("auto", "input `x`"), ("half", "output `save_infer_model")] {
        let e = kiln.client.load_model(model, &json!({})).await.unwrap_err();
        assert_eq!(e.status(), Some(400), "{model}: {e}");
        assert!(
            e.to_string().contains(missing) && e.to_string().contains("auto-complete"),
            "{model}: {e}"
        );
    }
    // A complete config loads.
    kiln.client.load_model("ocr-cls", &json!({})).await.unwrap();
    classify(&kiln, "ocr-cls").await.unwrap();
}

/// KServe's `RepositoryModelLoadRequest` (`grpc_predict_v2.proto`): the model's
/// name is field 1.
#[derive(Clone, PartialEq, prost::Message)]
struct KserveModelLoadRequest {
    #[prost(string, tag = "1")]
    model_name: String,
}

/// KServe's `RepositoryModelLoadResponse`.
#[derive(Clone, PartialEq, prost::Message)]
struct KserveModelLoadResponse {
    #[prost(string, tag = "1")]
    model_name: String,
    #[prost(bool, tag = "2")]
    is_loaded: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kserve_repository_load_names_the_model_in_field_1() {
    let repo = repository();
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let mut grpc = kiln.grpc().await.raw();
    // KServe's bytes on the wire, as kiln's (Triton's) message reads them.
    let kserve = KserveModelLoadRequest {
        model_name: "ocr-cls".into(),
    };
    let wire =
        proto::RepositoryModelLoadRequest::decode(kserve.encode_to_vec().as_slice()).unwrap();
    assert_eq!(
        (wire.repository_name.as_str(), wire.model_name.as_str()),
        ("ocr-cls", "")
    );
    let answer = grpc.repository_model_load(wire).await.unwrap().into_inner();
    let answer = KserveModelLoadResponse::decode(answer.encode_to_vec().as_slice()).unwrap();
    assert_eq!(
        answer,
        KserveModelLoadResponse {
            model_name: "ocr-cls".into(),
            is_loaded: true
        }
    );
    classify(&kiln, "ocr-cls").await.unwrap();
    // No name, or a bad one: the message says "model".
    for (name, says) in [("", "names no model"), ("Bad/Name", "invalid model name")] {
        let e = grpc
            .repository_model_load(proto::RepositoryModelLoadRequest {
                model_name: name.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}: {e:?}");
        assert!(
            e.message().contains(says) && !e.message().contains("worker"),
            "{name}: {e:?}"
        );
    }
    let rest = kiln
        .client
        .load_model("bad.name", &json!({}))
        .await
        .unwrap_err();
    assert_eq!(rest.status(), Some(400), "{rest}");
    assert!(rest.to_string().contains("invalid model name"), "{rest}");
}
