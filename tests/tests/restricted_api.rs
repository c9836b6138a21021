//! Triton's restricted APIs (`--http-restricted-api`, `--grpc-restricted-protocol`)
//! with the real binary: each restricted category refuses a request without its
//! header, or with a wrong value, with Triton's answer (HTTP 403, gRPC
//! UNAVAILABLE), serves one with it, and leaves the other categories open; flags
//! Triton refuses stop kiln at start.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_server::grpc::proto;
use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;

/// A model repository of one echo model, so the repository APIs have one.
fn repository() -> TempRepository {
    TempRepository::new(&[("echo-r", "worker = \"echo\"\n", &[1])])
}
use serde_json::{json, Value};
use tonic::metadata::MetadataValue;
use tonic::Code;

/// An echo request body for `model`.
fn infer_body() -> String {
    json!({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "UINT32", "data": [1, 2]}]})
        .to_string()
}

/// Sends `method path` with `body` and, if given, the header; returns the status
/// and the body.
async fn call(
    url: &str,
    (method, path, body): (&str, &str, &str),
    header: Option<(&str, &str)>,
) -> (u16, String) {
    let client = reqwest::Client::new();
    let url = format!("{url}{path}");
    let mut request = match method {
        "GET" => client.get(url),
        _ => client.post(url).body(body.to_owned()),
    };
    if let Some((name, value)) = header {
        request = request.header(name, value);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_restricted_categories_need_their_header() {
    let repo = repository();
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load",
        "echo",
        "--http-restricted-api",
        "model-repository,shared-memory,logging:admin-key=admin-value",
        "--http-restricted-api",
        "inference:infer-key=infer-value",
        "--http-restricted-api",
        "health,metadata,model-config,statistics:ops-key=ops=value",
    ]);
    let infer = infer_body();
    // (category's header, request, status with the header)
    type Case<'a> = ((&'a str, &'a str), (&'a str, &'a str, &'a str), u16);
    let cases: Vec<Case> = vec![
        (
            ("admin-key", "admin-value"),
            ("POST", "/v2/workers/echo/load", r#"{"batch_size": 2}"#),
            200,
        ),
        (
            ("admin-key", "admin-value"),
            ("POST", "/v2/workers/echo-0/unload", ""),
            200,
        ),
        (
            ("admin-key", "admin-value"),
            ("POST", "/v2/repository/index", "{}"),
            200,
        ),
        (
            ("admin-key", "admin-value"),
            ("POST", "/v2/repository/models/nope/unload", "{}"),
            404,
        ),
        (
            ("admin-key", "admin-value"),
            ("GET", "/v2/systemsharedmemory/status", ""),
            200,
        ),
        (
            ("admin-key", "admin-value"),
            ("POST", "/v2/systemsharedmemory/unregister", ""),
            200,
        ),
        (
            ("admin-key", "admin-value"),
            ("GET", "/v2/logging", ""),
            200,
        ),
        (
            ("admin-key", "admin-value"),
            ("POST", "/v2/logging", r#"{"log_verbose_level": 1}"#),
            200,
        ),
        (
            ("infer-key", "infer-value"),
            ("POST", "/v2/models/echo/infer", &infer),
            200,
        ),
        (
            ("infer-key", "infer-value"),
            ("POST", "/v2/models/echo/versions/1/infer", &infer),
            200,
        ),
        (
            ("ops-key", "ops=value"),
            ("GET", "/v2/health/live", ""),
            200,
        ),
        (
            ("ops-key", "ops=value"),
            ("GET", "/v2/models/echo/ready", ""),
            200,
        ),
        (("ops-key", "ops=value"), ("GET", "/v2", ""), 200),
        (("ops-key", "ops=value"), ("GET", "/v2/models", ""), 200),
        (
            ("ops-key", "ops=value"),
            ("GET", "/v2/models/echo", ""),
            200,
        ),
        (
            ("ops-key", "ops=value"),
            ("GET", "/v2/models/echo/config", ""),
            200,
        ),
        (
            ("ops-key", "ops=value"),
            ("GET", "/v2/models/stats", ""),
            200,
        ),
        (
            ("ops-key", "ops=value"),
            ("GET", "/v2/models/echo/stats", ""),
            200,
        ),
        (("ops-key", "ops=value"), ("GET", "/metrics", ""), 200),
    ];
    for ((name, value), request, status) in cases {
        let refusal =
            json!({"error": format!("This API is restricted, expecting header '{name}'")});
        for header in [None, Some((name, "wrong")), Some(("other-key", value))] {
            let (got, body) = call(&kiln.url, request, header).await;
            assert_eq!(got, 403, "{request:?} {header:?}: {body}");
            let body: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(body, refusal, "{request:?}");
        }
        let (got, body) = call(&kiln.url, request, Some((name, value))).await;
        assert_eq!(got, status, "{request:?} with its header: {body}");
        if request.0 != "GET" {
            continue;
        }
        // Header names are case-insensitive; values are not.
        let upper = name.to_ascii_uppercase();
        assert_eq!(
            call(&kiln.url, request, Some((&upper, value))).await.0,
            status
        );
        let upper = value.to_ascii_uppercase();
        assert_eq!(call(&kiln.url, request, Some((name, &upper))).await.0, 403);
    }
    // A restricted path with the wrong method is refused first, as Triton does;
    // a path that is no route stays 404.
    let (got, _) = call(&kiln.url, ("GET", "/v2/workers/echo/load", ""), None).await;
    assert_eq!(got, 403);
    let (got, _) = call(&kiln.url, ("GET", "/v2/nothing", ""), None).await;
    assert_eq!(got, 404);
    // The refused loads and unloads changed nothing: echo-0 came and went with
    // the allowed ones.
    let (_, models) = call(
        &kiln.url,
        ("GET", "/v2/models", ""),
        Some(("ops-key", "ops=value")),
    )
    .await;
    let models: Value = serde_json::from_str(&models).unwrap();
    let names: Vec<_> = models["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].clone())
        .collect();
    assert_eq!(names, [json!("echo")], "{models}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_unrestricted_categories_stay_open() {
    let repo = repository();
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load",
        "echo",
        "--http-restricted-api",
        "model-repository:admin-key=admin-value",
    ]);
    let infer = infer_body();
    for request in [
        ("GET", "/v2/health/ready", ""),
        ("GET", "/v2/models/echo", ""),
        ("GET", "/v2/models/echo/config", ""),
        ("GET", "/v2/models/stats", ""),
        ("GET", "/metrics", ""),
        ("GET", "/v2/systemsharedmemory/status", ""),
        ("POST", "/v2/models/echo/infer", infer.as_str()),
    ] {
        let (got, body) = call(&kiln.url, request, None).await;
        assert_eq!(got, 200, "{request:?}: {body}");
    }
    let load = ("POST", "/v2/workers/echo/load", "{}");
    assert_eq!(call(&kiln.url, load, None).await.0, 403);
    assert_eq!(
        call(&kiln.url, load, Some(("admin-key", "admin-value")))
            .await
            .0,
        200
    );
    // The gRPC side is not restricted by the HTTP flag.
    let grpc = kiln.grpc().await;
    let mut raw = grpc.raw();
    let request = proto::RepositoryIndexRequest::default();
    raw.repository_index(request).await.unwrap();
}

/// `request` with `header` (already prefixed) set to `value`, if given.
fn with_header<T>(request: T, header: Option<(&'static str, &'static str)>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(request);
    if let Some((name, value)) = header {
        request
            .metadata_mut()
            .insert(name, MetadataValue::from_static(value));
    }
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_restricted_protocols_need_their_header() {
    let repo = repository();
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load",
        "echo",
        "--grpc-restricted-protocol",
        "model-repository,shared-memory,logging:admin-key=admin-value",
        // Also accepted under the name the HTTP flag has.
        "--grpc-restricted-api",
        "inference:infer-key=infer-value",
    ]);
    let mut raw = kiln.grpc().await.raw();
    let admin = "triton-grpc-protocol-admin-key";
    let infer_key = "triton-grpc-protocol-infer-key";
    let infer_request = kiln_server::grpc::convert::encode_request(&kiln_client::InferRequest {
        model: "echo".into(),
        inputs: vec![kiln_client::InputTensor::from_slice(
            "INPUT0",
            kiln_client::DataType::Uint32,
            &[1, 2],
            &[1u32, 2],
        )],
        ..Default::default()
    });
    let refusal = |name: &str| format!("This protocol is restricted, expecting header '{name}'");
    for (name, value) in [(admin, "admin-value"), (infer_key, "infer-value")] {
        for header in [
            None,
            Some((name, "wrong")),
            Some(("triton-grpc-protocol-other", value)),
        ] {
            let results: Vec<Result<(), tonic::Status>> = if name == admin {
                vec![
                    raw.repository_index(with_header(
                        proto::RepositoryIndexRequest::default(),
                        header,
                    ))
                    .await
                    .map(drop),
                    raw.repository_model_unload(with_header(
                        proto::RepositoryModelUnloadRequest {
                            model_name: "echo".into(),
                            ..Default::default()
                        },
                        header,
                    ))
                    .await
                    .map(drop),
                    raw.system_shared_memory_status(with_header(
                        proto::SystemSharedMemoryStatusRequest::default(),
                        header,
                    ))
                    .await
                    .map(drop),
                    raw.log_settings(with_header(proto::LogSettingsRequest::default(), header))
                        .await
                        .map(drop),
                ]
            } else {
                let stream = tokio_stream::iter([infer_request.clone()]);
                vec![
                    raw.model_infer(with_header(infer_request.clone(), header))
                        .await
                        .map(drop),
                    match raw.model_stream_infer(with_header(stream, header)).await {
                        Err(e) => Err(e),
                        Ok(answers) => answers.into_inner().message().await.map(drop),
                    },
                ]
            };
            for result in results {
                let status = result.expect_err("refused");
                assert_eq!(status.code(), Code::Unavailable, "{header:?}: {status:?}");
                assert_eq!(status.message(), refusal(name));
            }
        }
    }
    // With the headers every call is served.
    let admin_header = Some((admin, "admin-value"));
    raw.repository_index(with_header(
        proto::RepositoryIndexRequest::default(),
        admin_header,
    ))
    .await
    .unwrap();
    raw.system_shared_memory_status(with_header(
        proto::SystemSharedMemoryStatusRequest::default(),
        admin_header,
    ))
    .await
    .unwrap();
    raw.log_settings(with_header(
        proto::LogSettingsRequest::default(),
        admin_header,
    ))
    .await
    .unwrap();
    let infer_header = Some((infer_key, "infer-value"));
    let answer = raw
        .model_infer(with_header(infer_request.clone(), infer_header))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.raw_output_contents[0].len(), 8);
    let stream = tokio_stream::iter([infer_request.clone()]);
    let mut answers = raw
        .model_stream_infer(with_header(stream, infer_header))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    assert_eq!(answer.error_message, "");
    // The unload last: echo is gone after it.
    raw.repository_model_unload(with_header(
        proto::RepositoryModelUnloadRequest {
            model_name: "echo".into(),
            ..Default::default()
        },
        admin_header,
    ))
    .await
    .unwrap();
    // Unrestricted protocols need no header.
    let live = raw
        .server_live(proto::ServerLiveRequest::default())
        .await
        .unwrap();
    assert!(live.into_inner().live);
    raw.server_metadata(proto::ServerMetadataRequest::default())
        .await
        .unwrap();
    raw.model_statistics(proto::ModelStatisticsRequest::default())
        .await
        .unwrap();
    // And the HTTP side is not restricted by the gRPC flag.
    let (got, _) = call(&kiln.url, ("POST", "/v2/repository/index", "{}"), None).await;
    assert_eq!(got, 200);
}

/// Runs `kiln serve` with `args`, which must stop it; returns its exit success
/// and stderr.
fn serve(args: &[&str]) -> (bool, String) {
    let (code, stderr) = kiln_tests::serve_until_exit(args);
    (code == Some(0), stderr)
}

#[test]
fn bad_restriction_flags_stop_the_server_with_tritons_message() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--http-restricted-api", "model-reposit,health:k1=v1"],
            "unknown restricted api 'model-reposit'",
        ),
        (
            &[
                "--http-restricted-api",
                "model-repository,health:k1=v1",
                "--http-restricted-api",
                "metadata,health:k2=v2",
            ],
            "restricted api 'health' can not be specified in multiple config groups",
        ),
        (
            &[
                "--grpc-restricted-protocol",
                "model-repository,health:k1=v1",
                "--grpc-restricted-protocol",
                "metadata,health:k2=v2",
            ],
            "restricted protocol 'health' can not be specified in multiple config groups",
        ),
        (
            &["--grpc-restricted-protocol", "inference"],
            "--grpc-restricted-protocol option format is '<API_1>,<API_2>,...:<key>=<value>'. Got inference",
        ),
        (
            &["--http-restricted-api", "inference:key="],
            "--http-restricted-api option format is",
        ),
    ];
    for (args, message) in cases {
        let (ok, stderr) = serve(args);
        assert!(!ok, "{args:?} started");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

/// NVIDIA's tritonclient passes the operator's header with `headers=`
/// (`tests/tritonclient/test_restricted.py`).
#[test]
fn tritonclient_passes_the_header() {
    let repo = TempRepository::new(&[("echo-repo", "worker = \"echo\"\n", &[1])]);
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--http-restricted-api",
        "model-repository:admin-key=admin-value",
        "--grpc-restricted-protocol",
        "model-repository:admin-key=admin-value",
    ]);
    let stdout = kiln_tests::pytest::run_pytest(
        &kiln,
        "tests/tritonclient/test_restricted.py",
        &[("KILN_RESTRICTED", "1".as_ref())],
    );
    assert!(stdout.contains("2 passed"), "{stdout}");
}
