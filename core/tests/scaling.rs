//! Scaling a loaded model in place (issue #31, item 4): its instances raised or
//! lowered while it serves, no request failed, the buffer pool resized to match.
//! In process, with the fake worker: its gate holds batches in `run`, so a test
//! sees how many run at once and what a scale down does to busy instances.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::{gate, group_of, params, request, server, Clients, Repository};

/// Long enough for any machine; only a broken scale waits this long.
const HANG: Duration = Duration::from_secs(60);

/// The `kiln_worker_instances` gauge of `model` (read at a scrape).
fn instances_gauge(server: &kiln_core::Server, model: &str) -> Option<i64> {
    let text = server.metrics_text();
    let prefix = format!("kiln_worker_instances{{model=\"{model}\"");
    text.lines()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scaled_up_the_group_runs_batches_at_once_and_scaled_down_lets_them_finish() {
    let server = server();
    let model = server
        .load("fake", params(&[("gate", 31_001), ("batch_size", 1)]))
        .await
        .unwrap();
    let group = group_of(&server, &model);
    assert_eq!((group.instance_count(), group.buffer_sets()), (1, 3));

    server.scale(&model, 4).await.unwrap();
    // The same group (not a reload), with 4 instances and a set per instance and
    // one forming, plus one.
    assert!(Arc::ptr_eq(&group, &group_of(&server, &model)));
    assert_eq!((group.instance_count(), group.buffer_sets()), (4, 9));

    // 4 batches of one request each reach the gate together: 4 instances run.
    let held = gate(31_001);
    let pending: Vec<_> = (0..4u32)
        .map(|i| {
            let server = server.clone();
            let model = model.clone();
            tokio::spawn(async move { server.infer(request(&model, &[i * 10])).await })
        })
        .collect();
    assert!(
        held.wait_arrived_within(4, HANG),
        "4 batches never ran at once on 4 instances"
    );

    // Scaled down while all 4 are busy: the call returns at once, the count is
    // the one asked for, and no buffer set in use is taken.
    server.scale(&model, 1).await.unwrap();
    assert_eq!((group.instance_count(), group.buffer_sets()), (1, 3));
    held.open();
    for (i, answer) in pending.into_iter().enumerate() {
        let answer = answer
            .await
            .unwrap()
            .expect("a batch in flight is answered");
        assert_eq!(answer.outputs[0].values::<u32>(), vec![i as u32 * 10 + 1]);
    }
    // The three that left after their batch no longer count as running.
    let deadline = std::time::Instant::now() + HANG;
    while instances_gauge(&server, &model) != Some(1) {
        assert!(std::time::Instant::now() < deadline, "instances never left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The one left serves.
    let answer = server.infer(request(&model, &[41])).await.unwrap();
    assert_eq!(answer.outputs[0].values::<u32>(), vec![42]);
    // And the model's configuration says so.
    let config =
        kiln_core::triton::ModelConfig::of(&kiln_core::models::Served::Group(group.clone()));
    assert_eq!(config.instance_group.unwrap().1, 1);
    assert!(config.parameters.contains(&("max_buffers", "3".to_owned())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reload_that_changes_only_instances_scales_the_running_group() {
    let repo = Repository::new("scale-reload");
    let server = repo.server();
    server
        .load_model("fake", Some(1), Vec::new())
        .await
        .unwrap();
    let group = group_of(&server, "fake");
    for n in [3, 1, 2] {
        server
            .load_model("fake", Some(1), params(&[("instances", n)]))
            .await
            .unwrap();
        // Still the group first loaded: scaled, not replaced.
        assert!(Arc::ptr_eq(&group, &group_of(&server, "fake")));
        assert_eq!(group.instance_count(), n as usize);
        assert_eq!(group.buffer_sets(), 2 * n as usize + 1);
    }
    // Any other change is a reload: a new group takes the name.
    server
        .load_model(
            "fake",
            Some(1),
            params(&[("instances", 2), ("batch_size", 3)]),
        )
        .await
        .unwrap();
    assert!(!Arc::ptr_eq(&group, &group_of(&server, "fake")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scaling_under_load_fails_no_request() {
    let server = server();
    let model = server.load("fake", Vec::new()).await.unwrap();
    let mut clients = Clients::start(&server, &model, 16);
    let mut answered = 0;
    for n in [4, 1, 3, 2, 4, 1] {
        server.scale(&model, n).await.unwrap();
        // Each step serves before the next: answers came at this size.
        answered = clients.answered_past(answered).await;
    }
    clients.none_failed().await;
    let group = group_of(&server, &model);
    assert_eq!((group.instance_count(), group.buffer_sets()), (1, 3));
}

#[tokio::test]
async fn a_scale_beyond_the_limits_or_to_zero_is_refused_and_changes_nothing() {
    let server = server();
    let model = server.load("fake", Vec::new()).await.unwrap();
    let group = group_of(&server, &model);
    let zero = server.scale(&model, 0).await.unwrap_err();
    assert!(zero.to_string().contains("at least 1"), "{zero}");
    let too_many = server.scale(&model, 100_000).await.unwrap_err();
    assert!(
        too_many.to_string().contains("--max-instances-per-model"),
        "{too_many}"
    );
    assert_eq!((group.instance_count(), group.buffer_sets()), (1, 3));
    let unknown = server.scale("nothing-here", 2).await.unwrap_err();
    assert!(unknown.to_string().contains("no model"), "{unknown}");
}
