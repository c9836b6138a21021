//! End-to-end over gRPC, how a call's bytes travel to the real `kiln` binary: the
//! message size limit, deadlines (`grpc-timeout`), compressed messages, bodies
//! that arrive in pieces, late or malformed, tensors in system shared memory, and a
//! full queue (RESOURCE_EXHAUSTED). The service's methods are in grpc.rs.

// Helpers outside the test functions unwrap too: a failed step fails the test.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use kiln_client::{DataType, InputTensor};
use kiln_server::grpc::proto::{self, infer_parameter::ParameterChoice, InferTensorContents};
use kiln_tests::fixtures::{compress, ShmObject};
use kiln_tests::grpc::{code_of, echo_request, failure, faulty_request};
use kiln_tests::Kiln;
use tonic::Code;

/// Over every path a message can take (`ModelInfer`, another RPC, a stream), one
/// beyond `--grpc-max-message-bytes` is `RESOURCE_EXHAUSTED`, as Triton answers it
/// (tonic's own answer is `OUT_OF_RANGE`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_over_the_size_limit_are_resource_exhausted() {
    let kiln = Kiln::start(&["--load", "echo", "--grpc-max-message-bytes", "4096"]);
    let c = kiln.grpc().await;
    let small = echo_request("echo", "small", &[1]);
    let big = echo_request("echo", "big", &vec![1u32; 2048]);
    let (code, text) = failure(c.infer(&big).await);
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    let long_name = "r".repeat(5000);
    let (code, text) = failure(
        c.register_system_shared_memory(&long_name, "/kiln-none", 0, 1)
            .await,
    );
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    // A stream answers the requests before the oversize one, then ends with its status.
    let mut stream = c.stream().await.unwrap();
    stream.send(&small).await.unwrap();
    stream.send(&big).await.unwrap();
    let first = stream.recv().await.unwrap().unwrap();
    assert_eq!(first.outputs[0].values::<u32>(), vec![2]);
    let (code, text) = failure(stream.recv().await);
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    // Still serving.
    let r = c.infer(&small).await.unwrap();
    assert_eq!(r.outputs[0].values::<u32>(), vec![2]);
}

/// A plain h2 connection to kiln's gRPC port, for the tests that look at what
/// tonic's client would hide.
async fn h2_connect(kiln: &Kiln) -> h2::client::SendRequest<Bytes> {
    let addr = kiln.grpc_url.trim_start_matches("http://").to_owned();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    h2
}

/// The headers of a `ModelInfer` call, with `extra` (name, value) added.
fn model_infer_request(kiln: &Kiln, extra: &[(&str, &str)]) -> tonic::codegen::http::Request<()> {
    let mut request = tonic::codegen::http::Request::post(format!(
        "{}/inference.GRPCInferenceService/ModelInfer",
        kiln.grpc_url
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers");
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    request.body(()).unwrap()
}

/// A call still running when the client's `grpc-timeout` passes is answered
/// `DEADLINE_EXCEEDED` then, not when the worker is done. (Sent over plain h2:
/// tonic's client would give up at the deadline itself.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_deadline_is_deadline_exceeded() {
    let kiln = Kiln::start(&["--load", "faulty"]);
    let mut h2 = h2_connect(&kiln).await;
    // -3 makes the worker take 1 s.
    let message = kiln_server::grpc::convert::encode_request(&faulty_request(-3));
    let body = framed(&prost::Message::encode_to_vec(&message));
    let request = model_infer_request(&kiln, &[("grpc-timeout", "200m")]);
    let started = std::time::Instant::now();
    let (response, mut send) = h2.send_request(request, false).unwrap();
    send.send_data(Bytes::from(body), true).unwrap();
    let response = response.await.unwrap();
    let elapsed = started.elapsed();
    assert_eq!(response.status(), 200);
    // Refused before any answer: the status comes with the headers.
    assert_eq!(
        response.headers()["grpc-status"],
        (Code::DeadlineExceeded as i32).to_string().as_str()
    );
    assert!(elapsed < Duration::from_millis(900), "{elapsed:?}");
    // Without a deadline the same model answers.
    let c = kiln.grpc().await;
    let r = c.infer(&faulty_request(4)).await.unwrap();
    assert_eq!(r.outputs[0].values::<i32>(), vec![4]);
}

/// Sends one `ModelInfer` over plain h2: the headers (with `extra`), then each piece
/// of the body as its own DATA frame `pause` after the last (the last piece ends
/// the stream). Returns the answer's `grpc-status` and, when it is 0, the answer.
async fn model_infer_in_pieces(
    kiln: &Kiln,
    extra: &[(&str, &str)],
    pieces: Vec<Vec<u8>>,
    pause: Duration,
) -> (String, Option<proto::ModelInferResponse>) {
    let mut h2 = h2_connect(kiln).await;
    let request = model_infer_request(kiln, extra);
    let (response, mut send) = h2.send_request(request, false).unwrap();
    let last = pieces.len() - 1;
    for (i, piece) in pieces.into_iter().enumerate() {
        tokio::time::sleep(pause).await;
        // The server may answer from the headers alone (an encoding it does not
        // read, a size over the limit) and reset the stream: the answer counts.
        if send.send_data(Bytes::from(piece), i == last).is_err() {
            break;
        }
    }
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    if let Some(status) = response.headers().get("grpc-status") {
        return (status.to_str().unwrap().to_owned(), None);
    }
    let mut body = response.into_body();
    let mut answer = Vec::new();
    while let Some(data) = body.data().await {
        let data = data.unwrap();
        body.flow_control().release_capacity(data.len()).unwrap();
        answer.extend_from_slice(&data);
    }
    let trailers = body.trailers().await.unwrap().unwrap();
    let status = trailers["grpc-status"].to_str().unwrap().to_owned();
    let message = (status == "0").then(|| prost::Message::decode(&answer[5..]).unwrap());
    (status, message)
}

/// A length-prefixed gRPC message.
fn framed(message: &[u8]) -> Vec<u8> {
    framed_with_flag(0, message)
}

/// A length-prefixed gRPC message with its compression flag (1: compressed).
fn framed_with_flag(flag: u8, message: &[u8]) -> Vec<u8> {
    let mut body = vec![flag];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message);
    body
}

/// Compressed requests (`grpc-encoding` gzip or deflate, as tritonclient's
/// `compression_algorithm` sends them) are answered like plain ones; one that
/// inflates beyond `--grpc-max-message-bytes` is `RESOURCE_EXHAUSTED`, found while
/// inflating; an encoding kiln does not read is `UNIMPLEMENTED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_requests_are_read_and_bounded() {
    let kiln = Kiln::start(&["--load", "echo", "--grpc-max-message-bytes", "65536"]);
    let values = [7u32, 8, 9];
    let request = kiln_server::grpc::convert::encode_request(&echo_request("echo", "z", &values));
    let message = prost::Message::encode_to_vec(&request);
    for encoding in ["gzip", "deflate"] {
        let body = framed_with_flag(1, &compress(encoding, &message));
        let headers = [("grpc-encoding", encoding)];
        let (status, answer) =
            model_infer_in_pieces(&kiln, &headers, vec![body], Duration::ZERO).await;
        assert_eq!(status, "0", "{encoding}");
        let answer = answer.unwrap();
        assert_eq!(answer.id, "z");
        assert_eq!(answer.raw_output_contents[0].len(), 12);
        assert_eq!(&answer.raw_output_contents[0][..4], &8u32.to_le_bytes());
        // 16 MiB of zeros is 16 KiB compressed: refused once 64 KiB are out.
        let mut bomb = request.clone();
        bomb.raw_input_contents = vec![Bytes::from(vec![0; 16 << 20])];
        let bomb = compress(encoding, &prost::Message::encode_to_vec(&bomb));
        assert!(bomb.len() < 65536, "{}", bomb.len());
        let body = framed_with_flag(1, &bomb);
        let (status, _) = model_infer_in_pieces(&kiln, &headers, vec![body], Duration::ZERO).await;
        assert_eq!(
            status,
            (Code::ResourceExhausted as i32).to_string(),
            "{encoding}"
        );
    }
    let body = framed_with_flag(1, &message);
    let headers = [("grpc-encoding", "br")];
    let (status, _) = model_infer_in_pieces(&kiln, &headers, vec![body], Duration::ZERO).await;
    assert_eq!(status, (Code::Unimplemented as i32).to_string());
    // Still serving, plain.
    let body = framed(&message);
    let (status, _) = model_infer_in_pieces(&kiln, &[], vec![body], Duration::ZERO).await;
    assert_eq!(status, "0");
}

/// `ModelInfer` is usually queued as soon as its headers and message are read
/// together; a message that comes later, or in pieces, is answered the same, and
/// a body that is not exactly one message is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_infer_bodies_in_pieces_late_or_malformed() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let values: Vec<u32> = (0..4096).collect();
    let request = kiln_server::grpc::convert::encode_request(&echo_request("echo", "p", &values));
    let body = framed(&prost::Message::encode_to_vec(&request));
    let expect = |(status, answer): (String, Option<proto::ModelInferResponse>)| {
        assert_eq!(status, "0");
        let answer = answer.unwrap();
        assert_eq!(answer.id, "p");
        let got: Vec<u32> = answer.raw_output_contents[0]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        // echo adds one to every element.
        assert!(
            got.iter().copied().eq(values.iter().map(|v| v + 1)),
            "wrong answer"
        );
    };
    let pause = Duration::from_millis(30);
    // Whole, after the headers; then in three pieces, the first inside the prefix.
    expect(model_infer_in_pieces(&kiln, &[], vec![body.clone()], pause).await);
    let pieces = vec![
        body[..3].to_vec(),
        body[3..100].to_vec(),
        body[100..].to_vec(),
    ];
    expect(model_infer_in_pieces(&kiln, &[], pieces, pause).await);
    // Two messages in one unary call (at once, then one after the other); a
    // message cut short; no message at all.
    let internal = (Code::Internal as i32).to_string();
    for (pieces, pause) in [
        (vec![[body.clone(), body.clone()].concat()], Duration::ZERO),
        (vec![body.clone(), body.clone()], pause),
        (vec![body[..body.len() - 1].to_vec()], Duration::ZERO),
        (vec![Vec::new()], Duration::ZERO),
    ] {
        let (status, _) = model_infer_in_pieces(&kiln, &[], pieces, pause).await;
        assert_eq!(status, internal);
    }
    // The server still answers.
    expect(model_infer_in_pieces(&kiln, &[], vec![body], Duration::ZERO).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_resource_exhausted() {
    let kiln = Kiln::start(&["--load", "faulty:batch_size=1,max_buffers=1,queue_size=3"]);
    let c = kiln.grpc().await;
    // As over REST: -3 makes the worker take 1 s (each request here does) and
    // holds the only buffer set.
    let send = |v: i32| {
        let c = c.clone();
        let mut request = faulty_request(v);
        request.inputs[0] = InputTensor::from_slice("INPUT0", DataType::Int32, &[1, 2], &[v, -3]);
        tokio::spawn(async move { c.infer(&request).await })
    };
    let running = send(0);
    kiln_tests::wait_pending(&kiln.client, "faulty", 1.0).await;
    kiln_tests::wait_metric(&kiln.client, "kiln_batch_size_count", "faulty", 1.0).await;
    // Then one at a time, each accepted before the next, until one is refused:
    // exactly the queue's three (the one the batcher holds counts).
    let (accepted, refused) = kiln_tests::fill_until_refused(&kiln.client, "faulty", 3, send).await;
    assert_eq!(
        accepted.len(),
        3,
        "a queue of 3 accepted {}",
        accepted.len()
    );
    let (code, text) = failure(refused);
    assert_eq!(code, Code::ResourceExhausted, "{text}");
    assert!(text.contains("queue of 3 is full"), "{text}");
    running.await.unwrap().unwrap();
    for (value, task) in accepted {
        assert_eq!(
            task.await.unwrap().unwrap().outputs[0].values::<i32>(),
            vec![value, -3]
        );
    }
}

fn shm_params(region: &str, byte_size: i64, offset: i64) -> HashMap<String, proto::InferParameter> {
    let param = |choice| proto::InferParameter {
        parameter_choice: Some(choice),
    };
    let mut params = HashMap::from([
        (
            "shared_memory_region".to_owned(),
            param(ParameterChoice::StringParam(region.into())),
        ),
        (
            "shared_memory_byte_size".to_owned(),
            param(ParameterChoice::Int64Param(byte_size)),
        ),
    ]);
    if offset != 0 {
        params.insert(
            "shared_memory_offset".to_owned(),
            param(ParameterChoice::Int64Param(offset)),
        );
    }
    params
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_shared_memory_inputs_and_outputs() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let c = kiln.grpc().await;
    let object = ShmObject::new(64);
    object.write_u32(16, &[7, 8, 9]);
    c.register_system_shared_memory("io", &object.key, 0, 64)
        .await
        .unwrap();
    let regions = c.system_shared_memory_status(None).await.unwrap();
    assert_eq!(regions.len(), 1);
    assert_eq!(
        (regions[0].name.as_str(), regions[0].key.as_str()),
        ("io", object.key.as_str())
    );
    assert_eq!((regions[0].offset, regions[0].byte_size), (0, 64));
    assert_eq!(
        c.system_shared_memory_status(Some("io"))
            .await
            .unwrap()
            .len(),
        1
    );

    // Input read from offset 16 of the region, output written at offset 32.
    let mut message =
        kiln_server::grpc::convert::encode_request(&echo_request("echo", "shm", &[0, 0, 0]));
    message.raw_input_contents.clear();
    message.inputs[0].parameters = shm_params("io", 12, 16);
    message.outputs = vec![proto::model_infer_request::InferRequestedOutputTensor {
        name: "OUTPUT0".into(),
        parameters: shm_params("io", 12, 32),
    }];
    let r = c.infer_message(message.clone()).await.unwrap();
    assert_eq!(r.id, "shm");
    assert_eq!(r.outputs[0].shape, vec![1, 3]);
    assert_eq!(
        r.raw_output_contents,
        vec![Bytes::new()],
        "the data is in the region"
    );
    let placed = &r.outputs[0].parameters;
    assert_eq!(
        placed["shared_memory_region"].parameter_choice,
        Some(ParameterChoice::StringParam("io".into()))
    );
    assert_eq!(
        placed["shared_memory_byte_size"].parameter_choice,
        Some(ParameterChoice::Int64Param(12))
    );
    assert_eq!(object.read_u32(32, 3), vec![8, 9, 10]);
    // Over a stream too, and with the input raw: only the output in the region.
    let mut stream = c.stream().await.unwrap();
    let mut raw_in = message.clone();
    raw_in.inputs[0].parameters.clear();
    raw_in.raw_input_contents = vec![Bytes::from_static(&[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0])];
    stream.send_message(raw_in).await.unwrap();
    let answer = stream.recv_message().await.unwrap().unwrap();
    assert_eq!(answer.error_message, "");
    assert_eq!(object.read_u32(32, 3), vec![2, 3, 4]);

    // Refusals: an unknown region, a window past the region, an output too small.
    let mut unknown = message.clone();
    unknown.inputs[0].parameters = shm_params("nope", 12, 0);
    let (code, text) = failure(c.infer_message(unknown).await);
    assert_eq!(code, Code::InvalidArgument, "{text}");
    let mut past = message.clone();
    past.inputs[0].parameters = shm_params("io", 12, 60);
    assert_eq!(code_of(c.infer_message(past).await), Code::InvalidArgument);
    let mut small = message.clone();
    small.outputs[0].parameters = shm_params("io", 8, 32);
    let (code, text) = failure(c.infer_message(small).await);
    assert_eq!(code, Code::InvalidArgument, "{text}");
    assert!(text.contains("needs 12 bytes"), "{text}");
    let mut both = message.clone();
    both.raw_input_contents = vec![Bytes::from_static(&[0; 12])];
    both.inputs[0].contents = Some(InferTensorContents {
        uint_contents: vec![1, 2, 3],
        ..Default::default()
    });
    assert_eq!(code_of(c.infer_message(both).await), Code::InvalidArgument);

    // Registration errors, then unregister (an unknown name is not an error).
    let (code, text) = failure(
        c.register_system_shared_memory("io", &object.key, 0, 64)
            .await,
    );
    assert_eq!(code, Code::AlreadyExists, "{text}");
    assert_eq!(
        code_of(
            c.register_system_shared_memory("big", &object.key, 0, 65)
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code_of(
            c.register_system_shared_memory("bad", "/../etc/passwd", 0, 4)
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code_of(c.system_shared_memory_status(Some("nope")).await),
        Code::NotFound
    );
    c.unregister_system_shared_memory(Some("nope"))
        .await
        .unwrap();
    c.register_system_shared_memory("second", &object.key, 32, 32)
        .await
        .unwrap();
    c.unregister_system_shared_memory(Some("io")).await.unwrap();
    let names: Vec<String> = c
        .system_shared_memory_status(None)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, vec!["second"]);
    assert_eq!(
        code_of(c.infer_message(message).await),
        Code::InvalidArgument
    );
    c.unregister_system_shared_memory(None).await.unwrap();
    assert!(c
        .system_shared_memory_status(None)
        .await
        .unwrap()
        .is_empty());
}
