//! Upgrades under load (issue #31, "upgrades under load with zero failed
//! requests"): a repository model reloaded with new parameters and versions, and a
//! worker whose library was rebuilt and loaded again under the same name, while 16
//! clients call it over HTTP throughout. Every answer is counted: none may fail.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use kiln_tests::clients::Clients;
use kiln_tests::{build_dir, Kiln};
use serde_json::json;

const CLIENTS: u32 = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repository_model_reloaded_under_load_fails_no_request() {
    let root = std::env::temp_dir().join(format!("kiln-upgrade-repo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for version in ["1", "2"] {
        std::fs::create_dir_all(root.join("echo").join(version)).unwrap();
    }
    std::fs::write(root.join("echo/config.toml"), "worker = \"echo\"\n").unwrap();
    let kiln = Kiln::start(&[
        "--model-repository",
        root.to_str().unwrap(),
        "--load-model",
        "echo",
    ]);
    let running = Clients::start(&kiln.client, "echo", CLIENTS);
    for i in 0..20 {
        // Alternating the batch size and the version: each load replaces the group.
        let parameters = json!({"batch_size": 4 + i % 2, "version": 1 + i % 2});
        kiln.client.load_model("echo", &parameters).await.unwrap();
    }
    running.none_failed("20 reloads").await;
    let _ = std::fs::remove_dir_all(&root);
}

/// Puts `from` at `to` as an operator installs a new build: a new file renamed over
/// the old one.
fn install(from: &Path, to: &Path) {
    let staged = to.with_extension("so.new");
    std::fs::copy(from, &staged).unwrap();
    std::fs::rename(&staged, to).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebuilt_worker_loaded_again_under_load_fails_no_request() {
    let dir = std::env::temp_dir().join(format!("kiln-upgrade-plugin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libkiln_worker_swap.so");
    install(&build_dir().join("libkiln_worker_echo.so"), &lib);
    let kiln = Kiln::start(&["--plugin-dir", dir.to_str().unwrap()]);
    let c = &kiln.client;
    assert_eq!(c.load("swap", &json!({})).await.unwrap(), "swap");
    let running = Clients::start(c, "swap", CLIENTS);
    for _ in 0..5 {
        // A new build of the same worker under the same name: the endpoint's group
        // is replaced by one running the new library.
        install(&build_dir().join("libkiln_worker_echo.so"), &lib);
        assert_eq!(c.load("swap", &json!({})).await.unwrap(), "swap");
    }
    running.none_failed("5 rebuilds").await;
    let log = kiln.log();
    assert_eq!(
        log.matches("its worker's library was rebuilt").count(),
        5,
        "{log}"
    );
    assert_eq!(c.models().await.unwrap(), ["swap"]);
    let _ = std::fs::remove_dir_all(&dir);
}
