//! A worker group in-process: admission, answers in order, a request or a batch
//! that fails alone, an instance restarted after a panic.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kiln_core::ServerError;
use support::{gate, params, request, server};

#[tokio::test]
async fn each_request_gets_its_own_answer() {
    let server = server();
    let model = server
        .load("fake", params(&[("timeout", 2)]))
        .await
        .unwrap();
    let pending: Vec<_> = (0..200u32)
        .map(|i| {
            server
                .submit(request(&model, &[i + 100, i * 2 + 100]))
                .unwrap()
        })
        .collect();
    for (i, pending) in (0..200u32).zip(pending) {
        let response = pending.await.unwrap();
        assert_eq!(
            response.outputs[0].values::<u32>(),
            vec![i + 101, i * 2 + 101]
        );
        assert_eq!(response.outputs[0].shape, vec![1, 2]);
    }
}

#[tokio::test]
async fn a_full_queue_refuses_at_once_and_loses_nothing_accepted() {
    let server = server();
    let gate_n = 101;
    let model = server
        .load(
            "fake",
            params(&[("gate", gate_n), ("queue_size", 4), ("batch_size", 1)]),
        )
        .await
        .unwrap();
    // One request in the instance, held at the gate; then the queue fills.
    let first = server.submit(request(&model, &[0])).unwrap();
    gate(gate_n).wait_arrived(1);
    let mut accepted = vec![first];
    let refused = loop {
        match server.submit(request(&model, &[accepted.len() as u32])) {
            Ok(pending) => accepted.push(pending),
            Err(e) => break e,
        }
        assert!(accepted.len() <= 16, "the queue of 4 never filled");
    };
    assert!(
        matches!(refused, ServerError::QueueFull { capacity: 4, .. }),
        "{refused:?}"
    );
    assert!(refused.retry_after().is_some(), "a 429 says when to retry");
    gate(gate_n).open();
    for (i, pending) in accepted.into_iter().enumerate() {
        let response = pending.await.expect("every accepted request is answered");
        assert_eq!(response.outputs[0].values::<u32>(), vec![i as u32 + 1]);
    }
}

#[tokio::test]
async fn a_bad_request_fails_alone() {
    let server = server();
    let gate_n = 102;
    let model = server
        .load("fake", params(&[("gate", gate_n), ("batch_size", 8)]))
        .await
        .unwrap();
    // The gate holds the first batch, so the next three queue into one batch.
    let first = server.submit(request(&model, &[1])).unwrap();
    gate(gate_n).wait_arrived(1);
    let a = server.submit(request(&model, &[5])).unwrap();
    let bad = server.submit(request(&model, &[7])).unwrap();
    let b = server.submit(request(&model, &[9])).unwrap();
    gate(gate_n).open();
    assert_eq!(first.await.unwrap().outputs[0].values::<u32>(), vec![2]);
    assert_eq!(a.await.unwrap().outputs[0].values::<u32>(), vec![6]);
    let e = bad.await.unwrap_err();
    assert!(
        matches!(e, ServerError::InvalidRequest(ref m) if m.contains("7 is refused")),
        "{e:?}"
    );
    assert_eq!(b.await.unwrap().outputs[0].values::<u32>(), vec![10]);
}

#[tokio::test]
async fn a_panic_fails_its_batch_and_the_instance_serves_on() {
    let server = server();
    let model = server
        .load("fake", params(&[("panic_on", 13), ("batch_size", 1)]))
        .await
        .unwrap();
    let e = server.infer(request(&model, &[13])).await.unwrap_err();
    assert!(
        matches!(e, ServerError::WorkerFailed(ref m) if m.contains("told to panic on 13")),
        "{e:?}"
    );
    for i in 0..5u32 {
        let response = server.infer(request(&model, &[i])).await.unwrap();
        assert_eq!(response.outputs[0].values::<u32>(), vec![i + 1]);
    }
}

#[tokio::test]
async fn a_malformed_request_is_refused_before_it_is_queued() {
    let server = server();
    let model = server.load("fake", Vec::new()).await.unwrap();
    let mut wrong = request(&model, &[1]);
    wrong.inputs[0].name = "NOPE".into();
    let e = server.submit(wrong).err().expect("refused at admission");
    assert!(matches!(e, ServerError::InvalidRequest(_)), "{e:?}");
    let unknown = server
        .submit(request("nobody", &[1]))
        .err()
        .expect("refused");
    assert!(matches!(unknown, ServerError::NotFound(_)), "{unknown:?}");
}
