//! Triton's `dims`, `reshape` and `optional` in a `config.pbtxt`, served by the
//! real server and onnx worker over the fetched PP-OCR classifier: clients send
//! and receive the file's `dims` (with the batch dimension), the model sees
//! `reshape.shape`, answers equal onnxruntime's in Python (`tests/golden`).

#![allow(clippy::unwrap_used)]

use kiln_client::InferRequest;
use kiln_tests::fixtures::TempRepository;
use kiln_tests::golden::{bytemuck_f32, golden, max_abs_diff};
use kiln_tests::{triton_config, Kiln};
use serde_json::json;

const OUTPUT: &str = "save_infer_model/scale_0.tmp_1";

/// The classifier with each image row flattened for clients (`[3, h * w]`; the
/// model takes `[3, h, w]`) and its two probabilities as a column (`[2, 1]`;
/// the model gives `[2]`).
fn flat(h: i64, w: i64, client_w: i64) -> String {
    format!(
        r#"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 3, {client_w} ]
          reshape: {{ shape: [ 3, {h}, {w} ] }} }} ]
output [ {{ name: "{OUTPUT}" data_type: TYPE_FP32 dims: [ 2, 1 ]
           reshape: {{ shape: [ 2 ] }} }} ]
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshaped_tensors_take_the_files_dims_and_answer_as_onnxruntime() {
    let case = golden().cases_for("ocr-cls").next().unwrap();
    let image = &case.inputs[0];
    let (h, w) = (image.shape[2], image.shape[3]);
    let repo = TempRepository::new(&[]);
    repo.write_triton("flat", &flat(h, w, h * w), &[1]);
    // One element short: refused at load, naming the tensor.
    repo.write_triton("short", &flat(h, w, h * w - 1), &[1]);
    repo.write_triton(
        "optional",
        &format!(
            "{}\ninput [ {{ name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] optional: true }} ]\n",
            flat(h, w, h * w)
        ),
        &[1],
    );
    let kiln = Kiln::start(&[
        "--model-store",
        &repo.arg(),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "flat",
    ]);
    let c = &kiln.client;

    // Metadata shows what clients send and get; /config the file's reshape.
    let meta = c.model_metadata("flat").await.unwrap();
    assert_eq!(meta["inputs"][0]["shape"], json!([-1, 3, h * w]), "{meta}");
    assert_eq!(meta["outputs"][0]["shape"], json!([-1, 2, 1]), "{meta}");
    let config = triton_config(&kiln.url, "flat").await;
    assert_eq!(
        config["input"][0]["reshape"],
        json!({"shape": [3, h, w]}),
        "{config}"
    );
    assert_eq!(config["input"][0]["dims"], json!([3, h * w]), "{config}");

    // Two rows, flattened: the model's answers, as a column each.
    let mut input = image.input();
    let rows = 2;
    input.shape = vec![rows, 3, h * w];
    input.data = [input.data.clone(), input.data.clone()].concat().into();
    let request = InferRequest {
        model: "flat".into(),
        inputs: vec![input.clone()],
        ..Default::default()
    };
    let response = c.infer(&request).await.unwrap();
    assert_eq!(response.outputs[0].shape, vec![rows, 2, 1]);
    let got = bytemuck_f32(&response.outputs[0].data);
    let want = case.outputs[0].floats();
    let want: Vec<f32> = [want.clone(), want].concat();
    let diff = max_abs_diff(&got, &want);
    assert!(diff <= 1e-4, "max |diff| {diff}: {got:?} {want:?}");

    // The model's own shape is not the clients': a 400 naming the input.
    let unflat = image.input();
    let err = c
        .infer(&InferRequest {
            model: "flat".into(),
            inputs: vec![unflat],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("input `x`"), "{err}");

    // Element counts that differ, and an optional input: load errors naming why.
    for (model, says) in [
        ("short", "hold different numbers of elements"),
        (
            "optional",
            "input `y`: `optional: true` is not supported by kiln",
        ),
    ] {
        let err = c.load_model(model, &json!({})).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{model}: {err}");
        assert!(err.to_string().contains(says), "{model}: {err}");
    }
}
