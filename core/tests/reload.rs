//! A model reloaded under load fails no request: a request that found the old
//! group in the snapshot just before the swap is answered by the new one.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kiln_core::observe::trace::Trace;
use support::{params, request, Clients, Repository};

#[tokio::test]
async fn a_request_that_found_the_replaced_group_is_answered_by_the_new_one() {
    let repo = Repository::new("late-request");
    let server = repo.server();
    server
        .load_model("fake", Some(1), Vec::new())
        .await
        .unwrap();
    // What an ingress holds between its lookup and its submit.
    let old = server.model("fake").unwrap();
    server
        .load_model("fake", Some(2), Vec::new())
        .await
        .unwrap();
    let (pending, ()) = kiln_core::request::serve::submit(
        &old,
        Ok((request("fake", &[4]), ())),
        &mut Trace::default(),
    )
    .expect("the replaced group hands the request on");
    let response = pending.await.unwrap();
    assert_eq!(response.model_version, "2");
    assert_eq!(response.outputs[0].values::<u32>(), vec![5]);
    // Unloaded, not replaced: refused.
    server.unload("fake").await.unwrap();
    let gone = server.model("fake");
    assert!(gone.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reloads_under_load_fail_no_request() {
    let repo = Repository::new("reloads");
    let server = repo.server();
    server
        .load_model("fake", Some(1), Vec::new())
        .await
        .unwrap();
    let clients = Clients::start(&server, "fake", 16);
    for i in 0..20i64 {
        // Alternate the parameters and the version: each load replaces the group.
        let version = 1 + (i as u64 % 2);
        server
            .load_model("fake", Some(version), params(&[("batch_size", 4 + i % 2)]))
            .await
            .unwrap();
        tokio::task::yield_now().await;
    }
    let answered = clients.none_failed().await;
    println!("{answered} requests answered across 20 reloads, none failed");
}
