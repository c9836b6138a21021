//! Compatibility with NVIDIA's own client: `tritonclient` (HTTP and gRPC) drives the
//! real `kiln` binary through `tests/tritonclient/*.py` (pytest, in the virtualenv
//! `scripts/setup-tritonclient` creates).

use std::process::Command;

use kiln_tests::fixtures::TempRepository;
use kiln_tests::{cache_dir, repo_root, Kiln};

#[test]
fn tritonclient_http_and_grpc() {
    let python = cache_dir().join("tritonclient-venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup-tritonclient",
        python.display()
    );
    let repo = TempRepository::new(&[("echo-repo", "worker = \"echo\"\n", &[1, 2])]);
    let descriptor = repo.path().join("inference.desc");
    std::fs::write(&descriptor, kiln_server::grpc::FILE_DESCRIPTOR_SET).unwrap();
    let kiln = Kiln::start(&[
        "--model-repository",
        &repo.arg(),
        "--load",
        "echo-multi",
        "--load",
        "echo",
        "--load",
        "faulty:batch_size=1,max_buffers=1,queue_size=3",
        "--load",
        "accumulate:batcher=sequence,state.STATE=STATE_OUT,control.start=START,\
         control.end=END,control.ready=READY,control.corrid=CORRID",
    ]);
    let host_port = |url: &str| url.trim_start_matches("http://").to_owned();
    let output = Command::new(&python)
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/tritonclient",
        ])
        .current_dir(repo_root())
        .env("KILN_HTTP_URL", host_port(&kiln.url))
        .env("KILN_GRPC_URL", host_port(&kiln.grpc_url))
        .env("KILN_PROTO_DESCRIPTOR", &descriptor)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "pytest failed:\n{stdout}\n{}\nkiln's log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        kiln.log()
    );
    println!("{stdout}");
}
