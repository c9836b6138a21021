//! End-to-end: Triton's system shared-memory extension over REST, with the real
//! `kiln` binary, the echo plugin, real sockets and real `/dev/shm` objects.

// The helpers are test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use kiln_tests::fixtures::ShmObject as Object;
use kiln_tests::Kiln;
use serde_json::{json, Value};

/// Sends `method path` with an optional JSON body; the status and the JSON answer
/// (`Null` when empty).
async fn call(base: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let client = reqwest::Client::new();
    let url = format!("{base}{path}");
    let mut request = match method {
        "GET" => client.get(url),
        _ => client.post(url),
    };
    if let Some(body) = body {
        request = request.body(body.to_string());
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let value = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap()
    };
    (status, value)
}

async fn get(kiln: &Kiln, path: &str) -> (u16, Value) {
    call(&kiln.url, "GET", path, None).await
}

async fn post(kiln: &Kiln, path: &str, body: Option<Value>) -> (u16, Value) {
    call(&kiln.url, "POST", path, body).await
}

async fn register(
    kiln: &Kiln,
    region: &str,
    key: &str,
    offset: usize,
    size: usize,
) -> (u16, Value) {
    post(
        kiln,
        &format!("/v2/systemsharedmemory/region/{region}/register"),
        Some(json!({"key": key, "offset": offset, "byte_size": size})),
    )
    .await
}

async fn infer(kiln: &Kiln, body: Value) -> (u16, Value) {
    post(kiln, "/v2/models/echo/infer", Some(body)).await
}

/// Shared-memory parameters of a tensor.
fn place(region: &str, size: usize, offset: usize) -> Value {
    json!({"shared_memory_region": region, "shared_memory_byte_size": size,
           "shared_memory_offset": offset})
}

/// An echo request: `count` UINT32 values of `input` params, OUTPUT0 with `output` params.
fn echo(count: usize, input: Value, output: Value) -> Value {
    json!({
        "id": "shm",
        "inputs": [{"name": "INPUT0", "shape": [1, count], "datatype": "UINT32",
                    "parameters": input}],
        "outputs": [{"name": "OUTPUT0", "parameters": output}],
    })
}

fn error(v: &Value) -> &str {
    v["error"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_and_output_in_shared_memory() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let meta = kiln.client.server_metadata().await.unwrap();
    assert!(meta["extensions"]
        .as_array()
        .unwrap()
        .contains(&json!("system_shared_memory")));

    let object = Object::new(256);
    object.write_u32(0, &[1, 2, 3, 4]);
    assert_eq!(register(&kiln, "in", &object.key, 0, 64).await.0, 200);
    assert_eq!(register(&kiln, "out", &object.key, 128, 128).await.0, 200);

    // Input and output in shared memory: the output has no data and no parameters
    // (as Triton answers; its C++ client requires `binary_data_size` otherwise).
    let (status, v) = infer(&kiln, echo(4, place("in", 16, 0), place("out", 32, 8))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["id"], "shm");
    assert_eq!(
        v["outputs"][0],
        json!({"name": "OUTPUT0", "datatype": "UINT32", "shape": [1, 4]})
    );
    assert_eq!(object.read_u32(136, 4), vec![2, 3, 4, 5]);

    // The client changes the input in place and asks again, the output in JSON.
    object.write_u32(16, &[10, 20]);
    let (status, v) = infer(&kiln, echo(2, place("in", 8, 16), json!({}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["outputs"][0]["data"], json!([11, 21]));

    // Concurrent requests, each with its own windows.
    object.write_u32(0, &[100, 200, 300, 400, 500, 600, 700, 800]);
    let tasks: Vec<_> = (0..8usize)
        .map(|i| {
            let url = kiln.url.clone();
            let body = echo(1, place("in", 4, 4 * i), place("out", 4, 4 * i));
            tokio::spawn(
                async move { call(&url, "POST", "/v2/models/echo/infer", Some(body)).await },
            )
        })
        .collect();
    for task in tasks {
        let (status, v) = task.await.unwrap();
        assert_eq!(status, 200, "{v}");
    }
    assert_eq!(
        object.read_u32(128, 8),
        vec![101, 201, 301, 401, 501, 601, 701, 801]
    );

    // Status: every region, then one; 404 for an unknown one.
    let (status, v) = get(&kiln, "/v2/systemsharedmemory/status").await;
    assert_eq!(status, 200);
    assert_eq!(
        v,
        json!([
            {"name": "in", "key": object.key, "offset": 0, "byte_size": 64},
            {"name": "out", "key": object.key, "offset": 128, "byte_size": 128},
        ])
    );
    let (status, v) = get(&kiln, "/v2/systemsharedmemory/region/out/status").await;
    assert_eq!(
        (status, v),
        (
            200,
            json!([{"name": "out", "key": object.key, "offset": 128, "byte_size": 128}])
        )
    );
    let (status, v) = get(&kiln, "/v2/systemsharedmemory/region/none/status").await;
    assert_eq!(status, 404, "{v}");
    assert!(error(&v).contains("`none`"), "{v}");

    // Unregister one: an inference naming it is a bad request, as in Triton.
    let (status, _) = post(&kiln, "/v2/systemsharedmemory/region/in/unregister", None).await;
    assert_eq!(status, 200);
    let (status, v) = infer(&kiln, echo(4, place("in", 16, 0), json!({}))).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        error(&v).contains("unable to find system shared memory region `in`"),
        "{v}"
    );
    let (_, v) = get(&kiln, "/v2/systemsharedmemory/status").await;
    assert_eq!(v.as_array().unwrap().len(), 1);
    // Unregistering an unknown region is not an error (Triton); then all of them.
    let (status, _) = post(&kiln, "/v2/systemsharedmemory/region/in/unregister", None).await;
    assert_eq!(status, 200);
    let (status, _) = post(&kiln, "/v2/systemsharedmemory/unregister", None).await;
    assert_eq!(status, 200);
    let (_, v) = get(&kiln, "/v2/systemsharedmemory/status").await;
    assert_eq!(v, json!([]));
    // The name is free again.
    assert_eq!(register(&kiln, "in", &object.key, 0, 8).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_errors() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let object = Object::new(64);
    assert_eq!(register(&kiln, "r", &object.key, 0, 32).await.0, 200);

    // Registration: twice, out of bounds, bad keys, missing objects and fields.
    let register_cases: Vec<(Value, &str)> = vec![
        (
            json!({"key": object.key, "offset": 0, "byte_size": 8}),
            "shared memory region `r` already in manager",
        ),
        (
            json!({"key": object.key, "offset": 60, "byte_size": 8}),
            "run past the object's 64 bytes",
        ),
        (
            json!({"key": "/../etc/passwd", "byte_size": 8}),
            "must be `/name`",
        ),
        (
            json!({"key": "/kiln-e2e-no-such-object", "byte_size": 8}),
            "No such file",
        ),
        (json!({"key": object.key}), "`byte_size` is required"),
        (json!({"byte_size": 8}), "`key` must be a string"),
        (
            json!({"key": object.key, "byte_size": -8}),
            "`byte_size` must be a non-negative integer",
        ),
    ];
    for (body, want) in register_cases {
        let name = if want.contains("already") { "r" } else { "r2" };
        let (status, v) = post(
            &kiln,
            &format!("/v2/systemsharedmemory/region/{name}/register"),
            Some(body),
        )
        .await;
        assert_eq!(status, 400, "{want}: {v}");
        assert!(error(&v).contains(want), "`{v}` lacks `{want}`");
    }
    let (_, v) = get(&kiln, "/v2/systemsharedmemory/status").await;
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");

    // Inference: sizes, windows, unknown regions, output too large.
    object.write_u32(0, &[1, 2, 3, 4]);
    let infer_cases: Vec<(Value, &str)> = vec![
        (
            echo(4, place("r", 12, 0), json!({})),
            "shared_memory_byte_size 12 does not match shape [1, 4] of UINT32 (16 bytes)",
        ),
        (
            echo(4, place("r", 16, 24), json!({})),
            "offset 24 and byte size 16 run past its 32 bytes",
        ),
        (
            echo(4, place("gone", 16, 0), json!({})),
            "unable to find system shared memory region `gone`",
        ),
        (
            echo(4, place("r", 16, 0), place("gone", 16, 0)),
            "output `OUTPUT0`: unable to find system shared memory region `gone`",
        ),
        (
            echo(4, place("r", 16, 0), place("r", 8, 16)),
            "output `OUTPUT0` needs 16 bytes but its shared_memory_byte_size is 8",
        ),
    ];
    for (body, want) in infer_cases {
        let (status, v) = infer(&kiln, body).await;
        assert_eq!(status, 400, "{want}: {v}");
        assert!(error(&v).contains(want), "`{v}` lacks `{want}`");
    }
    // The output that did not fit was not written.
    assert_eq!(object.read_u32(16, 4), vec![0, 0, 0, 0]);
    // Shared-memory keys among the request's parameters are the protocol's: taken
    // out, while the worker's own parameters still reach it.
    let mut body = echo(4, place("r", 16, 0), place("r", 16, 16));
    body["parameters"] = json!({"shared_memory_region": "r", "increment": 2});
    let (status, v) = infer(&kiln, body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(object.read_u32(16, 4), vec![3, 4, 5, 6]);
}

/// Polls `/metrics` until `name{model="faulty"}` is `n`.
async fn wait_faulty(kiln: &Kiln, name: &str, n: f64) {
    for _ in 0..1000 {
        let text = kiln.client.metrics().await.unwrap();
        if kiln_tests::metric(&text, name, &[("model", "faulty")]) == Some(n) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("`{name}` of faulty never reached {n}");
}

/// The bytes copied out of shared memory and held by requests are bounded
/// (`--shm-max-held-bytes`): beyond, a request is refused at once with 429; one
/// input larger than the bound is 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_inputs_held_are_bounded() {
    let kiln = Kiln::start(&[
        "--load",
        "faulty:instances=1,max_buffers=1",
        "--shm-max-held-bytes",
        "8192",
    ]);
    let object = Object::new(16384);
    assert_eq!(register(&kiln, "in", &object.key, 0, 16384).await.0, 200);
    let from_region = |count: usize| {
        json!({"inputs": [{"name": "INPUT0", "shape": [1, count], "datatype": "INT32",
                           "parameters": place("in", 4 * count, 0)}]})
    };
    let send = |body: Value| {
        let url = kiln.url.clone();
        tokio::spawn(async move { call(&url, "POST", "/v2/models/faulty/infer", Some(body)).await })
    };
    // A slow request (-3: 1 s) holds the only buffer set; two more, 4 KiB each from
    // the region, wait behind it and hold the whole bound.
    let slow = send(
        json!({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "INT32",
                                       "data": [-3]}]}),
    );
    wait_faulty(&kiln, "kiln_batch_size_count", 1.0).await;
    let waiting = [send(from_region(1024)), send(from_region(1024))];
    wait_faulty(&kiln, "kiln_pending_requests", 3.0).await;
    let (status, v) = call(
        &kiln.url,
        "POST",
        "/v2/models/faulty/infer",
        Some(from_region(1)),
    )
    .await;
    assert_eq!(status, 429, "{v}");
    assert!(
        error(&v).contains("8192 bytes of shared-memory inputs"),
        "{v}"
    );
    assert_eq!(slow.await.unwrap().0, 200);
    for task in waiting {
        let (status, v) = task.await.unwrap();
        assert_eq!(status, 200, "{v}");
    }
    // Released with their answers: the bound is free again.
    let (status, v) = call(
        &kiln.url,
        "POST",
        "/v2/models/faulty/infer",
        Some(from_region(2048)),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = call(
        &kiln.url,
        "POST",
        "/v2/models/faulty/infer",
        Some(from_region(2049)),
    )
    .await;
    assert_eq!(status, 413, "{v}");
    assert!(
        error(&v).contains("exceed the server's limit of 8192"),
        "{v}"
    );
}

/// The same bytes count against the server-wide budget of bytes held for clients
/// (`--max-client-bytes`, issue #27): with the shared-memory bound at its default,
/// that budget refuses at once with 429, and frees with the answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_inputs_count_against_the_client_bytes_budget() {
    let kiln = Kiln::start(&[
        "--load",
        "faulty:instances=1,max_buffers=1",
        // Two 4 KiB copies, and 1 KiB for the JSON bodies held with them (the
        // bodies reserve from the same budget).
        "--max-client-bytes",
        "9216",
    ]);
    let object = Object::new(16384);
    assert_eq!(register(&kiln, "in", &object.key, 0, 16384).await.0, 200);
    let from_region = |count: usize| {
        json!({"inputs": [{"name": "INPUT0", "shape": [1, count], "datatype": "INT32",
                           "parameters": place("in", 4 * count, 0)}]})
    };
    let send = |body: Value| {
        let url = kiln.url.clone();
        tokio::spawn(async move { call(&url, "POST", "/v2/models/faulty/infer", Some(body)).await })
    };
    let slow = send(
        json!({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "INT32",
                                       "data": [-3]}]}),
    );
    wait_faulty(&kiln, "kiln_batch_size_count", 1.0).await;
    let waiting = [send(from_region(1024)), send(from_region(1024))];
    wait_faulty(&kiln, "kiln_pending_requests", 3.0).await;
    let (status, v) = call(
        &kiln.url,
        "POST",
        "/v2/models/faulty/infer",
        Some(from_region(256)),
    )
    .await;
    assert_eq!(status, 429, "{v}");
    assert!(error(&v).contains("--max-client-bytes 9216"), "{v}");
    let text = kiln.client.metrics().await.unwrap();
    assert!(
        text.contains("kiln_client_bytes_refused_total{use=\"shared_memory\"} 1"),
        "{text}"
    );
    assert_eq!(slow.await.unwrap().0, 200);
    for task in waiting {
        let (status, v) = task.await.unwrap();
        assert_eq!(status, 200, "{v}");
    }
    let (status, v) = call(
        &kiln.url,
        "POST",
        "/v2/models/faulty/infer",
        Some(from_region(2048)),
    )
    .await;
    assert_eq!(status, 200, "{v}");
}
