//! Compatibility with NVIDIA's own client: `tritonclient` (HTTP and gRPC) drives the
//! real `kiln` binary through `tests/tritonclient/*.py` (pytest, in the virtualenv
//! `scripts/setup-tritonclient` creates).

use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;

#[test]
fn tritonclient_http_and_grpc() {
    let repo = TempRepository::new(&[("echo-repo", "worker = \"echo\"\n", &[1, 2])]);
    // A Triton folder (tests/tritonclient/test_triton_repository.py): the
    // ensemble whose answers from Triton 2.51 tests/fixtures/triton recorded.
    let fixtures = kiln_tests::repo_root().join("tests/fixtures/triton");
    std::fs::create_dir_all(repo.path().join("pipe/1")).unwrap();
    std::fs::copy(
        fixtures.join("pipe.config.pbtxt"),
        repo.path().join("pipe/config.pbtxt"),
    )
    .unwrap();
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
    kiln_tests::pytest::run_pytest(
        &kiln,
        "tests/tritonclient",
        &[("KILN_PROTO_DESCRIPTOR", descriptor.as_os_str())],
    );
}
