//! What one gRPC client may make the server hold (issue #11, finding 6): streams
//! per connection are capped, an unfinished message holds what arrived (not what
//! its prefix declares), and past the server-wide budget of bytes held by
//! unfinished messages a call is answered RESOURCE_EXHAUSTED; big messages are
//! decoded and encoded off the connection's thread. A raw HTTP/2 client (the `h2`
//! crate) against the real binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use kiln_client::{DataType, InferRequest, InputTensor};
use kiln_tests::{thread_names, GrpcClient, Kiln};
use tokio::net::TcpStream;
use tonic::codegen::http;

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";
const SERVER_LIVE: &str = "/inference.GRPCInferenceService/ServerLive";
const MODEL_STREAM_INFER: &str = "/inference.GRPCInferenceService/ModelStreamInfer";

/// The three ways a message reaches the server: `ModelInfer` read by kiln,
/// compressed `ModelInfer` and `ModelStreamInfer` decoded by tonic.
const CALLS: [(&str, Option<&str>); 3] = [
    (MODEL_INFER, None),
    (MODEL_INFER, Some("gzip")),
    (MODEL_STREAM_INFER, None),
];
/// How long any wait for the server may take before the test fails.
const BOUND: Duration = Duration::from_secs(30);

/// An HTTP/2 connection to kiln's gRPC port, driven on a task of its own.
async fn connect(kiln: &Kiln) -> SendRequest<Bytes> {
    let tcp = TcpStream::connect(kiln.grpc_url.trim_start_matches("http://"))
        .await
        .unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    send
}

fn grpc_request(path: &str) -> http::Request<()> {
    encoded_request(path, None)
}

fn encoded_request(path: &str, encoding: Option<&str>) -> http::Request<()> {
    let mut request = http::Request::post(format!("http://kiln{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(encoding) = encoding {
        request = request.header("grpc-encoding", encoding);
    }
    request.body(()).unwrap()
}

/// Opens a call of `(path, encoding)` whose message declares `declared` bytes
/// and sends `sent` of them, without ending it.
async fn unfinished(
    send: &mut SendRequest<Bytes>,
    (path, encoding): (&str, Option<&str>),
    declared: u32,
    sent: usize,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    let mut ready = send.clone().ready().await.unwrap();
    let (response, mut body) = ready
        .send_request(encoded_request(path, encoding), false)
        .unwrap();
    let mut prefix = vec![u8::from(encoding.is_some())];
    prefix.extend_from_slice(&declared.to_be_bytes());
    body.send_data(Bytes::from(prefix), false).unwrap();
    // In 16 KiB pieces: several DATA frames, as a big message arrives. The
    // server may answer (and reset the stream) before all are sent: then the
    // sending stops, and the caller asserts on the answer.
    for _ in 0..sent / 16384 {
        if body
            .send_data(Bytes::from(vec![7u8; 16384]), false)
            .is_err()
        {
            break;
        }
    }
    (response, body)
}

/// The `grpc-status` of an answer: in its headers, or in its trailers.
async fn grpc_status(response: h2::client::ResponseFuture) -> String {
    let response = response.await.unwrap();
    if let Some(status) = response.headers().get("grpc-status") {
        return status.to_str().unwrap().to_owned();
    }
    let mut body = response.into_body();
    while let Some(data) = body.data().await {
        let data = data.unwrap();
        body.flow_control().release_capacity(data.len()).unwrap();
    }
    let trailers = body.trailers().await.unwrap().unwrap();
    trailers["grpc-status"].to_str().unwrap().to_owned()
}

/// A `ServerLive` call on the same connection, answered: the server has read
/// every frame sent on the connection before it.
async fn fence(send: &mut SendRequest<Bytes>) {
    let mut ready = send.clone().ready().await.unwrap();
    let (response, mut body) = ready
        .send_request(grpc_request(SERVER_LIVE), false)
        .unwrap();
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    let response = tokio::time::timeout(BOUND, response)
        .await
        .unwrap()
        .unwrap();
    let mut body = response.into_body();
    while let Some(data) = body.data().await {
        data.unwrap();
    }
}

/// `VmSize` and `VmRSS` of a process, in bytes.
fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    };
    (field("VmSize:"), field("VmRSS:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_per_connection_are_capped() {
    let kiln = Kiln::start(&["--grpc-max-concurrent-streams", "4"]);
    let tcp = TcpStream::connect(kiln.grpc_url.trim_start_matches("http://"))
        .await
        .unwrap();
    let (_send, mut connection) = h2::client::handshake(tcp).await.unwrap();
    // Drive the connection until the server's SETTINGS have been applied.
    let deadline = tokio::time::Instant::now() + BOUND;
    while connection.max_concurrent_send_streams() != 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server announced {} concurrent streams",
            connection.max_concurrent_send_streams()
        );
        tokio::select! {
            done = &mut connection => panic!("connection closed: {done:?}"),
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_message_holds_what_arrived_not_what_it_declares() {
    let kiln = Kiln::start(&[]);
    let mut send = connect(&kiln).await;
    fence(&mut send).await;
    let (size_before, rss_before) = memory(kiln.pid());
    // 18 streams (6 of each kind of call) declare 60 MiB each (1080 MiB) and send
    // 256 KiB each.
    const STREAMS: usize = 18;
    const DECLARED: u32 = 60 << 20;
    let mut open = Vec::new();
    for i in 0..STREAMS {
        open.push(unfinished(&mut send, CALLS[i % 3], DECLARED, 256 << 10).await);
    }
    fence(&mut send).await;
    fence(&mut send).await;
    let (size_after, rss_after) = memory(kiln.pid());
    let (size, rss) = (
        size_after.saturating_sub(size_before),
        rss_after.saturating_sub(rss_before),
    );
    let declared = STREAMS as u64 * u64::from(DECLARED);
    println!(
        "{STREAMS} unfinished messages: +{} MiB virtual, +{} MiB resident",
        size >> 20,
        rss >> 20
    );
    assert!(
        size < declared / 3 && rss < declared / 3,
        "{STREAMS} unfinished messages grew kiln by {} MiB virtual, {} MiB resident",
        size >> 20,
        rss >> 20
    );
    drop(open);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_pending_bytes_budget_a_call_is_resource_exhausted() {
    let kiln = Kiln::start(&["--grpc-max-pending-bytes", "1048576", "--load", "echo"]);
    let mut send = connect(&kiln).await;
    for call in CALLS {
        // 8 MiB declared, 2 MiB sent: refused once 1 MiB is held, before it ends.
        let (response, _body) = unfinished(&mut send, call, 8 << 20, 2 << 20).await;
        let status = tokio::time::timeout(BOUND, grpc_status(response))
            .await
            .expect("no answer while the message was unfinished");
        assert_eq!(status, "8", "{call:?}");
    }
    // What it held was given back: a 600 KiB message (several frames) goes through.
    let client = GrpcClient::connect(&kiln.grpc_url).await.unwrap();
    let answer = client.infer(&echo_request(150 << 10)).await.unwrap();
    assert_eq!(answer.outputs.len(), 1);
}

fn echo_request(values: usize) -> InferRequest {
    let values = vec![1u32; values];
    InferRequest {
        model: "echo".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, values.len() as i64],
            &values,
        )],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_messages_are_decoded_and_encoded_off_the_connection_thread() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let client = GrpcClient::connect(&kiln.grpc_url).await.unwrap();
    let blocking = |kiln: &Kiln| {
        thread_names(kiln.pid())
            .iter()
            .any(|n| n.starts_with("grpc-") && n.ends_with("-blocking"))
    };
    // A small call stays on the connection's thread.
    client.infer(&echo_request(16)).await.unwrap();
    assert!(!blocking(&kiln), "{:?}", thread_names(kiln.pid()));
    // 2 MiB in, 2 MiB out: decoded and encoded on the runtime's blocking threads.
    let answer = client.infer(&echo_request(512 << 10)).await.unwrap();
    assert_eq!(answer.outputs[0].values::<u32>().len(), 512 << 10);
    assert!(blocking(&kiln), "{:?}", thread_names(kiln.pid()));
}
