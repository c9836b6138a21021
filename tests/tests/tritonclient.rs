//! Compatibility with NVIDIA's own client: `tritonclient` (HTTP and gRPC) drives the
//! real `kiln` binary through `tests/tritonclient/*.py` (pytest, in the virtualenv
//! `scripts/setup-tritonclient` creates).

use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;

#[test]
fn tritonclient_http_and_grpc() {
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
    kiln_tests::pytest::run_pytest(
        &kiln,
        "tests/tritonclient",
        &[("KILN_PROTO_DESCRIPTOR", descriptor.as_os_str())],
    );
}
