//! Triton's own load generator, `perf_analyzer` (PyPI's perf-analyzer 2.60.0,
//! made runnable by `scripts/setup-perf-analyzer`), against kiln serving a Triton
//! repository (`config.pbtxt`, Triton's flags) over HTTP and gRPC: it reads the
//! model's metadata and config, makes its own requests from them, and measures.
//! A short count-based measurement, no timed assertion: it must finish and count
//! answers.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use kiln_tests::fixtures::TempRepository;
use kiln_tests::{cache_dir, Kiln};

/// The PP-OCR classifier as Triton's documentation writes configs: fixed image
/// dims, so that perf_analyzer makes its inputs from the config alone.
const OCR_CLS: &str = r#"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 48, 192 ] } ]
output [ { name: "save_infer_model/scale_0.tmp_1" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching { }
instance_group [ { count: 1, kind: KIND_CPU } ]
"#;

/// Runs perf_analyzer with `args`; panics with its output (and kiln's log) unless
/// it exits 0. Returns its standard output.
fn perf_analyzer(kiln: &Kiln, args: &[&str]) -> String {
    let binary = cache_dir().join("perf-analyzer-2.60.0/perf_analyzer");
    assert!(
        binary.is_file(),
        "{} is missing: run scripts/setup-perf-analyzer",
        binary.display()
    );
    let output = Command::new(&binary).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "perf_analyzer {args:?} failed:\n{stdout}\n{}\nkiln's log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        kiln.log()
    );
    stdout
}

/// The `Throughput: N infer/sec` perf_analyzer reports for its one measurement.
fn throughput(report: &str) -> f64 {
    report
        .lines()
        .find_map(|l| l.trim().strip_prefix("Throughput:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no throughput in perf_analyzer's report:\n{report}"))
}

#[test]
fn perf_analyzer_measures_a_triton_repository_over_http_and_grpc() {
    let repo = TempRepository::new(&[]);
    repo.write_triton("ocr_cls", OCR_CLS, &[1]);
    // Triton's flags, as KServe's Triton runtime starts its server.
    let kiln = Kiln::start(&[
        "--model-store",
        &repo.arg(),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "ocr_cls",
    ]);
    let host_port = |url: &str| url.trim_start_matches("http://").to_owned();
    for (protocol, url) in [
        ("http", host_port(&kiln.url)),
        ("grpc", host_port(&kiln.grpc_url)),
    ] {
        let report = perf_analyzer(
            &kiln,
            &[
                "-m",
                "ocr_cls",
                "-u",
                &url,
                "-i",
                protocol,
                "-b",
                "2",
                "--concurrency-range",
                "2",
                "--measurement-mode",
                "count_windows",
                "--measurement-request-count",
                "50",
                // Any measurement is stable: this checks that it runs, not how fast.
                "--stability-percentage",
                "1000",
                "--max-trials",
                "3",
            ],
        );
        println!("perf_analyzer over {protocol}:\n{report}");
        assert!(throughput(&report) > 0.0, "{protocol}:\n{report}");
    }
}
