//! The crates' layout holds: kiln-client without its `embedded` feature does not
//! pull in the server (no kiln-server, no actix-web: the protocol's codecs come from
//! kiln-protocol) nor the plugin ABI (no abi_stable: the data model's types come from
//! kiln-types); kiln-core has no transport; no crate's modules import each
//! other in a circle. Read from `cargo tree`, offline, over the workspace's
//! Cargo.lock, and from `scripts/check-module-cycles`.

#![allow(clippy::unwrap_used)] // helpers of tests: a failure is the test failing

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The packages `package` depends on at run time (`name vX.Y.Z` a line), with
/// `features` given to cargo.
fn tree(package: &str, features: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(&cargo)
        .current_dir(workspace())
        .args(["tree", "--offline", "-e", "normal", "--prefix", "none"])
        .args(["--format", "{p}", "-p", package, "--no-default-features"])
        .args(features)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn the_client_does_not_depend_on_the_server() {
    let server_side = |tree: &str| -> Vec<String> {
        tree.lines()
            .filter(|line| line.starts_with("actix") || line.starts_with("kiln-server "))
            .map(str::to_owned)
            .collect()
    };
    let client = tree("kiln-client", &[]);
    assert!(client.starts_with("kiln-client "), "{client}");
    assert!(client.contains("\nkiln-protocol "), "{client}");
    assert_eq!(server_side(&client), Vec::<String>::new(), "{client}");
    let protocol = tree("kiln-protocol", &[]);
    assert_eq!(server_side(&protocol), Vec::<String>::new(), "{protocol}");
    // The check sees the server where it is: with `embedded`.
    let embedded = tree("kiln-client", &["--features", "embedded"]);
    assert!(
        server_side(&embedded)
            .iter()
            .any(|l| l.starts_with("kiln-server ")),
        "{embedded}"
    );
}

#[test]
fn the_client_has_no_plugin_abi() {
    let abi = |tree: &str| -> Vec<String> {
        tree.lines()
            .filter(|line| line.starts_with("abi_stable") || line.starts_with("kiln-worker-sdk "))
            .map(str::to_owned)
            .collect()
    };
    let client = tree("kiln-client", &[]);
    assert!(client.starts_with("kiln-client "), "{client}");
    assert!(client.contains("\nkiln-types "), "{client}");
    assert_eq!(abi(&client), Vec::<String>::new(), "{client}");
    let protocol = tree("kiln-protocol", &["--features", "http,grpc"]);
    assert_eq!(abi(&protocol), Vec::<String>::new(), "{protocol}");
    // The check sees the ABI where it is: in the SDK, through kiln-types' `abi`.
    let sdk = tree("kiln-worker-sdk", &[]);
    assert!(sdk.contains("\nabi_stable "), "{sdk}");
}

#[test]
fn the_core_has_no_transport_and_no_codec() {
    let core = tree("kiln-core", &[]);
    assert!(core.starts_with("kiln-core "), "{core}");
    // The data model comes from kiln-protocol, without its http and grpc features.
    assert!(core.contains("\nkiln-protocol "), "{core}");
    let transport: Vec<&str> = core
        .lines()
        .filter(|line| {
            [
                "actix",
                "tonic",
                "hyper",
                "h2 ",
                // prost (and prost-reflect) are in kiln-core for one file format,
                // not a wire: Triton's config.pbtxt, protobuf text format, read by the
                // model repository (core/src/load/triton_config). No gRPC codec: tonic
                // stays out.
                "serde_json ",
                "kiln-server ",
            ]
            .iter()
            .any(|name| line.starts_with(name))
        })
        .collect();
    assert_eq!(transport, Vec::<&str>::new(), "{core}");
}

#[test]
fn no_module_circles() {
    let crates = [
        "types/src",
        "worker-sdk/src",
        "buffers/src",
        "batchers/src",
        "protocol/src",
        "core/src",
        "server/src",
        "client/src",
        "media/src",
        "jobs/src",
    ];
    let output = Command::new("python3")
        .current_dir(workspace())
        .arg("scripts/check-module-cycles")
        .args(crates)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
