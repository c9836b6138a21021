//! The Manager in-process: endpoints per parameter set, a failed load rolled
//! back, an unload that drains what it accepted.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kiln_core::ServerError;
use support::{gate, params, request, server};

#[tokio::test]
async fn the_same_parameters_share_an_endpoint_and_others_get_a_new_one() {
    let server = server();
    let a = server
        .load("fake", params(&[("timeout", 1)]))
        .await
        .unwrap();
    let again = server
        .load("fake", params(&[("timeout", 1)]))
        .await
        .unwrap();
    let other = server
        .load("fake", params(&[("timeout", 2)]))
        .await
        .unwrap();
    assert_eq!(a, "fake");
    assert_eq!(again, "fake");
    assert_eq!(other, "fake-0");
    let mut names: Vec<_> = server
        .models()
        .iter()
        .map(|g| g.endpoint().to_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["fake", "fake-0"]);
}

#[tokio::test]
async fn a_failed_load_leaves_nothing_behind() {
    let server = server();
    let e = server
        .load(
            "fake",
            vec![kiln_core::Param {
                key: "fail_init".into(),
                value: kiln_core::ParamValue::Bool(true),
            }],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, ServerError::LoadFailed { ref reason, .. } if reason.contains("told to fail")),
        "{e:?}"
    );
    assert!(server.models().is_empty());
    let unknown = server.load("nothing-here", Vec::new()).await.unwrap_err();
    assert!(
        matches!(
            unknown,
            ServerError::LoadFailed { .. } | ServerError::NotFound(_)
        ),
        "{unknown:?}"
    );
    // The name is free: a good load takes it.
    assert_eq!(server.load("fake", Vec::new()).await.unwrap(), "fake");
}

#[tokio::test]
async fn a_builtin_worker_cannot_run_in_a_worker_host() {
    let server = server();
    let e = server
        .load(
            "fake",
            vec![kiln_core::Param {
                key: "isolation".into(),
                value: kiln_core::ParamValue::Str("process".into()),
            }],
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("needs a plugin library"), "{e}");
    assert!(server.models().is_empty());
}

#[tokio::test]
async fn unloading_answers_what_was_accepted_and_refuses_the_rest() {
    let server = server();
    let gate_n = 201;
    let model = server
        .load("fake", params(&[("gate", gate_n), ("batch_size", 1)]))
        .await
        .unwrap();
    let accepted: Vec<_> = (0..3u32)
        .map(|i| server.submit(request(&model, &[i])).unwrap())
        .collect();
    gate(gate_n).wait_arrived(1);
    let unloading = {
        let server = server.clone();
        let model = model.clone();
        tokio::spawn(async move { server.unload(&model).await })
    };
    // Once the name is gone, a new request is refused; the accepted ones wait.
    while server.model(&model).is_ok() {
        tokio::task::yield_now().await;
    }
    let refused = server.submit(request(&model, &[9])).err().expect("refused");
    assert!(
        matches!(
            refused,
            ServerError::NotFound(_) | ServerError::Unavailable(_)
        ),
        "{refused:?}"
    );
    gate(gate_n).open();
    for (i, pending) in (0..3u32).zip(accepted) {
        let response = pending.await.expect("accepted before the unload: answered");
        assert_eq!(response.outputs[0].values::<u32>(), vec![i + 1]);
    }
    unloading.await.unwrap().unwrap();
    assert!(server.models().is_empty());
}
