//! The routes that name a model (`/v2/models/{m}[/versions/{v}][/ready|/config|
//! /stats|/infer]`), which kiln matches by hand rather than with actix-web's
//! router, with the real binary: every one answers its method, in both forms, and
//! 405 to the others; paths that are none of them answer 404; `/v2/models/stats`
//! stays the statistics of every model; a restricted category is checked before
//! the method, as for the routes actix-web matches.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_tests::Kiln;
use serde_json::{json, Value};

/// An echo request body.
fn infer_body() -> String {
    json!({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "UINT32", "data": [1, 2]}]})
        .to_string()
}

/// Sends `method path` (with an echo request body for a POST) and, if given, the
/// header; returns the status and the body as JSON (`null` when empty).
async fn call(url: &str, method: &str, path: &str, header: Option<(&str, &str)>) -> (u16, Value) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = reqwest::Client::new().request(method.clone(), format!("{url}{path}"));
    if method == reqwest::Method::POST {
        request = request.body(infer_body());
    }
    if let Some((name, value)) = header {
        request = request.header(name, value);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let body = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap()
    };
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_routes_answer_their_method_and_only_theirs() {
    let kiln = Kiln::start(&["--load", "echo"]);
    for prefix in ["/v2/models/echo", "/v2/models/echo/versions/1"] {
        for (suffix, method) in [
            ("", "GET"),
            ("/ready", "GET"),
            ("/config", "GET"),
            ("/stats", "GET"),
            ("/infer", "POST"),
        ] {
            let path = format!("{prefix}{suffix}");
            let (status, body) = call(&kiln.url, method, &path, None).await;
            assert_eq!(status, 200, "{method} {path}: {body}");
            for other in ["GET", "POST", "PUT", "DELETE"] {
                if other == method {
                    continue;
                }
                let (status, body) = call(&kiln.url, other, &path, None).await;
                assert_eq!(status, 405, "{other} {path}: {body}");
                let error = format!("{other} is not allowed on {path}");
                assert_eq!(body, json!({ "error": error }));
            }
        }
    }
    // What each answers, briefly.
    let (_, metadata) = call(&kiln.url, "GET", "/v2/models/echo/versions/1", None).await;
    assert_eq!(metadata["name"], "echo");
    let (_, config) = call(&kiln.url, "GET", "/v2/models/echo/config", None).await;
    assert_eq!(config["name"], "echo");
    let (_, stats) = call(&kiln.url, "GET", "/v2/models/echo/stats", None).await;
    assert_eq!(stats["model_stats"][0]["name"], "echo");
    let (_, answer) = call(&kiln.url, "POST", "/v2/models/echo/infer", None).await;
    assert_eq!(answer["outputs"][0]["data"], json!([2, 3]));
    // The statistics of every model, and not a model named `stats`.
    let (status, all) = call(&kiln.url, "GET", "/v2/models/stats", None).await;
    assert_eq!(status, 200);
    assert_eq!(all["model_stats"][0]["name"], "echo", "{all}");
    let (status, _) = call(&kiln.url, "POST", "/v2/models/stats", None).await;
    assert_eq!(status, 405);
    let (status, body) = call(&kiln.url, "GET", "/v2/models/stats/ready", None).await;
    assert_eq!(status, 404, "{body}");
    assert!(body["error"].as_str().unwrap().contains("stats"), "{body}");
    // The name is percent-decoded as the router decodes a path.
    let (status, _) = call(&kiln.url, "POST", "/v2/models/ech%6F/infer", None).await;
    assert_eq!(status, 200);
    // A version the model does not serve, a model kiln does not have.
    for path in ["/v2/models/echo/versions/2/infer", "/v2/models/nope/infer"] {
        let (status, body) = call(&kiln.url, "POST", path, None).await;
        assert_eq!(status, 404, "{path}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_that_name_no_model_route_answer_404() {
    let kiln = Kiln::start(&["--load", "echo"]);
    for path in [
        "/v2/models/",
        "/v2/modelsx/echo/infer",
        "/v2/models//infer",
        "/v2/models/echo/",
        "/v2/models/echo/infer/",
        "/v2/models/echo/infer/x",
        "/v2/models/echo/bogus",
        "/v2/models/echo/Infer",
        "/v2/models/echo/versions",
        "/v2/models/echo/versions/",
        "/v2/models/echo/versions//infer",
        "/v2/models/echo/versions/1/bogus",
    ] {
        for method in ["GET", "POST"] {
            let (status, body) = call(&kiln.url, method, path, None).await;
            assert_eq!(status, 404, "{method} {path}: {body}");
            let error = format!("no route for {method} {path}");
            assert_eq!(body, json!({ "error": error }), "{method} {path}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restricted_model_routes_are_checked_before_the_method() {
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        "--http-restricted-api",
        "inference:infer-key=yes",
        "--http-restricted-api",
        "health,model-config:ops-key=yes",
    ]);
    let refusal =
        |key: &str| json!({"error": format!("This API is restricted, expecting header '{key}'")});
    // (method, path, its category's header)
    let cases = [
        ("POST", "/v2/models/echo/infer", "infer-key"),
        ("POST", "/v2/models/echo/versions/1/infer", "infer-key"),
        ("GET", "/v2/models/echo/ready", "ops-key"),
        ("GET", "/v2/models/echo/versions/1/config", "ops-key"),
    ];
    for (method, path, key) in cases {
        let wrong = if method == "GET" { "POST" } else { "GET" };
        for m in [method, wrong] {
            let (status, body) = call(&kiln.url, m, path, None).await;
            assert_eq!((status, body), (403, refusal(key)), "{m} {path}");
            let (status, body) = call(&kiln.url, m, path, Some((key, "no"))).await;
            assert_eq!((status, body), (403, refusal(key)), "{m} {path}");
        }
        let (status, body) = call(&kiln.url, method, path, Some((key, "yes"))).await;
        assert_eq!(status, 200, "{method} {path}: {body}");
        let (status, _) = call(&kiln.url, wrong, path, Some((key, "yes"))).await;
        assert_eq!(status, 405, "{wrong} {path}");
        // Another category's header does not do.
        let other = if key == "ops-key" {
            "infer-key"
        } else {
            "ops-key"
        };
        let (status, _) = call(&kiln.url, method, path, Some((other, "yes"))).await;
        assert_eq!(status, 403, "{method} {path}");
    }
    // Unrestricted categories stay open; a path that is no route stays 404.
    for path in ["/v2/models/echo", "/v2/models/echo/stats"] {
        let (status, body) = call(&kiln.url, "GET", path, None).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    let (status, _) = call(&kiln.url, "POST", "/v2/models/echo/bogus", None).await;
    assert_eq!(status, 404);
}
