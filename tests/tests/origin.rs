//! The one browser policy (docs/security.md, "Browsers"; `server/src/http/origin.rs`)
//! against the real binary: requests carrying the `Origin` a hostile page's
//! browser would send — "simple" cross-site POSTs (`text/plain`, no preflight) to
//! the logging and jobs routes, a WebSocket upgrade — are refused 403 before
//! anything is applied; kiln's own origin and `--cors-allow-origin` work, the
//! latter with CORS headers and preflights; clients that send no `Origin` are
//! unaffected (every other test in the suite is one).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kiln_tests::jobs::{echo_job, jobs_arg};
use kiln_tests::{http_raw, Kiln};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const EVIL: &str = "https://evil.example";

fn host(kiln: &Kiln) -> &str {
    kiln.url.trim_start_matches("http://")
}

/// A POST as a browser sends a cross-site form or `fetch(..., {mode: "no-cors"})`:
/// `text/plain`, with `origin`.
async fn post(kiln: &Kiln, path: &str, origin: Option<&str>, body: &str) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("{}{path}", kiln.url))
        .header("content-type", "text/plain")
        .body(body.to_owned());
    if let Some(origin) = origin {
        request = request.header("origin", origin);
    }
    request.send().await.unwrap()
}

async fn log_settings(kiln: &Kiln) -> Value {
    reqwest::get(format!("{}/v2/logging", kiln.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The status line and head of a WebSocket upgrade of `echo`'s stream from `origin`.
async fn upgrade(kiln: &Kiln, origin: &str) -> String {
    let mut socket = tokio::net::TcpStream::connect(host(kiln)).await.unwrap();
    let head = format!(
        "GET /v2/models/echo/stream HTTP/1.1\r\nHost: {}\r\nOrigin: {origin}\r\n\
         Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        host(kiln)
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(30), socket.read(&mut chunk))
            .await
            .expect("an answer in time")
            .unwrap();
        assert!(n > 0, "closed without an answer");
        answer.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_site_requests_are_refused_before_they_act() {
    let dir = std::env::temp_dir().join(format!("kiln-origin-{}", std::process::id()));
    let kiln = Kiln::start(&["--load", "echo", &jobs_arg(&dir)]);
    let before = log_settings(&kiln).await;

    // A page on evil.example changing the server's logging.
    let r = post(
        &kiln,
        "/v2/logging",
        Some(EVIL),
        r#"{"log_verbose_level": 1}"#,
    )
    .await;
    assert_eq!(r.status(), 403);
    assert!(r.headers().get("access-control-allow-origin").is_none());
    let error: Value = r.json().await.unwrap();
    assert!(
        error["error"].as_str().unwrap().contains("evil.example"),
        "{error}"
    );
    assert_eq!(log_settings(&kiln).await, before, "nothing was applied");

    // ... storing jobs.
    let job = echo_job(1).to_string();
    let r = post(&kiln, "/v2/models/echo/jobs", Some(EVIL), &job).await;
    assert_eq!(r.status(), 403);

    // ... opening a WebSocket (it would stream the media folder).
    let answer = upgrade(&kiln, EVIL).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");

    // ... reading a route through an <img> or <script> tag (no Origin, but the
    // browser says where the request comes from).
    let (status, _) = http_raw(
        &kiln.url,
        &format!(
            "GET /metrics HTTP/1.1\r\nHost: {}\r\nSec-Fetch-Site: cross-site\r\n\
             Sec-Fetch-Mode: no-cors\r\n\r\n",
            host(&kiln)
        ),
        Vec::new(),
    )
    .await;
    assert_eq!(status, 403);

    // The same from kiln's own origin (its page) works: logging, jobs, WebSocket.
    let own = kiln.url.clone();
    let r = post(
        &kiln,
        "/v2/logging",
        Some(&own),
        r#"{"log_verbose_level": 1}"#,
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(log_settings(&kiln).await["log_verbose_level"], 1);
    let r = post(&kiln, "/v2/models/echo/jobs", Some(&own), &job).await;
    assert_eq!(r.status(), 202);
    let answer = upgrade(&kiln, &own).await;
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");

    // And without an Origin (curl, tritonclient): as before.
    let r = post(&kiln, "/v2/logging", None, r#"{"log_verbose_level": 0}"#).await;
    assert_eq!(r.status(), 200);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_origins_get_cors_headers_and_preflights() {
    let app = "https://app.example";
    let kiln = Kiln::start(&["--load", "echo", "--cors-allow-origin", app]);
    let client = reqwest::Client::new();

    // The preflight a browser sends before a JSON POST from the app.
    let preflight = client
        .request(
            reqwest::Method::OPTIONS,
            format!("{}/v2/models/echo/infer", kiln.url),
        )
        .header("origin", app)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "content-type")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 204);
    let h = preflight.headers();
    assert_eq!(h["access-control-allow-origin"], app);
    assert!(h["access-control-allow-methods"]
        .to_str()
        .unwrap()
        .contains("POST"));
    assert_eq!(h["access-control-allow-headers"], "content-type");

    // The request itself.
    let infer = client
        .post(format!("{}/v2/models/echo/infer", kiln.url))
        .header("origin", app)
        .json(&json!({"inputs": [{"name": "INPUT0", "datatype": "UINT32", "shape": [1, 1], "data": [41]}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(infer.status(), 200);
    assert_eq!(infer.headers()["access-control-allow-origin"], app);
    let answer: Value = infer.json().await.unwrap();
    assert_eq!(answer["outputs"][0]["data"], json!([42]));

    // Another origin's preflight and request are still refused.
    let refused = client
        .request(reqwest::Method::OPTIONS, format!("{}/v2/logging", kiln.url))
        .header("origin", EVIL)
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let answer = upgrade(&kiln, EVIL).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    let answer = upgrade(&kiln, app).await;
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
}

/// DNS rebinding: a hostile page whose name now resolves to kiln's address is
/// "same origin" to the browser, so its requests carry its own origin (or none,
/// for a GET) and `Sec-Fetch-Site: same-origin`; only the `Host` shows the name.
/// Refused unless the operator named it with `--allowed-host`; kiln's address and
/// clients that are not browsers are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebound_name_is_refused_to_browsers() {
    let kiln = Kiln::start(&["--load", "echo", "--allowed-host", "kiln.internal"]);
    let port = host(&kiln).rsplit_once(':').unwrap().1.to_owned();
    let get = |name: &str, browser: bool| {
        let mut request = reqwest::Client::new()
            .get(format!("{}/v2/models/echo", kiln.url))
            .header("host", format!("{name}:{port}"));
        if browser {
            request = request.header("sec-fetch-site", "same-origin");
        }
        request.send()
    };
    let rebound = get("rebind.evil.example", true).await.unwrap();
    assert_eq!(rebound.status(), 403);
    let body: Value = rebound.json().await.unwrap();
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("--allowed-host"), "{error}");
    // Its POSTs carry its own origin: refused before anything is applied.
    let before = log_settings(&kiln).await;
    let forged = reqwest::Client::new()
        .post(format!("{}/v2/logging", kiln.url))
        .header("host", format!("rebind.evil.example:{port}"))
        .header("origin", format!("http://rebind.evil.example:{port}"))
        .header("content-type", "text/plain")
        .body(r#"{"log_verbose_level": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403);
    assert_eq!(log_settings(&kiln).await, before);
    assert_eq!(get("kiln.internal", true).await.unwrap().status(), 200);
    assert_eq!(get("localhost", true).await.unwrap().status(), 200);
    assert_eq!(get("127.0.0.1", true).await.unwrap().status(), 200);
    // Not a browser: any name, as before (a proxy, tritonclient, curl).
    assert_eq!(
        get("rebind.evil.example", false).await.unwrap().status(),
        200
    );
}
