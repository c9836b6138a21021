//! End-to-end: a shared-memory object truncated by its client while requests use
//! it. Whatever the moment, the server must answer (a 400 naming the region, or the
//! right result when the bytes were read before) and go on serving; it used to die
//! of SIGBUS touching a mapping past the object's end.

// The helpers are test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::fs::OpenOptions;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kiln_server::grpc::proto::{self, model_infer_request::InferRequestedOutputTensor};
use kiln_tests::fixtures::{shm_params, ShmObject};
use kiln_tests::{metric, HttpClient, Kiln};
use serde_json::{json, Value};

/// `faulty` with one instance and one buffer set: a `-3` request (1 s of work)
/// holds the only set, so the batcher cannot copy the next request's inputs until
/// it is done.
const FAULTY_ONE_SET: &str = "faulty:instances=1,max_buffers=1";

/// Sets the length of the object behind `object`, as its client would.
fn set_len(object: &ShmObject, len: u64) {
    let path = format!("/dev/shm{}", object.key);
    OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn object_len(object: &ShmObject) -> u64 {
    std::fs::metadata(format!("/dev/shm{}", object.key))
        .unwrap()
        .len()
}

/// Polls `/metrics` until `name{model}` is `value`: ordering by what the server has
/// seen, not by sleeping.
async fn wait_metric(c: &HttpClient, name: &str, model: &str, value: f64) {
    for _ in 0..1000 {
        let text = c.metrics().await.unwrap();
        if metric(&text, name, &[("model", model)]) == Some(value) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("`{name}` of `{model}` never reached {value}");
}

/// POSTs `body` to `/v2/models/{model}/infer`: the status and the JSON answer.
async fn infer(url: &str, model: &str, body: &Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("{url}/v2/models/{model}/infer"))
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

async fn register(url: &str, region: &str, key: &str, offset: usize, size: usize) {
    let response = reqwest::Client::new()
        .post(format!(
            "{url}/v2/systemsharedmemory/region/{region}/register"
        ))
        .body(json!({"key": key, "offset": offset, "byte_size": size}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
}

fn place(region: &str, size: usize, offset: usize) -> Value {
    json!({"shared_memory_region": region, "shared_memory_byte_size": size,
           "shared_memory_offset": offset})
}

/// A faulty request of INT32 `values`, inline.
fn faulty_inline(values: &[i32]) -> Value {
    json!({"inputs": [{"name": "INPUT0", "shape": [1, values.len()], "datatype": "INT32",
                       "data": values}]})
}

/// A faulty request reading `count` INT32 values from region `region`, the output
/// placed as `output` says.
fn faulty_from_region(region: &str, count: usize, output: Value) -> Value {
    json!({"inputs": [{"name": "INPUT0", "shape": [1, count], "datatype": "INT32",
                       "parameters": place(region, 4 * count, 0)}],
           "outputs": [{"name": "OUTPUT0", "parameters": output}]})
}

fn error(v: &Value) -> &str {
    v["error"].as_str().unwrap_or_default()
}

/// Starts the `-3` request and waits until its batch runs (holding the only set).
async fn hold_the_only_set(kiln: &Kiln) -> tokio::task::JoinHandle<(u16, Value)> {
    let url = kiln.url.clone();
    let slow = tokio::spawn(async move { infer(&url, "faulty", &faulty_inline(&[-3])).await });
    wait_metric(&kiln.client, "kiln_batch_size_count", "faulty", 1.0).await;
    slow
}

/// The reproduction over REST: the object truncated to 0 while a request
/// reading a 4 KiB region waits for the only buffer set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_region_truncated_while_the_request_waits() {
    let kiln = Kiln::start(&["--load", FAULTY_ONE_SET]);
    let object = ShmObject::new(4096);
    object.write_u32(0, &[5, 6, 7]);
    register(&kiln.url, "in", &object.key, 0, 4096).await;

    let slow = hold_the_only_set(&kiln).await;
    let url = kiln.url.clone();
    let waiting = tokio::spawn(async move {
        infer(&url, "faulty", &faulty_from_region("in", 1024, json!({}))).await
    });
    wait_metric(&kiln.client, "kiln_pending_requests", "faulty", 2.0).await;
    set_len(&object, 0);

    let (status, v) = slow.await.unwrap();
    assert_eq!(status, 200, "{v}");
    // Its bytes were read when it was decoded, before the truncation.
    let (status, v) = waiting.await.unwrap();
    assert_eq!(status, 200, "{v}");
    let data = v["outputs"][0]["data"].as_array().unwrap();
    assert_eq!(data.len(), 1024);
    assert_eq!(&data[..4], &[json!(5), json!(6), json!(7), json!(0)]);

    // Truncated before the request: a 400 naming the region, nothing else fails.
    let (status, v) = infer(
        &kiln.url,
        "faulty",
        &faulty_from_region("in", 1024, json!({})),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        error(&v).contains("shared-memory region `in`: the object")
            && error(&v).contains("was truncated to 0 bytes"),
        "{v}"
    );
    let (status, v) = infer(&kiln.url, "faulty", &faulty_inline(&[1, 2])).await;
    assert_eq!((status, &v["outputs"][0]["data"]), (200, &json!([1, 2])));
    // Extended again, the region serves again.
    set_len(&object, 4096);
    object.write_u32(0, &[9]);
    let (status, v) = infer(&kiln.url, "faulty", &faulty_from_region("in", 1, json!({}))).await;
    assert_eq!(
        (status, &v["outputs"][0]["data"]),
        (200, &json!([9])),
        "{v}"
    );
}

/// An output region truncated while its request waits: the write is refused with a
/// 400, the object is not extended again, and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_region_truncated_while_the_request_waits() {
    let kiln = Kiln::start(&["--load", FAULTY_ONE_SET]);
    let object = ShmObject::new(4096);
    register(&kiln.url, "out", &object.key, 0, 4096).await;

    let slow = hold_the_only_set(&kiln).await;
    let url = kiln.url.clone();
    let body = json!({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "INT32",
                                  "data": [4, 5]}],
                      "outputs": [{"name": "OUTPUT0", "parameters": place("out", 8, 4000)}]});
    let waiting = tokio::spawn(async move { infer(&url, "faulty", &body).await });
    wait_metric(&kiln.client, "kiln_pending_requests", "faulty", 2.0).await;
    set_len(&object, 100);

    assert_eq!(slow.await.unwrap().0, 200);
    let (status, v) = waiting.await.unwrap();
    assert_eq!(status, 400, "{v}");
    assert!(
        error(&v).contains("shared-memory region `out`")
            && error(&v).contains("was truncated to 100 bytes"),
        "{v}"
    );
    assert_eq!(
        object_len(&object),
        100,
        "a refused write must not extend it"
    );
    let (status, _) = infer(&kiln.url, "faulty", &faulty_inline(&[3])).await;
    assert_eq!(status, 200);
}

/// echo, four clients inferring from (and half of them into) a region while
/// another truncates and re-extends its object: every answer is right or a 400,
/// and the server survives. (It died after 13 answers.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inferring_while_the_object_is_truncated_and_extended() {
    const VALUES: usize = 1024;
    let kiln = Kiln::start(&["--load", "echo"]);
    let object = Arc::new(ShmObject::new(8 * VALUES));
    let pattern: Arc<Vec<u32>> = Arc::new((0..VALUES as u32).map(|v| v + 100).collect());
    object.write_u32(0, &pattern);
    register(&kiln.url, "in", &object.key, 0, 4 * VALUES).await;
    register(&kiln.url, "out", &object.key, 4 * VALUES, 4 * VALUES).await;

    let done = Arc::new(AtomicBool::new(false));
    let truncator = {
        let (object, done) = (Arc::clone(&object), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut rounds = 0u32;
            while !done.load(Ordering::Relaxed) {
                set_len(&object, 0);
                set_len(&object, 8 * VALUES as u64);
                rounds += 1;
            }
            rounds
        })
    };
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (url, pattern) = (kiln.url.clone(), Arc::clone(&pattern));
            tokio::spawn(async move {
                let output = if i % 2 == 0 {
                    json!({})
                } else {
                    place("out", 4 * VALUES, 0)
                };
                let body = json!({
                    "inputs": [{"name": "INPUT0", "shape": [1, VALUES], "datatype": "UINT32",
                                "parameters": place("in", 4 * VALUES, 0)}],
                    "outputs": [{"name": "OUTPUT0", "parameters": output}]});
                let (mut ok, mut refused) = (0, 0);
                let until = Instant::now() + Duration::from_secs(2);
                while Instant::now() < until {
                    let (status, v) = infer(&url, "echo", &body).await;
                    match status {
                        200 => ok += 1,
                        400 => {
                            assert!(error(&v).contains("was truncated"), "{v}");
                            refused += 1;
                        }
                        _ => panic!("{status}: {v}"),
                    }
                    if status == 200 && i % 2 == 0 {
                        // Each value read before or after a truncation: v + 1 or 0 + 1.
                        let data = v["outputs"][0]["data"].as_array().unwrap();
                        assert_eq!(data.len(), VALUES);
                        for (got, want) in data.iter().zip(pattern.iter()) {
                            let got = got.as_u64().unwrap();
                            assert!(got == u64::from(*want) + 1 || got == 1, "{got}");
                        }
                    }
                }
                (ok, refused)
            })
        })
        .collect();
    let (mut answers, mut refusals) = (0, 0);
    for client in clients {
        let (ok, refused) = client.await.unwrap();
        answers += ok + refused;
        refusals += refused;
    }
    done.store(true, Ordering::Relaxed);
    let rounds = truncator.join().unwrap();
    assert!(
        rounds > 0 && answers > 13,
        "{rounds} rounds, {answers} answers"
    );
    println!("{answers} answers, {refusals} of them 400, over {rounds} truncations");

    // The server is alive and the region works once the object stays whole.
    object.write_u32(0, &pattern);
    let body = json!({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "UINT32",
                                  "parameters": place("in", 8, 0)}]});
    let (status, v) = infer(&kiln.url, "echo", &body).await;
    assert_eq!(
        (status, &v["outputs"][0]["data"]),
        (200, &json!([101, 102]))
    );
}

/// A faulty `ModelInferRequest` of INT32 `values`, raw.
fn faulty_message(values: &[i32]) -> proto::ModelInferRequest {
    let request = kiln_client::InferRequest {
        model: "faulty".into(),
        inputs: vec![kiln_client::InputTensor::from_slice(
            "INPUT0",
            kiln_client::DataType::Int32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    };
    kiln_server::grpc::convert::encode_request(&request)
}

/// The reproduction over gRPC: the input read from a region truncated while its
/// request waits, then inputs and outputs in a region truncated before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_region_truncated_while_the_request_waits() {
    let kiln = Kiln::start(&["--load", FAULTY_ONE_SET]);
    let c = kiln.grpc().await;
    let object = ShmObject::new(4096);
    object.write_u32(0, &[8, 9]);
    c.register_system_shared_memory("in", &object.key, 0, 4096)
        .await
        .unwrap();
    let from_region = || {
        let mut message = faulty_message(&[0; 1024]);
        message.raw_input_contents.clear();
        message.inputs[0].parameters = shm_params("in", 4096);
        message
    };

    let slow = hold_the_only_set(&kiln).await;
    let waiting = {
        let (c, message) = (c.clone(), from_region());
        tokio::spawn(async move { c.infer_message(message).await })
    };
    wait_metric(&kiln.client, "kiln_pending_requests", "faulty", 2.0).await;
    set_len(&object, 0);
    assert_eq!(slow.await.unwrap().0, 200);
    let answer = waiting.await.unwrap().unwrap();
    assert_eq!(
        &answer.raw_output_contents[0][..8],
        &[8, 0, 0, 0, 9, 0, 0, 0]
    );

    // Truncated before: INVALID_ARGUMENT naming the region.
    let status = match c.infer_message(from_region()).await {
        Err(kiln_client::ClientError::Grpc { code, message }) => (code, message),
        other => panic!("{:?}", other.map(|r| r.id)),
    };
    assert_eq!(status.0, tonic::Code::InvalidArgument, "{}", status.1);
    assert!(status.1.contains("region `in`") && status.1.contains("truncated to 0"));
    // An output placed in the truncated region: refused, the object left as is.
    let mut to_region = faulty_message(&[1, 2]);
    to_region.outputs = vec![InferRequestedOutputTensor {
        name: "OUTPUT0".into(),
        parameters: shm_params("in", 8),
    }];
    match c.infer_message(to_region).await {
        Err(kiln_client::ClientError::Grpc { code, message }) => {
            assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
            assert!(message.contains("truncated to 0"), "{message}");
        }
        other => panic!("{:?}", other.map(|r| r.id)),
    }
    assert_eq!(object_len(&object), 0);
    let r = c.infer_message(faulty_message(&[6])).await.unwrap();
    assert_eq!(
        r.raw_output_contents,
        vec![Bytes::from_static(&[6, 0, 0, 0])]
    );
}
