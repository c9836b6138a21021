//! End-to-end over REST: the real `kiln` binary, real plugins, real sockets.

use kiln_client::{ClientError, DataType, InferRequest, InputTensor};
use kiln_tests::{metric, requests_outcome, Kiln};
use serde_json::{json, Value};

fn echo_request(model: &str, id: usize, values: &[u32]) -> InferRequest {
    InferRequest {
        model: model.into(),
        id: Some(format!("req-{id}")),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_metadata_and_startup_load() {
    let log_file = std::env::temp_dir().join(format!("kiln-log-{}.log", std::process::id()));
    let log_arg = log_file.to_str().unwrap().to_owned();
    let kiln = Kiln::start(&[
        "--load",
        "echo:batch_size=8",
        "--load",
        "invert-image",
        "--log-file",
        &log_arg,
    ]);
    let c = &kiln.client;
    assert!(c.is_live().await.unwrap());
    assert!(c.is_ready().await.unwrap());
    let meta = c.server_metadata().await.unwrap();
    assert_eq!(meta["name"], "kiln");
    assert!(meta["extensions"].is_array());
    assert_eq!(c.models().await.unwrap(), vec!["echo", "invert-image"]);
    let echo = c.model_metadata("echo").await.unwrap();
    assert_eq!(
        echo["inputs"][0],
        json!({"name": "INPUT0", "datatype": "UINT32", "shape": [-1, -1]})
    );
    assert_eq!(echo["outputs"][0]["name"], "OUTPUT0");
    assert_eq!(echo["parameters"]["batch_size"], 8);
    let http = reqwest::Client::new();
    for path in [
        "/v2/models/echo/ready",
        "/v2/models/echo/versions/1/ready",
        "/v2/models/echo/versions/1",
    ] {
        let status = http
            .get(format!("{}{path}", kiln.url))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200, "{path}");
    }
    // An image through the worker that does not batch: [H, W, C], no batch dim.
    let pixels: Vec<u8> = (0..24).map(|v| v * 10).collect();
    let response = c
        .infer(&InferRequest {
            model: "invert-image".into(),
            inputs: vec![InputTensor::from_slice(
                "image",
                DataType::Uint8,
                &[2, 4, 3],
                &pixels,
            )],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(response.outputs[0].shape, vec![2, 4, 3]);
    assert_eq!(
        response.outputs[0].values::<u8>(),
        pixels.iter().map(|v| 255 - v).collect::<Vec<_>>()
    );
    // With a log file, the file gets info and the console only warnings and worse.
    let written = std::fs::read_to_string(&log_file).unwrap();
    assert!(written.contains("loaded plugin `echo`"), "{written}");
    assert!(!kiln.log().contains("[info]"), "console: {}", kiln.log());
    let _ = std::fs::remove_file(&log_file);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_parameters_reach_the_worker_per_request() {
    let kiln = Kiln::start(&["--load", "echo:batch_size=64,timeout=20"]);
    let tasks: Vec<_> = (0..64u32)
        .map(|i| {
            let c = kiln.client.clone();
            tokio::spawn(async move {
                let mut request = echo_request("echo", i as usize, &[100, 200]);
                request.parameters = vec![kiln_core::Param {
                    key: "increment".into(),
                    value: kiln_core::ParamValue::Int(i64::from(i)),
                }];
                let r = c.infer(&request).await.unwrap();
                assert_eq!(r.outputs[0].values::<u32>(), vec![100 + i, 200 + i]);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let text = kiln.client.metrics().await.unwrap();
    let batches = metric(&text, "kiln_batch_size_count", &[("model", "echo")]).unwrap();
    assert!(batches < 64.0, "the requests should have shared batches");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_requests_each_get_their_own_answer() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let endpoint = c
        .load("echo", &json!({"batch_size": 32, "timeout": 20}))
        .await
        .unwrap();
    assert_eq!(endpoint, "echo");
    let tasks: Vec<_> = (0..1000usize)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                // Ragged lengths: echo batches requests of different lengths together.
                let values: Vec<u32> = (0..(1 + i % 7) as u32)
                    .map(|k| i as u32 * 100 + k)
                    .collect();
                let response = c.infer(&echo_request("echo", i, &values)).await.unwrap();
                assert_eq!(response.id.as_deref(), Some(format!("req-{i}").as_str()));
                assert_eq!(response.model_name, "echo");
                let want: Vec<u32> = values.iter().map(|v| v + 1).collect();
                assert_eq!(response.outputs[0].values::<u32>(), want, "request {i}");
                assert_eq!(response.outputs[0].shape, vec![1, values.len() as i64]);
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let text = c.metrics().await.unwrap();
    let m = |name: &str, extra: &[(&str, &str)]| {
        let mut labels = vec![("model", "echo")];
        labels.extend_from_slice(extra);
        metric(&text, name, &labels).unwrap_or_else(|| panic!("{name} missing in\n{text}"))
    };
    assert_eq!(m("kiln_requests_total", &[("outcome", "success")]), 1000.0);
    assert_eq!(m("kiln_batch_size_sum", &[]), 1000.0);
    let batches = m("kiln_batch_size_count", &[]);
    let singles = m("kiln_batch_size_bucket", &[("le", "1.0")]);
    assert!(
        batches < 1000.0,
        "every request ran alone: {batches} batches"
    );
    assert!(
        singles < batches,
        "no batch of more than one request formed"
    );
    assert_eq!(m("kiln_pending_requests", &[]), 0.0);
    assert_eq!(m("kiln_buffer_pool_size", &[]), 3.0);
    assert!(m("kiln_queue_duration_seconds_count", &[]) == 1000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_naming_sharing_and_unload() {
    let kiln = Kiln::start(&[]);
    let c = &kiln.client;
    assert_eq!(c.load("echo", &json!({})).await.unwrap(), "echo");
    assert_eq!(
        c.load("echo", &json!({})).await.unwrap(),
        "echo",
        "same parameters, same endpoint"
    );
    assert_eq!(
        c.load("ECHO", &json!({})).await.unwrap(),
        "echo",
        "names are case-insensitive"
    );
    assert_eq!(
        c.load("echo", &json!({"batch_size": 4})).await.unwrap(),
        "echo-0"
    );
    assert_eq!(
        c.load("echo", &json!({"batch_size": 2})).await.unwrap(),
        "echo-1"
    );
    assert_eq!(
        c.load("echo", &json!({"batch_size": 4})).await.unwrap(),
        "echo-0"
    );
    // share=false adds an instance to the group with those parameters.
    assert_eq!(
        c.model_metadata("echo-0").await.unwrap()["parameters"]["instances"],
        1
    );
    assert_eq!(
        c.load("echo", &json!({"batch_size": 4, "share": false}))
            .await
            .unwrap(),
        "echo-0"
    );
    assert_eq!(
        c.model_metadata("echo-0").await.unwrap()["parameters"]["instances"],
        2
    );
    for (i, model) in ["echo", "ECHO-0", "echo-1"].iter().enumerate() {
        let r = c.infer(&echo_request(model, i, &[7, 8])).await.unwrap();
        assert_eq!(r.outputs[0].values::<u32>(), vec![8, 9]);
    }
    // Unload drains: every request accepted before it is answered, 200. Each
    // takes 1 s (-3) on faulty's one instance, so some are still queued when the
    // unload begins, however slowly they arrived.
    let faulty = c
        .load("faulty", &json!({"batch_size": 1, "max_buffers": 1}))
        .await
        .unwrap();
    let faulty_request = |values: &[i32]| InferRequest {
        model: faulty.clone(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    };
    let accepted: Vec<_> = (1..=4)
        .map(|v| {
            let (c, r) = (c.clone(), faulty_request(&[v, -3]));
            (v, tokio::spawn(async move { c.infer(&r).await }))
        })
        .collect();
    kiln_tests::wait_accepted(c, &faulty, 4.0).await;
    c.unload(&faulty).await.unwrap();
    for (v, task) in accepted {
        let r = task
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("request {v}: {e}"));
        assert_eq!(r.outputs[0].values::<i32>(), vec![v, -3]);
    }
    let err = c.infer(&faulty_request(&[5])).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    // Then the endpoint is gone.
    c.unload("echo-1").await.unwrap();
    let err = c.infer(&echo_request("echo-1", 0, &[1])).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    assert_eq!(c.unload("echo-1").await.unwrap_err().status(), Some(404));
    assert_eq!(
        c.model_metadata("echo-1").await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(c.models().await.unwrap(), vec!["echo", "echo-0"]);
    let text = c.metrics().await.unwrap();
    assert!(
        !text.contains("model=\"echo-1\""),
        "unloaded model's series remain"
    );
    // A load after an unload frees the name again.
    assert_eq!(
        c.load("echo", &json!({"batch_size": 3})).await.unwrap(),
        "echo-1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_the_right_status_and_the_server_stays_healthy() {
    let kiln = Kiln::start(&[
        "--load",
        "echo",
        "--load",
        "echo-multi",
        "--max-body-bytes",
        "4096",
    ]);
    let http = reqwest::Client::new();
    let infer = |dtype: &str, shape: &str, data: &str| {
        format!(
            r#"{{"inputs":[{{"name":"INPUT0","shape":{shape},"datatype":"{dtype}","data":{data}}}]}}"#
        )
    };
    let big = format!("[{}]", vec!["1"; 3000].join(","));
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        ("POST", "/v2/models/echo/infer", "{".into(), 400, "malformed"),
        ("POST", "/v2/models/echo/infer", "[]".into(), 400, "malformed"),
        ("POST", "/v2/models/echo/infer", "".into(), 400, "malformed"),
        ("POST", "/v2/models/echo/infer", infer("FP32", "[1,2]", "[1,2]"), 400, "expected datatype UINT32"),
        ("POST", "/v2/models/echo/infer", infer("UINT32", "[1,3]", "[1,2]"), 400, "3 elements but data has 2"),
        ("POST", "/v2/models/echo/infer", infer("UINT32", "[2]", "[1,2]"), 400, "expected shape [-1, -1]"),
        ("POST", "/v2/models/echo/infer", infer("UINT32", "[1,1]", "[-5]"), 400, "out of range"),
        ("POST", "/v2/models/echo/infer", infer("UINT32", "[1,1]", "[\"x\"]"), 400, "got a string"),
        ("POST", "/v2/models/echo/infer", infer("NOPE", "[1,1]", "[1]"), 400, "unknown datatype"),
        ("POST", "/v2/models/echo/infer", infer("UINT32", "[1,1,1,1,1,1,1,1,1]", "[1]"), 400, "invalid"),
        ("POST", "/v2/models/echo/infer", infer("UINT32", "[99999,1]", &format!("[{}]", vec!["1"; 99999].join(","))), 413, "exceeds the limit"),
        ("POST", "/v2/models/echo/infer", infer("UINT32", "[1,3000]", &big), 413, "exceeds the limit"),
        ("POST", "/v2/models/echo/infer", r#"{"inputs":[{"name":"X","shape":[1,1],"datatype":"UINT32","data":[1]}]}"#.into(), 400, "unknown input `X`"),
        ("POST", "/v2/models/echo/infer", r#"{"inputs":[]}"#.into(), 400, "missing input `INPUT0`"),
        ("POST", "/v2/models/echo/infer", r#"{"inputs":[{"name":"INPUT0","shape":[1,1],"datatype":"UINT32","data":[1]}],"outputs":[{"name":"NOPE"}]}"#.into(), 400, "unknown output `NOPE`"),
        ("POST", "/v2/models/echo-multi/infer", r#"{"inputs":[{"name":"INPUT0","shape":[1,1],"datatype":"UINT32","data":[1]}]}"#.into(), 400, "missing input"),
        ("POST", "/v2/models/nope/infer", infer("UINT32", "[1,1]", "[1]"), 404, "no model `nope`"),
        ("POST", "/v2/models/echo/versions/2/infer", infer("UINT32", "[1,1]", "[1]"), 404, "'echo' version 2 is not found"),
        ("GET", "/v2/models/nope", String::new(), 404, "no model"),
        ("GET", "/v2/models/nope/ready", String::new(), 404, "no model"),
        ("GET", "/v2/nothing/here", String::new(), 404, "no route"),
        ("GET", "/v2/models/echo/infer", String::new(), 405, "not allowed"),
        ("POST", "/v2/workers/nope/load", "{}".into(), 404, "no plugin for worker `nope`"),
        ("POST", "/v2/workers/..%2F..%2Fetc/load", "{}".into(), 400, "invalid worker name"),
        ("POST", "/v2/workers/echo/load", "[1]".into(), 400, "must be a JSON object"),
        ("POST", "/v2/workers/echo/load", r#"{"batch_size": 0}"#.into(), 400, "batch_size"),
        ("POST", "/v2/workers/echo/load", r#"{"batch_size": 100000}"#.into(), 400, "batch_size"),
        ("POST", "/v2/workers/echo/load", r#"{"batcher": "fancy"}"#.into(), 400, "batcher"),
        ("POST", "/v2/workers/echo/load", r#"{"timeout": [1]}"#.into(), 400, "boolean, number or string"),
        ("POST", "/v2/workers/invert-image/load", r#"{"batch_size": 4}"#.into(), 400, "does not batch"),
        ("POST", "/v2/workers/faulty/load", r#"{"fail_init": true}"#.into(), 400, "init failed as asked"),
        ("POST", "/v2/workers/nope/unload", String::new(), 404, "no model `nope`"),
    ];
    for (method, path, body, status, want) in cases {
        let url = format!("{}{path}", kiln.url);
        let (got, text) = if status == 413 {
            // The server answers once the limit is passed, and may close before
            // the rest of the body is sent: the answer counts, not the send.
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: kiln\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            kiln_tests::http_raw(&kiln.url, &head, body.clone().into_bytes()).await
        } else {
            let request = if method == "GET" {
                http.get(url)
            } else {
                http.post(url).body(body.clone())
            };
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        };
        assert_eq!(got, status, "{method} {path} {body:.80}");
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON: {e}: {text}"));
        let message = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{method} {path}: no error in {v}"));
        assert!(
            message.contains(want),
            "{method} {path}: `{message}` lacks `{want}`"
        );
    }
    // Compressed bodies: an unknown encoding, a corrupt one, and a small gzip body
    // that decodes past --max-body-bytes.
    let gzip = |text: &str| kiln_tests::fixtures::compress("gzip", text.as_bytes());
    let big_gzip = gzip(&infer("UINT32", "[1,3000]", &big));
    assert!(big_gzip.len() < 4096);
    for (encoding, body, status, want) in [
        ("br", gzip("{}"), 400, "`br` is not supported"),
        (
            "gzip",
            b"not gzip at all".to_vec(),
            400,
            "cannot read the request body",
        ),
        ("gzip", big_gzip, 413, "exceeds the limit"),
        ("gzip", gzip(&infer("UINT32", "[1,2]", "[1,2]")), 200, ""),
    ] {
        let response = http
            .post(format!("{}/v2/models/echo/infer", kiln.url))
            .header("content-encoding", encoding)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), status, "{encoding}");
        let text = response.text().await.unwrap();
        assert!(text.contains(want), "{encoding}: {text}");
    }
    // Still healthy and serving, and a failed load left nothing behind.
    assert!(kiln.client.is_ready().await.unwrap());
    assert_eq!(
        kiln.client.models().await.unwrap(),
        vec!["echo", "echo-multi"]
    );
    let r = kiln
        .client
        .infer(&echo_request("echo", 1, &[41]))
        .await
        .unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![42]);
    let text = kiln.client.metrics().await.unwrap();
    assert!(requests_outcome(&text, "echo", "invalid").unwrap() >= 8.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_outputs_and_requested_outputs() {
    let kiln = Kiln::start(&["--load", "echo-multi"]);
    let mut request = kiln_tests::fixtures::echo_multi_request("multi");
    let r = kiln.client.infer(&request).await.unwrap();
    kiln_tests::fixtures::check_echo_multi(&r);
    request.outputs = Some(vec!["OUTPUT1".into()]);
    let r = kiln.client.infer(&request).await.unwrap();
    assert_eq!(r.outputs.len(), 1);
    assert_eq!(r.outputs[0].name, "OUTPUT1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_plugin_fails_only_its_batch() {
    let kiln = Kiln::start(&["--load", "faulty"]);
    let c = &kiln.client;
    let request = |values: &[i32]| InferRequest {
        model: "faulty".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    };
    let err = c.infer(&request(&[1, -1])).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Status { status: 500, message } if message.contains("panicked")),
        "{err}"
    );
    let err = c.infer(&request(&[-2])).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Status { status: 500, message } if message.contains("saw -2")),
        "{err}"
    );
    // The instance was restarted: everything after succeeds.
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let (c, r) = (c.clone(), request(&[i, i + 1]));
            tokio::spawn(async move { c.infer(&r).await })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        assert_eq!(
            task.await.unwrap().unwrap().outputs[0].values::<i32>(),
            vec![i as i32, i as i32 + 1]
        );
    }
    assert!(c.is_ready().await.unwrap());
    assert!(
        kiln.log().contains("worker panicked"),
        "the plugin's panic reaches the server log"
    );
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&text, "faulty", "failure"), Some(2.0));
    assert_eq!(
        metric(&text, "kiln_worker_instances", &[("model", "faulty")]),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_loses_nothing_accepted() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    // One buffer set, one instance, a queue of three (the request the batcher holds
    // counts); -3 makes the worker take 1 s.
    let endpoint = c
        .load(
            "faulty",
            &json!({"batch_size": 1, "max_buffers": 1, "queue_size": 3}),
        )
        .await
        .unwrap();
    let send = |values: Vec<i32>| {
        let c = c.clone();
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            c.infer(&InferRequest {
                model: endpoint,
                inputs: vec![InputTensor::from_slice(
                    "INPUT0",
                    DataType::Int32,
                    &[1, 1],
                    &values,
                )],
                ..Default::default()
            })
            .await
        })
    };
    let running = send(vec![-3]); // holds the only buffer set for 1 s
    kiln_tests::wait_pending(&c, &endpoint, 1.0).await;
    kiln_tests::wait_metric(&c, "kiln_batch_size_count", &endpoint, 1.0).await;
    // Then requests are sent one at a time, each accepted before the next, until
    // one is refused: the queue bound counts every request accepted and not yet
    // in a batch (the one the batcher holds, waiting for a buffer set, too), so
    // exactly three are accepted.
    let url = format!("{}/v2/models/{endpoint}/infer", kiln.url);
    let (accepted, refused) =
        kiln_tests::fill_until_refused(&c, &endpoint, 3, |value| {
            // Each takes 1 s too (-3): the queue drains slower than it is filled.
            let body = format!(
                r#"{{"inputs":[{{"name":"INPUT0","shape":[1,2],"datatype":"INT32","data":[{value},-3]}}]}}"#
            );
            tokio::spawn(reqwest::Client::new().post(url.clone()).body(body).send())
        })
        .await;
    let refused = refused.unwrap();
    assert_eq!(
        accepted.len(),
        3,
        "a queue of 3 accepted {}",
        accepted.len()
    );
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("queue of 3 is full"),
        "{body}"
    );
    running.await.unwrap().unwrap();
    let n = accepted.len();
    for (value, task) in accepted {
        let response = task.await.unwrap().unwrap();
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["outputs"][0]["data"], json!([value, -3]), "{body}");
    }
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&text, "faulty", "rejected"), Some(1.0));
    assert_eq!(
        requests_outcome(&text, "faulty", "success"),
        Some(n as f64 + 1.0)
    );
}
