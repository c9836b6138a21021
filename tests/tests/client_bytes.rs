//! The one server-wide budget of bytes held for clients (`--max-client-bytes`,
//! issue #27) covers the HTTP inference bodies being gathered and the unfinished
//! gRPC messages: beyond it a request is refused at once (429 /
//! `RESOURCE_EXHAUSTED`, naming the flag), counted in
//! `kiln_client_bytes_refused_total{use}`, and what was held is given back.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_tests::{http_raw, metric, Kiln};

/// The budget the tests run under: well below `--max-body-bytes` and
/// `--grpc-max-pending-bytes`, so only it can refuse.
const BUDGET: usize = 64 << 10;

/// An echo inference body of `len` bytes: a small request padded with spaces
/// (valid JSON, so without the budget it is answered 200).
fn padded_body(len: usize) -> Vec<u8> {
    let mut body =
        br#"{"inputs":[{"name":"INPUT0","shape":[1,2],"datatype":"UINT32","data":[1,2]}]}"#
            .to_vec();
    body.resize(len.max(body.len()), b' ');
    body
}

/// `body` in HTTP/1.1 chunked encoding, in chunks of 8 KiB.
fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for chunk in body.chunks(8 << 10) {
        out.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        out.extend_from_slice(chunk);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

async fn refused(kiln: &Kiln, what: &str) -> f64 {
    let text = kiln.client.metrics().await.unwrap();
    metric(&text, "kiln_client_bytes_refused_total", &[("use", what)]).unwrap_or(0.0)
}

async fn held(kiln: &Kiln) -> f64 {
    let text = kiln.client.metrics().await.unwrap();
    metric(&text, "kiln_client_bytes", &[]).unwrap()
}

/// A body beyond the budget is refused with 429 before it is gathered, whether it
/// declares its length or comes chunked, an inference's or a control request's; one
/// within it is answered, and nothing stays held after either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_bodies_beyond_the_client_bytes_budget_are_refused() {
    let kiln = Kiln::start(&["--load", "echo", "--max-client-bytes", &BUDGET.to_string()]);
    let path = "/v2/models/echo/infer";
    let host = kiln.url.trim_start_matches("http://");

    let small = padded_body(BUDGET / 2);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        small.len()
    );
    let (status, answer) = http_raw(&kiln.url, &head, small).await;
    assert_eq!(status, 200, "{answer}");

    let big = padded_body(4 * BUDGET);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        big.len()
    );
    let (status, answer) = http_raw(&kiln.url, &head, big.clone()).await;
    assert_eq!(status, 429, "{answer}");
    assert!(answer.contains("--max-client-bytes"), "{answer}");
    assert_eq!(refused(&kiln, "body").await, 1.0);

    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n"
    );
    let (status, answer) = http_raw(&kiln.url, &head, chunked(&big)).await;
    assert_eq!(status, 429, "{answer}");
    assert_eq!(refused(&kiln, "body").await, 2.0);

    // A control request's body (here the logging settings) is reserved the same way.
    let mut settings = b"{}".to_vec();
    settings.resize(4 * BUDGET, b' ');
    let head = format!(
        "POST /v2/logging HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n"
    );
    let (status, answer) = http_raw(&kiln.url, &head, chunked(&settings)).await;
    assert_eq!(status, 429, "{answer}");
    assert_eq!(refused(&kiln, "body").await, 3.0);
    settings.truncate(BUDGET / 2);
    let (status, answer) = http_raw(&kiln.url, &head, chunked(&settings)).await;
    assert_eq!(status, 200, "{answer}");

    assert_eq!(held(&kiln).await, 0.0);
    let (status, answer) = http_raw(
        &kiln.url,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
             Transfer-Encoding: chunked\r\n\r\n"
        ),
        chunked(&padded_body(BUDGET / 2)),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(held(&kiln).await, 0.0);
}

/// A gRPC message that arrives in many DATA frames and holds more than the budget
/// while unfinished is `RESOURCE_EXHAUSTED`; a smaller one is answered after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_grpc_messages_beyond_the_client_bytes_budget_are_refused() {
    let kiln = Kiln::start(&["--load", "echo", "--max-client-bytes", &BUDGET.to_string()]);
    let grpc = kiln.grpc().await;
    let request = |values: usize| InferRequest {
        model: "echo".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, values as i64],
            &vec![7u32; values],
        )],
        ..Default::default()
    };
    // 256 KiB of values: 16 frames of 16 KiB.
    let Err(err) = grpc.infer(&request(BUDGET)).await else {
        panic!("a message beyond the budget was answered");
    };
    assert_eq!(
        err.grpc_code(),
        Some(tonic::Code::ResourceExhausted),
        "{err}"
    );
    assert!(err.to_string().contains("--max-client-bytes"), "{err}");
    assert_eq!(refused(&kiln, "grpc_message").await, 1.0);
    assert_eq!(held(&kiln).await, 0.0);

    let answer = grpc.infer(&request(BUDGET / 16)).await.unwrap();
    assert_eq!(answer.outputs.len(), 1);
}

/// A body is reserved as its bytes arrive, not by the length it declares: a client
/// that declares most of the budget and sends 1 KiB holds 1 KiB, and another
/// client's body is answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_length_alone_does_not_hold_the_budget() {
    use tokio::io::AsyncWriteExt;
    let kiln = Kiln::start(&["--load", "echo", "--max-client-bytes", &BUDGET.to_string()]);
    let host = kiln.url.trim_start_matches("http://");
    let head = |len: usize| {
        format!(
            "POST /v2/models/echo/infer HTTP/1.1\r\nHost: {host}\r\n\
             Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        )
    };
    let mut slow = tokio::net::TcpStream::connect(host).await.unwrap();
    let body = padded_body(BUDGET - 1024);
    slow.write_all(head(body.len()).as_bytes()).await.unwrap();
    slow.write_all(&body[..1024]).await.unwrap();
    while held(&kiln).await == 0.0 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(held(&kiln).await <= 1024.0);
    let other = padded_body(BUDGET / 2);
    let (status, answer) = http_raw(&kiln.url, &head(other.len()), other).await;
    assert_eq!(status, 200, "{answer}");
    drop(slow);
}
