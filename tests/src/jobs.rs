//! Helpers for the job tests: requests for the echo model, submitting, reading
//! jobs and pages back, and waiting on the store's state through the API.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

/// A fresh, empty folder for a job store, unique to this test process.
pub fn store_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-test-jobs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The `--jobs` argument for `dir`.
pub fn jobs_arg(dir: &std::path::Path) -> String {
    format!("--jobs=file:{}", dir.display())
}

/// An echo request carrying `value` (the echo model answers `value + 1`), with
/// id `j{value}`.
pub fn echo_job(value: u32) -> Value {
    json!({
        "id": format!("j{value}"),
        "inputs": [{"name": "INPUT0", "datatype": "UINT32", "shape": [1, 1], "data": [value]}]
    })
}

/// The requests as JSON lines.
pub fn json_lines(requests: &[Value]) -> String {
    requests.iter().map(|r| format!("{r}\n")).collect()
}

/// POSTs `body` to `/v2/models/{model}/jobs{query}`; the status and the JSON answer.
pub async fn submit(url: &str, model: &str, query: &str, body: String) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("{url}/v2/models/{model}/jobs{query}"))
        .body(body)
        .send()
        .await
        .expect("submit");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON answer"))
}

/// POSTs and expects 202: the ids.
pub async fn submit_ok(url: &str, model: &str, body: String) -> Vec<String> {
    let (status, answer) = submit(url, model, "", body).await;
    assert_eq!(status, 202, "{answer}");
    answer["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|id| id.as_str().expect("an id").to_string())
        .collect()
}

/// `GET /v2/jobs/{id}`: status and answer.
pub async fn get(url: &str, id: &str) -> (u16, Value) {
    let response = reqwest::get(format!("{url}/v2/jobs/{id}"))
        .await
        .expect("get job");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON answer"))
}

/// The flag that opens the job listing (`jobs-admin`) to [`ADMIN_HEADER`].
pub const ADMIN_ARG: &str = "--http-restricted-api=jobs-admin:jobs-admin-key=test";
/// The header [`list`] sends, with the value `test`.
pub const ADMIN_HEADER: &str = "jobs-admin-key";

/// `GET /v2/jobs?{query}` as the operator ([`ADMIN_ARG`]): the answer (expects 200).
pub async fn list(url: &str, query: &str) -> Value {
    let response = reqwest::Client::new()
        .get(format!("{url}/v2/jobs?{query}"))
        .header(ADMIN_HEADER, "test")
        .send()
        .await
        .expect("list jobs");
    assert_eq!(response.status().as_u16(), 200);
    response.json().await.expect("a JSON answer")
}

/// Every job, through pages of `limit`.
pub async fn list_all(url: &str, filter: &str, limit: usize) -> Vec<Value> {
    let mut all = Vec::new();
    let mut after = String::new();
    loop {
        let page = list(url, &format!("limit={limit}{filter}{after}")).await;
        all.extend(page["jobs"].as_array().expect("jobs").iter().cloned());
        match page["next"].as_str() {
            Some(next) => after = format!("&after={next}"),
            None => return all,
        }
    }
}

/// Waits (up to `within`) until `GET /v2/jobs/{id}` shows a finished state; the job.
pub async fn wait_finished(url: &str, id: &str, within: Duration) -> Value {
    let deadline = std::time::Instant::now() + within;
    loop {
        let (status, job) = get(url, id).await;
        assert_eq!(status, 200, "{job}");
        if matches!(job["state"].as_str(), Some("done" | "failed" | "cancelled")) {
            return job;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "job {id} did not finish: {job}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The echo answer's value in a done job's response.
pub fn echoed(job: &Value) -> u64 {
    job["response"]["outputs"][0]["data"][0]
        .as_u64()
        .unwrap_or_else(|| panic!("no echoed value in {job}"))
}
