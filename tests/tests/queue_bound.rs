//! `queue_size` bounds every request accepted and not yet in a batch, whatever the
//! batcher keeps in queues of its own: beyond it the server answers 429 with
//! `Retry-After` at once (gRPC RESOURCE_EXHAUSTED), and everything it accepted is
//! answered.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_tests::wait::wait_pending;
use kiln_tests::{metric, requests_outcome, Kiln};
use serde_json::{json, Value};

/// Sends one `faulty` request holding `value` over plain JSON; returns the status,
/// its `Retry-After` header and the body.
async fn infer(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    value: i32,
) -> (u16, Option<String>, Value) {
    let body = json!({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1], "data": [value]}]});
    let response = http
        .post(format!("{url}/v2/models/{model}/infer"))
        .json(&body)
        .send()
        .await
        .expect("an answer");
    let status = response.status().as_u16();
    let retry = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (status, retry, response.json().await.expect("a JSON body"))
}

/// One answer: status, `Retry-After`, body.
type Answer = (u16, Option<String>, Value);

/// Fires `n` requests at once (values `first`, `first` + 1, … unless `first` is
/// negative: then all hold `first`); their answers arrive on the receiver as they
/// come, each with the value it sent.
fn flood(
    url: &str,
    model: &str,
    first: i32,
    n: i32,
) -> tokio::sync::mpsc::UnboundedReceiver<(i32, Answer)> {
    let http = reqwest::Client::new();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..n {
        let i = if first < 0 { first } else { first + i };
        let (http, url, model, tx) = (http.clone(), url.to_owned(), model.to_owned(), tx.clone());
        tokio::spawn(async move {
            let _ = tx.send((i, infer(&http, &url, &model, i).await));
        });
    }
    rx
}

/// Receives answers until `n` are refusals; returns the refusals and the others.
async fn until_refused(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<(i32, Answer)>,
    n: usize,
) -> (Vec<Answer>, Vec<(i32, Answer)>) {
    let (mut refused, mut other) = (Vec::new(), Vec::new());
    while refused.len() < n {
        let next = tokio::time::timeout(std::time::Duration::from_secs(30), rx.recv()).await;
        let Ok(Some((value, answer))) = next else {
            panic!("only {} refusals came back: {refused:?}", refused.len());
        };
        if answer.0 == 200 {
            other.push((value, answer));
        } else {
            refused.push(answer);
        }
    }
    (refused, other)
}

/// Finding 4 of the hardening issue, scaled down: the dynamic batcher used to move
/// whatever the channel held into its own priority queues, so `queue_size` bounded
/// only the channel and nothing was ever refused. A 100 s queue delay and batches of
/// 64 keep everything accepted in the batcher's queues: exactly `queue_size` requests
/// wait, every other one is refused at once with 429 and `Retry-After` (while the
/// accepted ones still wait), and the accepted ones are all answered (here by the
/// unload, which sends what is queued).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_batcher_queue_size_bounds_its_own_queues() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let params = json!({"batcher": "dynamic", "batch_size": 64, "max_buffers": 1,
        "queue_size": 20, "max_queue_delay_microseconds": 100_000_000});
    c.load("faulty", &params).await.unwrap();
    let mut answers = flood(&kiln.url, "faulty", 0, 200);
    let (refused, early) = until_refused(&mut answers, 180).await;
    assert!(early.is_empty(), "answered before the delay: {early:?}");
    for (status, retry, body) in &refused {
        assert_eq!(*status, 429, "{body}");
        assert_eq!(retry.as_deref(), Some("1"), "Retry-After on a 429");
        let message = body["error"].as_str().unwrap_or_default();
        assert!(message.contains("queue of 20 is full"), "{message}");
    }
    // The accepted requests still wait: the refusals did not wait for them.
    wait_pending(&c, "faulty", 20.0).await;
    // Over gRPC the same bound answers RESOURCE_EXHAUSTED.
    let request = InferRequest {
        model: "faulty".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, 1],
            &[1i32],
        )],
        ..Default::default()
    };
    let refused = kiln.grpc().await.infer(&request).await.unwrap_err();
    assert_eq!(
        refused.grpc_code(),
        Some(tonic::Code::ResourceExhausted),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("queue of 20 is full"),
        "{refused}"
    );
    let text = c.metrics().await.unwrap();
    assert_eq!(requests_outcome(&text, "faulty", "rejected"), Some(181.0));
    // Unloading sends what is queued: all 20 accepted are answered, each with its value.
    c.unload("faulty").await.unwrap();
    let mut accepted = 0;
    while let Some((value, (status, _, body))) = answers.recv().await {
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["outputs"][0]["data"], json!([value]), "{body}");
        accepted += 1;
    }
    assert_eq!(accepted, 20);
}

/// The soft batcher takes a request, then waits for a buffer set: that request was
/// outside the bound, so a group held `queue_size` + 1 unbatched requests (one per
/// batcher thread). Here one set, batches of one, a queue of 3 and requests that take
/// 1 s each: one runs, the batcher holds the next, and a wave of ten finds room for
/// two only. The model never has more than 4 pending — sampled while the requests
/// last — and reaches 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_batcher_counts_the_request_a_thread_holds() {
    let kiln = Kiln::start(&[]);
    let c = kiln.client.clone();
    let params = json!({"batch_size": 1, "max_buffers": 1, "queue_size": 3});
    c.load("faulty", &params).await.unwrap();
    let mut answers = flood(&kiln.url, "faulty", -3, 1);
    wait_pending(&c, "faulty", 1.0).await;
    let mut second = flood(&kiln.url, "faulty", -3, 1);
    wait_pending(&c, "faulty", 2.0).await;
    let mut wave = flood(&kiln.url, "faulty", -3, 10);
    let (mut most, mut results) = (0.0f64, Vec::new());
    while results.len() < 12 {
        let text = c.metrics().await.unwrap();
        let pending = metric(&text, "kiln_pending_requests", &[("model", "faulty")]);
        most = most.max(pending.unwrap_or(0.0));
        for rx in [&mut answers, &mut second, &mut wave] {
            while let Ok(answer) = rx.try_recv() {
                results.push(answer);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        most, 4.0,
        "one running and three accepted, the held one included"
    );
    let refused = results.iter().filter(|(_, (s, _, _))| *s == 429).count();
    assert!(refused > 0, "{results:?}");
    for (value, (status, retry, body)) in results {
        match status {
            200 => assert_eq!(body["outputs"][0]["data"], json!([value]), "{body}"),
            429 => assert_eq!(retry.as_deref(), Some("1"), "{body}"),
            _ => panic!("{status}: {body}"),
        }
    }
}
