//! `/v2/health/live` and `/v2/health/ready` answer the Open Inference Protocol's
//! REST bodies as JSON (`{"live": true}`, `{"ready": true}`): KServe's Python SDK
//! calls `response.json()` on them and failed on kiln's empty 200. Triton's
//! clients look at the status only (`tests/tritonclient`'s `is_server_live`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_tests::Kiln;
use serde_json::{json, Value};

#[tokio::test]
async fn health_routes_answer_json_bodies() {
    let kiln = Kiln::start(&[]);
    for (path, body) in [
        ("/v2/health/live", json!({"live": true})),
        ("/v2/health/ready", json!({"ready": true})),
    ] {
        let r = reqwest::get(format!("{}{path}", kiln.url)).await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(r.headers()["content-type"], "application/json", "{path}");
        assert_eq!(r.json::<Value>().await.unwrap(), body, "{path}");
    }
}
