//! kiln-client without its `embedded` feature does not pull in the server: no
//! kiln-server, no actix-web (the protocol's codecs come from kiln-protocol).
//! Read from `cargo tree`, offline, over the workspace's Cargo.lock.

use std::path::Path;
use std::process::Command;

#[test]
fn the_client_does_not_depend_on_the_server() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let tree = |package: &str, features: &[&str]| {
        let output = Command::new(&cargo)
            .current_dir(&workspace)
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
    };
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
