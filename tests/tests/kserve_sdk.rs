//! The KServe Python SDK (kserve 0.21, in the virtualenv
//! `scripts/setup-tritonclient` creates) against kiln serving a Triton repository
//! in explicit model control: the SDK's repository calls load and unload the
//! model, its `InferenceGRPCClient` checks readiness and infers
//! (`tests/kserve/test_kserve_sdk.py`).

use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;

#[test]
fn kserve_sdk_loads_infers_and_unloads_a_triton_model() {
    let repo = TempRepository::new(&[]);
    repo.write_triton(
        "ocr_cls",
        "platform: \"onnxruntime_onnx\"\nmax_batch_size: 4\n\
         input [ { name: \"x\" data_type: TYPE_FP32 dims: [ 3, 48, 192 ] } ]\n",
        &[1],
    );
    // As KServe's Triton runtime starts its server.
    let kiln = Kiln::start(&[
        "--model-store",
        &repo.arg(),
        "--model-control-mode",
        "explicit",
    ]);
    kiln_tests::pytest::run_pytest(&kiln, "tests/kserve", &[]);
}
