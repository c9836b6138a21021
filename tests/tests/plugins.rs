//! Plugin loading refuses what is not a kiln plugin, with an error and no crash.

use std::path::Path;

use kiln_tests::{build_dir, Kiln};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_mismatched_and_escaping_libraries_are_refused() {
    let dir = std::env::temp_dir().join(format!("kiln-plugins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Not a library at all.
    std::fs::write(dir.join("libkiln_worker_garbage.so"), b"\x7fELF not really").unwrap();
    // A real shared library that is not a kiln plugin (zlib: dpkg depends on it).
    let zlib = [
        "/usr/lib/x86_64-linux-gnu/libz.so.1",
        "/lib/x86_64-linux-gnu/libz.so.1",
        "/usr/lib/libz.so.1",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("zlib is present on Debian");
    std::fs::copy(zlib, dir.join("libkiln_worker_foreign.so")).unwrap();
    // A link that leads out of the plugin directory.
    let _ = std::fs::remove_file(dir.join("libkiln_worker_escape.so"));
    std::os::unix::fs::symlink(
        build_dir().join("libkiln_worker_echo.so"),
        dir.join("libkiln_worker_escape.so"),
    )
    .unwrap();

    let dir_arg = dir.to_str().unwrap().to_owned();
    let kiln = Kiln::start(&["--plugin-dir", &dir_arg]);
    let c = &kiln.client;
    for (worker, status, want) in [
        ("garbage", 400, "is not a kiln plugin"),
        ("foreign", 400, "is not a kiln plugin"),
        ("mismatched", 400, "does not match this server's plugin ABI"),
        ("escape", 404, "no plugin for worker `escape`"),
    ] {
        let err = c.load(worker, &json!({})).await.unwrap_err();
        assert_eq!(err.status(), Some(status), "{worker}: {err}");
        assert!(err.to_string().contains(want), "{worker}: {err}");
    }
    // The server is unharmed and real plugins still load.
    assert!(c.is_ready().await.unwrap());
    assert_eq!(c.load("echo", &json!({})).await.unwrap(), "echo");
    let _ = std::fs::remove_dir_all(&dir);
}
