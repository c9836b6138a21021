//! Stopping as Triton does (`--exit-timeout-secs`, docs/operations.md), with the
//! real binary and a real SIGTERM:
//! - 16 clients (8 REST, 8 gRPC) with requests in flight, then SIGTERM: every
//!   accepted request is answered; during the drain the probes see ready 503 with
//!   its reason and live 200 (the port stays open), a new request is refused 503
//!   (REST) / UNAVAILABLE (gRPC) "server is stopping"; every request is counted;
//!   the exit status is 0.
//! - an open sequence holds the drain: its continuation is let in, a new
//!   sequence is refused, and the server exits 0 once the sequence ends.
//! - a request that cannot finish within `--exit-timeout-secs` gets an error and
//!   the exit status is non-zero; so does one cut by a second signal.
//!
//! The slow requests are the `faulty` worker's -3 (1 s a batch).

// Test code: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kiln_client::{
    ClientError, DataType, GrpcClient, InferRequest, InputTensor, Param, ParamValue,
};
use kiln_tests::{wait_pending, Kiln};
use serde_json::json;

/// A `faulty` request: -3 takes 1 s, other values are copied at once.
fn faulty(value: i32) -> InferRequest {
    InferRequest {
        model: "faulty".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, 1],
            &[value],
        )],
        ..Default::default()
    }
}

fn sigterm(kiln: &Kiln) {
    assert_eq!(unsafe { libc::kill(kiln.pid() as i32, libc::SIGTERM) }, 0);
}

/// `GET path`: the status and the body.
async fn get(kiln: &Kiln, path: &str) -> (u16, String) {
    let answer = reqwest::get(format!("{}{path}", kiln.url)).await.unwrap();
    (answer.status().as_u16(), answer.text().await.unwrap())
}

/// Waits until readiness turns 503 (the server began stopping); returns its body.
async fn wait_not_ready(kiln: &Kiln) -> String {
    for _ in 0..2000 {
        let (status, body) = get(kiln, "/v2/health/ready").await;
        if status == 503 {
            return body;
        }
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("readiness never turned 503 after SIGTERM");
}

/// How one in-flight request ended.
#[derive(Debug)]
enum Ended {
    Answered,
    Failed(ClientError),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_every_accepted_request_refuses_new_ones_and_exits_0() {
    let mut kiln = Kiln::start(&["--load", "faulty:batch_size=4", "--exit-timeout-secs", "60"]);
    let grpc = kiln.grpc().await;
    let mut clients = Vec::new();
    for i in 0..16 {
        let http = kiln.client.clone();
        let grpc = grpc.clone();
        clients.push(tokio::spawn(async move {
            let answer = if i % 2 == 0 {
                http.infer(&faulty(-3)).await
            } else {
                grpc.infer(&faulty(-3)).await
            };
            match answer {
                Ok(r) => {
                    assert_eq!(r.outputs[0].values::<i32>(), [-3]);
                    Ended::Answered
                }
                Err(e) => Ended::Failed(e),
            }
        }));
    }
    wait_pending(&kiln.client, "faulty", 16.0).await;
    sigterm(&kiln);

    // The drain takes 4 batches of 1 s: everything below happens during it.
    let reason = wait_not_ready(&kiln).await;
    assert!(reason.contains("the server is stopping"), "{reason}");
    assert_eq!(get(&kiln, "/v2/health/live").await.0, 200);
    assert!(!grpc.is_ready().await.unwrap());
    assert!(grpc.is_live().await.unwrap());
    let mut refused = 0;
    for _ in 0..3 {
        let e = kiln.client.infer(&faulty(1)).await.unwrap_err();
        assert_eq!(e.status(), Some(503), "{e}");
        assert!(e.to_string().contains("server is stopping"), "{e}");
        refused += 1;
        let e = grpc.infer(&faulty(1)).await.unwrap_err();
        assert_eq!(e.grpc_code(), Some(tonic::Code::Unavailable), "{e}");
        assert!(e.to_string().contains("server is stopping"), "{e}");
        refused += 1;
    }
    // Still draining: the slow requests hold it.
    assert_eq!(get(&kiln, "/v2/health/ready").await.0, 503);

    let mut answered = 0;
    for client in clients {
        match client.await.unwrap() {
            Ended::Answered => answered += 1,
            Ended::Failed(e) => panic!("an accepted request failed in the drain: {e}"),
        }
    }
    assert_eq!((answered, refused), (16, 6));
    let status = kiln
        .exit_within(Duration::from_secs(30))
        .expect("kiln did not exit after the drain");
    assert_eq!(status.code(), Some(0), "{}", kiln.log());
    assert!(
        kiln.log_with("every accepted request was answered")
            .contains("every accepted request was answered"),
        "{}",
        kiln.log()
    );
}

/// Load-time parameters serving `accumulate` as a stateful model.
fn accumulate() -> serde_json::Value {
    json!({
        "batcher": "sequence",
        "batch_size": 8,
        "state.STATE": "STATE_OUT",
        "control.start": "START",
        "control.end": "END",
        "control.ready": "READY",
        "control.corrid": "CORRID",
    })
}

/// One value of sequence `id`.
fn step(id: u64, value: f32, start: bool, end: bool) -> InferRequest {
    let param = |key: &str, value| Param {
        key: key.into(),
        value,
    };
    InferRequest {
        model: "accumulate".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT",
            DataType::Fp32,
            &[1, 1],
            &[value],
        )],
        parameters: vec![
            param("sequence_id", ParamValue::Uint(id)),
            param("sequence_start", ParamValue::Bool(start)),
            param("sequence_end", ParamValue::Bool(end)),
        ],
        ..Default::default()
    }
}

fn sum(answer: kiln_client::InferResponse) -> f32 {
    let output = answer.outputs.iter().find(|o| o.name == "OUTPUT").unwrap();
    output.values::<f32>()[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_sequence_goes_on_while_stopping_and_a_new_one_is_refused() {
    let mut kiln = Kiln::start(&["--exit-timeout-secs", "60"]);
    let c = kiln.client.clone();
    c.load("accumulate", &accumulate()).await.unwrap();
    let first = c.infer(&step(7, 1.0, true, false)).await.unwrap();
    assert_eq!(sum(first), 1.0);
    sigterm(&kiln);
    wait_not_ready(&kiln).await;

    // The continuation is let in; a new sequence (and a stateless request) is not.
    let next = c.infer(&step(7, 2.0, false, false)).await.unwrap();
    assert_eq!(sum(next), 3.0);
    let e = c.infer(&step(8, 1.0, true, false)).await.unwrap_err();
    assert_eq!(e.status(), Some(503), "{e}");
    assert!(e.to_string().contains("server is stopping"), "{e}");
    // The open sequence holds the drain.
    assert!(kiln.exit_within(Duration::from_millis(300)).is_none());

    let last = c.infer(&step(7, 3.0, false, true)).await.unwrap();
    assert_eq!(sum(last), 6.0);
    let status = kiln
        .exit_within(Duration::from_secs(30))
        .expect("kiln did not exit once the sequence ended");
    assert_eq!(status.code(), Some(0), "{}", kiln.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_exit_timeout_leaves_gets_an_error_and_the_exit_status_says_so() {
    // One request a batch of 1 s: 4 in flight need 4 s, the timeout gives 1 s.
    let mut kiln = Kiln::start(&["--load", "faulty:batch_size=1", "--exit-timeout-secs", "1"]);
    let grpc: GrpcClient = kiln.grpc().await;
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let http = kiln.client.clone();
            let grpc = grpc.clone();
            tokio::spawn(async move {
                if i % 2 == 0 {
                    http.infer(&faulty(-3)).await.map(|_| ())
                } else {
                    grpc.infer(&faulty(-3)).await.map(|_| ())
                }
            })
        })
        .collect();
    wait_pending(&kiln.client, "faulty", 4.0).await;
    sigterm(&kiln);
    let failed = failures(clients).await;
    assert!(failed >= 2, "{failed} of 4 requests failed");
    let status = kiln
        .exit_within(Duration::from_secs(30))
        .expect("kiln did not exit after the exit timeout");
    assert_eq!(status.code(), Some(1), "{}", kiln.log());
    let log = kiln.log_with("--exit-timeout-secs 1 expired");
    assert!(log.contains("--exit-timeout-secs 1 expired: cut"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_stops_at_once_with_a_non_zero_status() {
    // 4 requests of 1 s each, one at a time: the drain would take 4 s of the 60.
    let mut kiln = Kiln::start(&["--load", "faulty:batch_size=1", "--exit-timeout-secs", "60"]);
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let http = kiln.client.clone();
            tokio::spawn(async move { http.infer(&faulty(-3)).await.map(|_| ()) })
        })
        .collect();
    wait_pending(&kiln.client, "faulty", 4.0).await;
    sigterm(&kiln);
    wait_not_ready(&kiln).await;
    assert_eq!(unsafe { libc::kill(kiln.pid() as i32, libc::SIGINT) }, 0);
    let status = kiln
        .exit_within(Duration::from_secs(30))
        .expect("kiln did not exit on the second signal");
    assert_eq!(status.code(), Some(1), "{}", kiln.log());
    let log = kiln.log_with("SIGINT again");
    assert!(log.contains("stopping: SIGINT again: cut"), "{log}");
    let failed = failures(clients).await;
    assert!(failed >= 1, "{failed} of 4 requests failed");
}

/// How many of `clients` ended in an error.
async fn failures(clients: Vec<tokio::task::JoinHandle<Result<(), ClientError>>>) -> usize {
    let mut failed = 0;
    for client in clients {
        if client.await.unwrap().is_err() {
            failed += 1;
        }
    }
    failed
}
