//! A Triton model repository served unmodified: `config.pbtxt` files as Triton's
//! documentation writes them, over the fetched PP-OCR classifier, loaded by the
//! real server and onnx worker, answers compared with onnxruntime in Python
//! (`tests/golden`), and fields or backends kiln does not honour refused by name.

#![allow(clippy::unwrap_used)]

use kiln_client::InferRequest;
use kiln_server::grpc::proto;
use kiln_tests::fixtures::{triton_pipe, TempRepository};
use kiln_tests::golden::{bytemuck_f32, golden, max_abs_diff};
use kiln_tests::{triton_config, Kiln};
use prost::Message;
use serde_json::json;

/// Triton's own example shape: lists without `:`, enums by name, a version policy.
const OCR_CLS: &str = r#"
name: "ocr-cls"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [
  {
    name: "x"
    data_type: TYPE_FP32
    dims: [ 3, -1, -1 ]
  }
]
output [
  {
    name: "save_infer_model/scale_0.tmp_1"
    data_type: TYPE_FP32
    dims: [ 2 ]
  }
]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
instance_group [ { count: 1, kind: KIND_CPU } ]
version_policy: { specific { versions: [ 1 ] } }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"#;

fn repository() -> TempRepository {
    let repo = TempRepository::new(&[]);
    repo.write_triton("ocr-cls", OCR_CLS, &[1, 2]);
    // Version 2 is not a model: the policy (`specific [1]`) must keep kiln off it.
    std::fs::write(repo.path().join("ocr-cls/2/model.onnx"), b"not onnx").unwrap();
    repo.write_triton("pipe", &triton_pipe(16), &[]);
    // Nothing but the backend and a batch size: the tensors come from the model.
    repo.write_triton(
        "auto",
        "backend: \"onnxruntime\"\nmax_batch_size: 8\n",
        &[1],
    );
    repo.write_triton("trt", "platform: \"tensorrt_plan\"\n", &[1]);
    let lying = OCR_CLS
        .replace("name: \"ocr-cls\"", "name: \"lying\"")
        .replace("TYPE_FP32\n    dims: [ 3", "TYPE_INT32\n    dims: [ 3");
    repo.write_triton("lying", &lying, &[1]);
    // A warmup request without the model's input: the load fails naming it.
    repo.write_triton(
        "warm",
        "backend: \"onnxruntime\"\nmodel_warmup [{ name: \"w\" batch_size: 1 }]\n",
        &[1],
    );
    repo.write_triton(
        "tensorrt",
        "backend: \"onnxruntime\"\noptimization { execution_accelerators {\n  \
         gpu_execution_accelerator [ { name: \"tensorrt\" } ] } }\n",
        &[1],
    );
    repo
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn triton_configs_serve_the_same_answers_as_onnxruntime() {
    let repo = repository();
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    for model in ["ocr-cls", "auto", "pipe"] {
        c.load_model(model, &json!({})).await.unwrap();
    }
    for case in golden().cases_for("ocr-cls") {
        for model in ["ocr-cls", "auto", "pipe"] {
            let mut request = InferRequest {
                model: model.into(),
                inputs: case.inputs.iter().map(|t| t.input()).collect(),
                ..Default::default()
            };
            if model == "pipe" {
                request.inputs[0].name = "IMAGE".into();
            }
            let response = c.infer(&request).await.unwrap();
            let got = bytemuck_f32(&response.outputs[0].data);
            let diff = max_abs_diff(&got, &case.outputs[0].floats());
            assert!(diff <= 1e-4, "{model} {}: max |diff| {diff}", case.tag);
        }
    }
    let config = triton_config(&kiln.url, "ocr-cls").await;
    assert_eq!(config["max_batch_size"], json!(16), "{config}");
    assert_eq!(
        config["dynamic_batching"]["preferred_batch_size"],
        json!([4, 8]),
        "{config}"
    );
    assert_eq!(
        config["version_policy"],
        json!({"specific": {"versions": [1]}}),
        "{config}"
    );
    // Auto-completed from the model: its tensors, batching at 8.
    let auto = triton_config(&kiln.url, "auto").await;
    assert_eq!(auto["max_batch_size"], json!(8), "{auto}");
    assert_eq!(auto["input"][0]["name"], json!("x"), "{auto}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_kiln_does_not_honour_is_refused_by_name() {
    let repo = repository();
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    let c = &kiln.client;
    for (model, says) in [
        ("trt", "platform `tensorrt_plan` is not available"),
        ("warm", "`model_warmup` `w` failed: missing input `x`"),
        ("lying", "input `x`: the config declares"),
        ("tensorrt", "GPU accelerator `tensorrt` is not available"),
    ] {
        let err = c.load_model(model, &json!({})).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{model}: {err}");
        assert!(err.to_string().contains(says), "{model}: {err}");
    }
    // The refused models were unloaded again (or never served): nothing
    // half-loaded answers.
    for model in ["lying", "warm"] {
        let err = c.model_metadata(model).await.unwrap_err();
        assert_eq!(err.status(), Some(404), "{model}");
    }
    // The index lists the pbtxt folders.
    let index = c.repository_index().await.unwrap();
    for model in ["auto", "ocr-cls", "pipe", "trt"] {
        assert!(index.iter().any(|m| m["name"] == model), "{index:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_answers_what_triton_answers_for_the_same_file() {
    // Triton 2.51's answer for this file, recorded (tests/fixtures/triton).
    let fixtures = kiln_tests::repo_root().join("tests/fixtures/triton");
    let pbtxt = std::fs::read_to_string(fixtures.join("pipe.config.pbtxt")).unwrap();
    let triton: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("pipe.config.json")).unwrap())
            .unwrap();
    let repo = TempRepository::new(&[("echo", "worker = \"echo\"\n", &[1])]);
    std::fs::create_dir_all(repo.path().join("pipe/1")).unwrap();
    std::fs::write(repo.path().join("pipe/config.pbtxt"), pbtxt).unwrap();
    repo.write_triton("ocr-cls", OCR_CLS, &[1]);
    repo.write_triton(
        "auto",
        "backend: \"onnxruntime\"\nmax_batch_size: 8\n",
        &[1],
    );
    let kiln = Kiln::start(&["--model-repository", &repo.arg(), "--load-model", "*"]);
    let mut pipe = triton_config(&kiln.url, "pipe").await;
    // The one field of kiln's model_config.proto (Triton's newest) that 2.51's
    // has not; Tritons that have it print it as kiln does.
    let newer = pipe["ensemble_scheduling"]
        .as_object_mut()
        .unwrap()
        .remove("max_inflight_requests");
    assert_eq!(newer, Some(json!(0)));
    assert_eq!(pipe, triton);

    // gRPC `ModelConfig`: Triton's whole message, as Triton 2.51 answered it for
    // the same file (recorded with tritonclient, tests/fixtures/triton).
    let recorded = std::fs::read(fixtures.join("pipe.config.grpc.pb")).unwrap();
    let recorded = proto::ModelConfigResponse::decode(recorded.as_slice()).unwrap();
    let grpc = kiln.grpc().await;
    assert_eq!(grpc.model_config("pipe").await.ok(), recorded.config);
    // A worker's model: the same content as `/config`, in protobuf.
    let ocr_grpc = grpc.model_config("ocr-cls").await.unwrap();
    let pinned = ocr_grpc
        .optimization
        .as_ref()
        .and_then(|o| o.input_pinned_memory);
    assert_eq!(pinned.map(|p| p.enable), Some(true), "{ocr_grpc:?}");
    assert_eq!(ocr_grpc.instance_group[0].name, "ocr-cls_0", "{ocr_grpc:?}");
    assert_eq!(
        ocr_grpc.parameters["intra_op_thread_count"].string_value, "1",
        "{ocr_grpc:?}"
    );

    // A worker's model: the file's config, completed as Triton completes it.
    let ocr = triton_config(&kiln.url, "ocr-cls").await;
    assert_eq!(ocr["backend"], json!("onnxruntime"), "{ocr}");
    assert_eq!(ocr["input"][0]["dims"], json!([3, -1, -1]), "{ocr}");
    assert_eq!(ocr["input"][0]["data_type"], json!("TYPE_FP32"), "{ocr}");
    assert_eq!(
        ocr["instance_group"],
        json!([{"name": "ocr-cls_0", "kind": "KIND_CPU", "count": 1, "gpus": [],
                "secondary_devices": [], "profile": [], "passive": false, "host_policy": ""}]),
        "{ocr}"
    );
    assert_eq!(
        ocr["parameters"]["intra_op_thread_count"],
        json!({"string_value": "1"}),
        "{ocr}"
    );
    assert_eq!(
        ocr["optimization"]["input_pinned_memory"],
        json!({"enable": true}),
        "{ocr}"
    );
    // Auto-completed: the tensors the model has.
    let auto = triton_config(&kiln.url, "auto").await;
    assert_eq!(auto["input"][0]["name"], json!("x"), "{auto}");
    assert_eq!(auto["input"][0]["dims"], json!([3, -1, -1]), "{auto}");
    assert_eq!(auto["output"][0]["data_type"], json!("TYPE_FP32"), "{auto}");
    // No instance group: Triton's default for ONNX Runtime on the CPU, two
    // instances, which kiln runs.
    assert_eq!(auto["instance_group"][0]["count"], json!(2), "{auto}");
    let metadata = kiln.client.model_metadata("auto").await.unwrap();
    assert_eq!(metadata["parameters"]["instances"], json!(2), "{metadata}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_warmup_runs_before_the_model_serves() {
    // Zeros twice at batch 2, random values once, and a file from the model's
    // `warmup/` folder: 2 * 2 + 1 + 1 = 6 rows, in 4 runs.
    let repo = TempRepository::new(&[]);
    let sample = |name: &str, rows: u32, count: u32, data: &str| {
        format!(
            "{{ name: \"{name}\" batch_size: {rows} count: {count} inputs {{ key: \"x\" \
             value: {{ data_type: TYPE_FP32 dims: [ 3, 48, 192 ] {data} }} }} }}"
        )
    };
    let config = format!(
        "{OCR_CLS}\nmodel_warmup [ {}, {}, {} ]\n",
        sample("zeros", 2, 2, "zero_data: true"),
        sample("random", 1, 0, "random_data: true"),
        sample("file", 1, 1, "input_data_file: \"x.bin\""),
    );
    repo.write_triton("ocr-cls", &config, &[1]);
    std::fs::create_dir_all(repo.path().join("ocr-cls/warmup")).unwrap();
    let image: Vec<u8> = (0..3 * 48 * 192)
        .flat_map(|i| (i as f32 / 1000.0).to_le_bytes())
        .collect();
    std::fs::write(repo.path().join("ocr-cls/warmup/x.bin"), image).unwrap();
    let kiln = Kiln::start(&["--model-repository", &repo.arg()]);
    kiln.client.load_model("ocr-cls", &json!({})).await.unwrap();
    // No client request yet: what the model ran was its warmup.
    let stats: serde_json::Value = reqwest::get(format!("{}/v2/models/ocr-cls/stats", kiln.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let model = &stats["model_stats"][0];
    assert_eq!(model["inference_count"], json!(6), "{stats}");
    assert_eq!(
        model["inference_stats"]["fail"]["count"],
        json!(0),
        "{stats}"
    );

    // A sample the model refuses (the wrong image size) fails the load by name.
    // (max_batch_size changed too: a load that changes nothing builds nothing.)
    let wrong = config
        .replace(
            "dims: [ 3, 48, 192 ] zero_data",
            "dims: [ 3, 48 ] zero_data",
        )
        .replace("max_batch_size: 16", "max_batch_size: 8");
    std::fs::write(repo.path().join("ocr-cls/config.pbtxt"), wrong).unwrap();
    let err = kiln
        .client
        .load_model("ocr-cls", &json!({}))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("`model_warmup` `zeros` failed"),
        "{err}"
    );
    // The model loaded before serves on.
    let case = golden().cases_for("ocr-cls").next().unwrap();
    let request = InferRequest {
        model: "ocr-cls".into(),
        inputs: case.inputs.iter().map(|t| t.input()).collect(),
        ..Default::default()
    };
    kiln.client.infer(&request).await.unwrap();
}
