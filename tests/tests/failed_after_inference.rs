//! A request whose inference ran but whose answer could not be delivered (its
//! shared-memory output window too small for the output) is counted as what its
//! client got, an error, not as a success: in `/metrics`
//! (`kiln_requests_total{outcome}`) and in `/stats` (Triton's `success`/`fail`)
//! alike, over REST and gRPC. The real binary, the echo plugin, a real `/dev/shm`
//! object.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_server::grpc::proto;
use kiln_tests::fixtures::{shm_params, ShmObject};
use kiln_tests::{requests_outcome, Kiln};
use serde_json::{json, Value};

/// `(success, invalid, failure)` in `/metrics` and `(success, fail, inference_count)`
/// in `/stats` for `echo`.
async fn counts(kiln: &Kiln) -> ((f64, f64, f64), (u64, u64, u64)) {
    let text = kiln.client.metrics().await.unwrap();
    let outcome = |o: &str| requests_outcome(&text, "echo", o).unwrap_or(0.0);
    let metrics = (outcome("success"), outcome("invalid"), outcome("failure"));
    let stats: Value = reqwest::get(format!("{}/v2/models/echo/stats", kiln.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let model = &stats["model_stats"][0];
    let count = |v: &Value| v.as_u64().unwrap_or(0);
    let stats = (
        count(&model["inference_stats"]["success"]["count"]),
        count(&model["inference_stats"]["fail"]["count"]),
        count(&model["inference_count"]),
    );
    (metrics, stats)
}

/// An echo request over REST of 4 UINT32 values with OUTPUT0 placed in `region`'s
/// first `size` bytes.
fn rest_request(region: &str, size: usize) -> Value {
    json!({
        "id": "too-small",
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "UINT32",
                    "data": [1, 2, 3, 4]}],
        "outputs": [{"name": "OUTPUT0", "parameters": {
            "shared_memory_region": region, "shared_memory_byte_size": size}}],
    })
}

async fn rest_infer(kiln: &Kiln, body: &Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("{}/v2/models/echo/infer", kiln.url))
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rest_answer_that_does_not_fit_its_window_is_not_a_success() {
    // Verbose: the line about the failed request names it.
    let kiln = Kiln::start(&["--load", "echo", "--log-level", "debug"]);
    let object = ShmObject::new(64);
    let (status, v) = reqwest::Client::new()
        .post(format!(
            "{}/v2/systemsharedmemory/region/out/register",
            kiln.url
        ))
        .body(json!({"key": object.key, "offset": 0, "byte_size": 64}).to_string())
        .send()
        .await
        .map(|r| (r.status().as_u16(), r))
        .unwrap();
    assert_eq!(status, 200, "{v:?}");

    // The worker answers 16 bytes; the window holds 8: the client gets a 400.
    let (status, v) = rest_infer(&kiln, &rest_request("out", 8)).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("needs 16 bytes"),
        "{v}"
    );
    assert_eq!(counts(&kiln).await, ((0.0, 1.0, 0.0), (0, 1, 0)));
    let line = kiln.log_with("request_id=too-small");
    assert!(line.contains("needs 16 bytes"), "{line}");

    // One that fits counts as a success, beside it.
    let (status, v) = rest_infer(&kiln, &rest_request("out", 16)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(object.read_u32(0, 4), vec![2, 3, 4, 5]);
    assert_eq!(counts(&kiln).await, ((1.0, 1.0, 0.0), (1, 1, 1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_answer_that_does_not_fit_its_window_is_not_a_success() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let c = kiln.grpc().await;
    let object = ShmObject::new(64);
    c.register_system_shared_memory("out", &object.key, 0, 64)
        .await
        .unwrap();
    let request = InferRequest {
        model: "echo".into(),
        id: Some("too-small".into()),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, 4],
            &[1u32, 2, 3, 4],
        )],
        ..Default::default()
    };
    let mut message = kiln_server::grpc::convert::encode_request(&request);
    message.outputs = vec![proto::model_infer_request::InferRequestedOutputTensor {
        name: "OUTPUT0".into(),
        parameters: shm_params("out", 8),
    }];
    let refused = c.infer_message(message.clone()).await.unwrap_err();
    assert!(refused.to_string().contains("needs 16 bytes"), "{refused}");
    assert_eq!(counts(&kiln).await, ((0.0, 1.0, 0.0), (0, 1, 0)));

    message.outputs[0].parameters = shm_params("out", 16);
    c.infer_message(message).await.unwrap();
    assert_eq!(object.read_u32(0, 4), vec![2, 3, 4, 5]);
    assert_eq!(counts(&kiln).await, ((1.0, 1.0, 0.0), (1, 1, 1)));
}
