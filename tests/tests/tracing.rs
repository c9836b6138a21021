//! Traces end to end: the real `kiln` binary exports the spans of real HTTP and
//! gRPC requests to a real OTLP/gRPC receiver (`kiln_tests::otlp`); Triton's trace
//! extension over REST and gRPC changes what is sampled.

// Helpers outside the test functions unwrap too: a failed step fails the test.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use kiln_server::grpc::proto::{
    model_infer_request::InferInputTensor, trace_setting_request, InferTensorContents,
    ModelInferRequest, TraceSettingRequest,
};
use kiln_tests::otlp::{OtlpReceiver, Received};
use kiln_tests::{GrpcClient, Kiln};
use serde_json::{json, Value};

/// The caller's trace the HTTP request joins, and its span.
const HTTP_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const HTTP_PARENT: &str = "00f067aa0ba902b7";
const GRPC_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const GRPC_PARENT: &str = "b7ad6b7169203331";
const FAILED_TRACE: &str = "5ab1a3b2c3d4e5f60718293a4b5c6d7e";
const OFF_TRACE: &str = "6c1d2e3f405162738495a6b7c8d9e0f1";
const MARKER_TRACE: &str = "7d2e3f405162738495a6b7c8d9e0f1a2";

/// Exports every 50 ms, so the test need not wait for the default 5 s.
const ENV: &[(&str, &str)] = &[
    ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ("OTEL_SERVICE_NAME", "kiln-under-test"),
    (
        "OTEL_RESOURCE_ATTRIBUTES",
        "deployment.environment=tracing-test",
    ),
];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn traceparent(trace: &str, parent: &str) -> String {
    format!("00-{trace}-{parent}-01")
}

async fn infer_http(kiln: &Kiln, model: &str, input: &str, headers: &[(&str, String)]) -> u16 {
    let mut request = reqwest::Client::new()
        .post(format!("{}/v2/models/{model}/infer", kiln.url))
        .json(&json!({"inputs": [{"name": input, "datatype": "UINT32", "shape": [1, 3], "data": [1, 2, 3]}]}));
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    request.send().await.unwrap().status().as_u16()
}

async fn infer_grpc(kiln: &Kiln, traceparent: Option<String>) {
    let mut client = GrpcClient::connect(&kiln.grpc_url).await.unwrap().raw();
    let mut request = tonic::Request::new(ModelInferRequest {
        model_name: "echo".into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "UINT32".into(),
            shape: vec![1, 3],
            parameters: HashMap::new(),
            contents: Some(InferTensorContents {
                uint_contents: vec![4, 5, 6],
                ..Default::default()
            }),
        }],
        ..Default::default()
    });
    if let Some(tp) = traceparent {
        request
            .metadata_mut()
            .insert("traceparent", tp.parse().unwrap());
        request
            .metadata_mut()
            .insert("tracestate", "kiln=test".parse().unwrap());
    }
    client.model_infer(request).await.unwrap();
}

fn named<'a>(spans: &'a [Received], trace: &str, name: &str) -> Vec<&'a Received> {
    spans
        .iter()
        .filter(|s| hex(&s.span.trace_id) == trace && s.span.name == name)
        .collect()
}

/// The request span of `trace` and its five children, checked; returns the
/// request span's id.
fn check_request_trace(spans: &[Received], trace: &str, parent: &str, model: &str) -> Vec<u8> {
    let infer = named(spans, trace, "infer");
    assert_eq!(
        infer.len(),
        1,
        "one request span in trace {trace}: {spans:#?}"
    );
    let infer = infer[0];
    assert_eq!(
        hex(&infer.span.parent_span_id),
        parent,
        "joins the caller's span"
    );
    assert_eq!(infer.span.kind, 2, "server kind");
    assert_eq!(infer.attr("kiln.model").as_deref(), Some(model));
    assert_eq!(infer.attr("kiln.model.version").as_deref(), Some("1"));
    assert_eq!(infer.attr("kiln.outcome").as_deref(), Some("ok"));
    assert_eq!(infer.attr("kiln.request.bytes").as_deref(), Some("12"));
    assert_eq!(infer.attr("kiln.response.bytes").as_deref(), Some("12"));
    assert_eq!(infer.resource["service.name"], "kiln-under-test");
    assert_eq!(infer.resource["deployment.environment"], "tracing-test");
    let (start, end) = (
        infer.span.start_time_unix_nano,
        infer.span.end_time_unix_nano,
    );
    for child in [
        "receive and decode",
        "queue",
        "batch formation",
        "worker run",
        "encode and respond",
    ] {
        let found = named(spans, trace, child);
        assert_eq!(found.len(), 1, "`{child}` in trace {trace}: {spans:#?}");
        let span = &found[0].span;
        assert_eq!(
            span.parent_span_id, infer.span.span_id,
            "`{child}` is the request's child"
        );
        assert!(
            span.start_time_unix_nano >= start && span.end_time_unix_nano <= end,
            "`{child}` lies within the request"
        );
    }
    infer.span.span_id.clone()
}

/// The batch span that links to the request span `id` of `trace`.
fn batch_of<'a>(spans: &'a [Received], trace: &str, id: &[u8]) -> &'a Received {
    let batch = spans
        .iter()
        .find(|s| {
            s.span.name == "batch"
                && s.span
                    .links
                    .iter()
                    .any(|l| hex(&l.trace_id) == trace && l.span_id == id)
        })
        .unwrap_or_else(|| panic!("no batch span links to trace {trace}: {spans:#?}"));
    assert_ne!(hex(&batch.span.trace_id), trace, "a batch is its own trace");
    assert!(
        batch.span.parent_span_id.is_empty(),
        "a batch has no parent"
    );
    batch
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_of_http_and_grpc_requests_reach_the_otlp_receiver() {
    let receiver = OtlpReceiver::start().await;
    let kiln = Kiln::start_with_env(
        &[
            "--load",
            "echo:batch_size=8",
            "--load",
            "faulty",
            "--trace-otlp-endpoint",
            &receiver.url,
            "--trace-rate",
            "1",
            // Verbose: a line for each request answered with an error.
            "--log-level",
            "debug",
        ],
        ENV,
    );
    let http = [("traceparent", traceparent(HTTP_TRACE, HTTP_PARENT))];
    assert_eq!(infer_http(&kiln, "echo", "INPUT0", &http).await, 200);
    infer_grpc(&kiln, Some(traceparent(GRPC_TRACE, GRPC_PARENT))).await;
    // A request that fails: its span says why.
    assert_eq!(infer_http(&kiln, "echo", "NOPE", &[]).await, 400);
    // A batch that fails (faulty's -2): its span, and the log line, say so.
    let failing = reqwest::Client::new()
        .post(format!("{}/v2/models/faulty/infer", kiln.url))
        .header("traceparent", traceparent(FAILED_TRACE, HTTP_PARENT))
        .json(&json!({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1], "data": [-2]}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(failing.status(), 500);
    let log = kiln.log_with(&format!("trace_id {FAILED_TRACE}"));
    assert!(log.contains(&format!("(trace_id {FAILED_TRACE})")), "{log}");
    // The failed request's own line carries its trace id beside its request id.
    let log = kiln.log_with(&format!("trace_id={FAILED_TRACE}"));
    let line = log
        .lines()
        .find(|l| l.contains(&format!("trace_id={FAILED_TRACE}")))
        .unwrap_or_else(|| panic!("no request line with the trace id: {log}"));
    assert!(
        line.contains("request failed") && line.contains("request_id="),
        "{line}"
    );
    let spans = receiver
        .wait_for(Duration::from_secs(20), |spans| {
            spans.iter().filter(|s| s.span.name == "batch").count() >= 3
                && spans.iter().filter(|s| s.span.name == "infer").count() >= 4
        })
        .await;
    for (trace, parent) in [(HTTP_TRACE, HTTP_PARENT), (GRPC_TRACE, GRPC_PARENT)] {
        let id = check_request_trace(&spans, trace, parent, "echo");
        let batch = batch_of(&spans, trace, &id);
        assert_eq!(batch.attr("kiln.model").as_deref(), Some("echo"));
        assert_eq!(batch.attr("kiln.batch.size").as_deref(), Some("1"));
        assert_eq!(batch.attr("kiln.outcome").as_deref(), Some("ok"));
        // The request's worker-side spans link back to their batch.
        let run = named(&spans, trace, "worker run")[0];
        assert!(run
            .span
            .links
            .iter()
            .any(|l| l.span_id == batch.span.span_id));
    }
    let infer = &named(&spans, FAILED_TRACE, "infer")[0];
    assert_eq!(infer.attr("kiln.outcome").as_deref(), Some("error"));
    let batch = batch_of(&spans, FAILED_TRACE, &infer.span.span_id);
    assert_eq!(batch.attr("kiln.outcome").as_deref(), Some("error"));
    assert!(batch.attr("error.message").is_some(), "{batch:#?}");
    assert_eq!(named(&spans, FAILED_TRACE, "queue").len(), 1);
    assert!(
        named(&spans, FAILED_TRACE, "worker run").is_empty(),
        "no run to time"
    );
    // The worker's event (kiln_worker_sdk::trace::event) on the failed batch's span.
    let event = batch
        .span
        .events
        .iter()
        .find(|e| e.name == "failing on purpose")
        .unwrap_or_else(|| panic!("no worker event: {batch:#?}"));
    assert_eq!(
        kiln_tests::otlp::attributes(&event.attributes)["worker.value"],
        "-2"
    );
    let failed: Vec<_> = spans
        .iter()
        .filter(|s| s.span.name == "infer" && s.attr("kiln.outcome").as_deref() == Some("error"))
        .filter(|s| hex(&s.span.trace_id) != FAILED_TRACE)
        .filter(|s| s.attr("error.message").is_some_and(|e| e.contains("NOPE")))
        .collect();
    assert_eq!(failed.len(), 1, "{spans:#?}");
    let error = failed[0].attr("error.message").unwrap();
    assert!(error.contains("NOPE"), "{error}");
    assert!(
        failed[0].span.parent_span_id.is_empty(),
        "no caller: a trace of its own"
    );
    assert_eq!(
        failed[0].span.status.as_ref().unwrap().code,
        2,
        "status error"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_http_receiver() {
    let receiver = OtlpReceiver::start_http().await;
    // The protocol named as OTEL_EXPORTER_OTLP_PROTOCOL names it; the URL has no
    // path, so /v1/traces is added.
    let env = [ENV, &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]].concat();
    let kiln = Kiln::start_with_env(
        &[
            "--load",
            "echo",
            "--trace-otlp-endpoint",
            &receiver.url,
            "--trace-rate",
            "1",
        ],
        &env,
    );
    let http = [("traceparent", traceparent(HTTP_TRACE, HTTP_PARENT))];
    assert_eq!(infer_http(&kiln, "echo", "INPUT0", &http).await, 200);
    let spans = receiver
        .wait_for(Duration::from_secs(20), |spans| {
            spans.iter().any(|s| s.span.name == "batch")
                && !named(spans, HTTP_TRACE, "infer").is_empty()
        })
        .await;
    let id = check_request_trace(&spans, HTTP_TRACE, HTTP_PARENT, "echo");
    batch_of(&spans, HTTP_TRACE, &id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_exported_while_sampling_is_off_and_the_trace_extension_turns_it_on() {
    let receiver = OtlpReceiver::start().await;
    // An exporter, but Triton's default level OFF: nothing is traced.
    let kiln = Kiln::start_with_env(
        &["--load", "echo", "--trace-otlp-endpoint", &receiver.url],
        ENV,
    );
    let off = [("traceparent", traceparent(OFF_TRACE, HTTP_PARENT))];
    for _ in 0..20 {
        assert_eq!(infer_http(&kiln, "echo", "INPUT0", &off).await, 200);
        infer_grpc(&kiln, None).await;
    }
    // Whether any of those was exported is checked at the end, once a last traced
    // request's spans arrived (the exporter sends spans in the order they end).
    let http = [("traceparent", traceparent(HTTP_TRACE, HTTP_PARENT))];

    // Every 4th request of `echo`, three traces in all, through the extension.
    let settings: Value = reqwest::Client::new()
        .post(format!("{}/v2/models/echo/trace/setting", kiln.url))
        .json(&json!({"trace_level": ["TIMESTAMPS"], "trace_rate": "4", "trace_count": "3"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(settings["trace_level"], json!(["TIMESTAMPS"]));
    assert_eq!(settings["trace_rate"], "4");
    for _ in 0..20 {
        assert_eq!(infer_http(&kiln, "echo", "INPUT0", &http).await, 200);
    }
    let settings: Value = reqwest::get(format!("{}/v2/models/echo/trace/setting", kiln.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(settings["trace_count"], "0", "{settings}");
    // One last traced request: once its spans are in, every span ended before it
    // (all of the requests above answered) has been exported too.
    let marked: Value = reqwest::Client::new()
        .post(format!("{}/v2/models/echo/trace/setting", kiln.url))
        .json(&json!({"trace_rate": "1", "trace_count": "1"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(marked["trace_count"], "1", "{marked}");
    let marker = [("traceparent", traceparent(MARKER_TRACE, HTTP_PARENT))];
    assert_eq!(infer_http(&kiln, "echo", "INPUT0", &marker).await, 200);
    let spans = receiver
        .wait_for(Duration::from_secs(20), |spans| {
            !named(spans, MARKER_TRACE, "infer").is_empty()
        })
        .await;
    assert_eq!(named(&spans, MARKER_TRACE, "infer").len(), 1, "{spans:#?}");
    let infers = named(&spans, HTTP_TRACE, "infer");
    assert_eq!(infers.len(), 3, "trace_count 3 of 20 at rate 4: {spans:#?}");
    // Nothing of the requests made while tracing was off.
    assert_eq!(
        spans.iter().filter(|s| s.span.name == "infer").count(),
        4,
        "{spans:#?}"
    );
    assert!(named(&spans, OFF_TRACE, "infer").is_empty(), "{spans:#?}");
    // The server's own settings were not changed.
    let server: Value = reqwest::get(format!("{}/v2/trace/setting", kiln.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(server["trace_level"], json!(["OFF"]));
    assert_eq!(server["trace_mode"], "opentelemetry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_settings_over_rest_and_grpc_refuse_files_and_bad_values() {
    let kiln = Kiln::start(&["--load", "echo", "--trace-rate", "100"]);
    let http = reqwest::Client::new();
    let post =
        |path: &str, body: Value| http.post(format!("{}{path}", kiln.url)).json(&body).send();
    let got: Value = reqwest::get(format!("{}/v2/trace/setting", kiln.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        got,
        json!({"trace_level": ["TIMESTAMPS"], "trace_rate": "100", "trace_count": "-1",
               "log_frequency": "0", "trace_file": "", "trace_mode": "opentelemetry"})
    );
    for (body, needle) in [
        (
            json!({"trace_file": "/tmp/x.json"}),
            "cannot be set by a request",
        ),
        (json!({"trace_rate": "often"}), "trace_rate"),
        (json!({"trace_level": ["LOUD"]}), "trace_level"),
        (json!({"trace_count": "-5"}), "trace_count"),
        (json!({"colour": "red"}), "unknown trace setting"),
    ] {
        let response = post("/v2/trace/setting", body.clone()).await.unwrap();
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert!(error["error"].as_str().unwrap().contains(needle), "{error}");
    }
    let missing = post("/v2/models/nope/trace/setting", json!({"trace_rate": "1"}))
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    // A model's setting, then cleared with null: it follows the server's again.
    let set: Value = post("/v2/models/echo/trace/setting", json!({"trace_rate": "7"}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(set["trace_rate"], "7");
    let cleared: Value = post("/v2/models/echo/trace/setting", json!({"trace_rate": null}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cleared["trace_rate"], "100");

    // gRPC: the same settings, each a list of strings.
    let mut grpc = GrpcClient::connect(&kiln.grpc_url).await.unwrap().raw();
    let value = |v: &[&str]| trace_setting_request::SettingValue {
        value: v.iter().map(|s| s.to_string()).collect(),
    };
    let response = grpc
        .trace_setting(TraceSettingRequest {
            settings: HashMap::from([("trace_rate".to_string(), value(&["3"]))]),
            model_name: "echo".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.settings["trace_rate"].value, ["3"]);
    assert_eq!(response.settings["trace_level"].value, ["TIMESTAMPS"]);
    let server = grpc
        .trace_setting(TraceSettingRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(server.settings["trace_rate"].value, ["100"]);
    let refused = grpc
        .trace_setting(TraceSettingRequest {
            settings: HashMap::from([("trace_file".to_string(), value(&["/etc/passwd"]))]),
            model_name: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    let unknown = grpc
        .trace_setting(TraceSettingRequest {
            settings: HashMap::new(),
            model_name: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_category_can_be_restricted() {
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        "--http-restricted-api",
        "trace:admin-key=s3cret",
    ]);
    let url = format!("{}/v2/models/echo/trace/setting", kiln.url);
    let refused = reqwest::get(&url).await.unwrap();
    assert_eq!(refused.status(), 403);
    let allowed = reqwest::Client::new()
        .get(&url)
        .header("admin-key", "s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status(), 200);
    let server = reqwest::get(format!("{}/v2/trace/setting", kiln.url))
        .await
        .unwrap();
    assert_eq!(server.status(), 403);
    // Inference is not restricted.
    assert_eq!(infer_http(&kiln, "echo", "INPUT0", &[]).await, 200);
}
