//! The load generator drives the real server (HTTP) and an embedded one, and
//! reports what it measured.

// `run_load` is test support: a failed run should fail the test loudly.
#![allow(clippy::expect_used)]

use std::process::Command;

use kiln_tests::{build_dir, Kiln};
use serde_json::Value;

/// Runs kiln-load for 1 s (`--model echo --input INPUT0:UINT32:1x16` unless `args`
/// name their own) and returns its JSON lines.
fn run_load(args: &[&str]) -> Vec<Value> {
    let mut defaults = vec!["--duration", "1", "--warmup", "0.2", "--json"];
    if !args.contains(&"--model") {
        defaults.extend(["--model", "echo"]);
    }
    if !args.contains(&"--input") {
        defaults.extend(["--input", "INPUT0:UINT32:1x16"]);
    }
    let output = Command::new(build_dir().join("kiln-load"))
        .args(defaults)
        .args(args)
        .output()
        .expect("run kiln-load (cargo build --workspace first)");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per run"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_closed_and_open_loop() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let runs = run_load(&["--url", &kiln.url, "--concurrency", "1,4"]);
    assert_eq!(runs.len(), 2);
    for run in &runs {
        assert!(run["requests"].as_u64().unwrap() > 0, "{run}");
        assert_eq!(run["errors"], serde_json::json!({}), "{run}");
        // Latencies were measured: a run that recorded none reports 0.
        assert!(run["p50_ms"].as_f64().unwrap() > 0.0, "{run}");
    }
    assert_eq!(runs[1]["concurrency"], 4);
    // Binary tensor data both ways.
    let binary = run_load(&["--url", &kiln.url, "--binary", "--concurrency", "2"]);
    assert_eq!(binary[0]["mode"], "http-binary");
    assert!(binary[0]["requests"].as_u64().unwrap() > 0, "{}", binary[0]);
    assert_eq!(binary[0]["errors"], serde_json::json!({}), "{}", binary[0]);
    // Compressed answers are read through like plain ones.
    let args = ["--url", &kiln.url, "--binary", "--accept-encoding", "gzip"];
    let gzip = run_load(&args);
    assert!(gzip[0]["requests"].as_u64().unwrap() > 0, "{}", gzip[0]);
    assert_eq!(gzip[0]["errors"], serde_json::json!({}), "{}", gzip[0]);
    // Open loop at 199/s: every scheduled request is sent, late or not, so the
    // count is the schedule's, however fast the machine: 40 in the 0.2 s warmup
    // (at 0, 1/199, …, 39/199 s) and 199 in the measured second (40/199 to
    // 238/199 s; no start falls on either boundary).
    let success = || async {
        let text = kiln.client.metrics().await.unwrap();
        kiln_tests::requests_outcome(&text, "echo", "success").unwrap()
    };
    let before = success().await;
    let open = run_load(&["--url", &kiln.url, "--concurrency", "4", "--rate", "199"]);
    assert_eq!(open[0]["errors"], serde_json::json!({}), "{}", open[0]);
    assert_eq!(open[0]["requests"], 199, "{}", open[0]);
    assert_eq!(
        success().await - before,
        239.0,
        "warmup and measured requests"
    );
    let text = kiln.client.metrics().await.unwrap();
    // Labelled as Triton's: model and version.
    assert!(
        text.contains("kiln_requests_total{model=\"echo\",version=\"1\",outcome=\"success\"}"),
        "{text}"
    );
}

/// Over gRPC, unary and streaming, through the load generator's own HTTP/2 client
/// and through tonic's, with small and 64 KiB tensors (beyond HTTP/2's default
/// 64 KiB window, so flow control is exercised); an unknown model is counted as
/// the error it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_over_grpc() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let url = kiln.grpc_url.as_str();
    let cases: [(&[&str], &str); 4] = [
        (&["--grpc"], "grpc"),
        (&["--grpc", "--streaming"], "grpc-stream"),
        (&["--grpc", "--tonic"], "grpc-tonic"),
        (&["--grpc", "--streaming", "--tonic"], "grpc-stream-tonic"),
    ];
    for (flags, mode) in cases {
        for input in ["INPUT0:UINT32:1x16", "INPUT0:UINT32:1x16384"] {
            let mut args = vec!["--grpc-url", url, "--concurrency", "2", "--input", input];
            args.extend_from_slice(flags);
            let run = &run_load(&args)[0];
            assert_eq!(run["mode"], mode);
            assert!(run["requests"].as_u64().unwrap() > 0, "{run}");
            assert_eq!(run["errors"], serde_json::json!({}), "{run}");
        }
    }
    for (flags, error) in [
        (&["--grpc"][..], "gRPC NotFound"),
        (
            &["--grpc", "--streaming"][..],
            "stream error: no model `nope` is loaded",
        ),
    ] {
        let mut args = vec!["--grpc-url", url, "--model", "nope"];
        args.extend_from_slice(flags);
        let run = &run_load(&args)[0];
        assert_eq!(run["requests"], 0, "{run}");
        assert!(run["errors"][error].as_u64().unwrap() > 0, "{run}");
    }
}

#[test]
fn load_generator_in_process() {
    let runs = run_load(&[
        "--in-process",
        "--load",
        "echo:batch_size=8",
        "--concurrency",
        "8",
    ]);
    assert_eq!(runs[0]["mode"], "in-process");
    assert!(runs[0]["requests"].as_u64().unwrap() > 0);
    assert_eq!(runs[0]["errors"], serde_json::json!({}));
}

/// `--load` reads its spec as `kiln serve --load` does: a bracketed list is one
/// parameter, and a bracket left open is refused, naming the problem.
#[test]
fn load_generator_in_process_load_spec() {
    let runs = run_load(&[
        "--in-process",
        "--load",
        "echo:batcher=dynamic,preferred_batch_size=[4,8],batch_size=8",
        "--concurrency",
        "8",
    ]);
    assert!(runs[0]["requests"].as_u64().unwrap() > 0, "{}", runs[0]);
    assert_eq!(runs[0]["errors"], serde_json::json!({}));
    let output = Command::new(build_dir().join("kiln-load"))
        .args(["--in-process", "--load", "echo:preferred_batch_size=[4,8"])
        .args(["--model", "echo", "--input", "INPUT0:UINT32:1x16"])
        .args(["--duration", "1", "--json"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("without its `]`"), "{stderr}");
}

/// `accumulate` served as a stateful model (the sequence batcher).
const ACCUMULATE: &str = "accumulate:batcher=sequence,batch_size=8,state.STATE=STATE_OUT,\
control.start=START,control.end=END,control.ready=READY,control.corrid=CORRID";

/// Sequence runs over every protocol: each request carries its own `sequence_id`,
/// `sequence_start` and `sequence_end`, so the sequence batcher takes them all;
/// the same load without them is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_sequences() {
    let kiln = Kiln::start(&["--load", ACCUMULATE]);
    let (url, grpc_url) = (kiln.url.as_str(), kiln.grpc_url.as_str());
    let cases: [(&[&str], &str); 5] = [
        (&["--url", url], "http"),
        (&["--url", url, "--binary"], "http-binary"),
        (&["--grpc-url", grpc_url, "--grpc"], "grpc-tonic"),
        (
            &["--grpc-url", grpc_url, "--grpc", "--streaming"],
            "grpc-stream-tonic",
        ),
        (&["--in-process", "--load", ACCUMULATE], "in-process"),
    ];
    for (flags, mode) in cases {
        let mut args = vec!["--model", "accumulate", "--input", "INPUT:FP32:1x1"];
        args.extend_from_slice(&["--concurrency", "2", "--sequence-length", "3"]);
        args.extend_from_slice(flags);
        let run = &run_load(&args)[0];
        assert_eq!(run["mode"], mode);
        assert!(run["requests"].as_u64().unwrap() > 0, "{run}");
        assert_eq!(run["errors"], serde_json::json!({}), "{run}");
    }
    for flags in [&["--url", url][..], &["--grpc-url", grpc_url, "--grpc"]] {
        let mut args = vec!["--model", "accumulate", "--input", "INPUT:FP32:1x1"];
        args.extend_from_slice(flags);
        let run = &run_load(&args)[0];
        assert_eq!(run["requests"], 0, "{run}");
        assert!(!run["errors"].as_object().unwrap().is_empty(), "{run}");
    }
}

/// `--server-pid` (from `/proc/PID/stat`) and `--server-cpu` (from the server's
/// `process_cpu_seconds_total`) report the real server's CPU per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_reports_server_cpu_per_request() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let pid = kiln.pid().to_string();
    let (url, grpc_url) = (kiln.url.as_str(), kiln.grpc_url.as_str());
    let cases: [&[&str]; 3] = [
        &["--url", url, "--server-pid", &pid],
        &["--url", url, "--server-cpu"],
        &[
            "--grpc",
            "--grpc-url",
            grpc_url,
            "--server-metrics",
            &format!("{url}/metrics"),
        ],
    ];
    for flags in cases {
        let mut args = vec!["--concurrency", "4"];
        args.extend_from_slice(flags);
        let run = &run_load(&args)[0];
        assert!(run["requests"].as_u64().unwrap() > 0, "{run}");
        assert_eq!(run["errors"], serde_json::json!({}), "{run}");
        let per_request = run["server_cpu_us_per_request"].as_f64().unwrap_or(0.0);
        assert!(per_request > 0.0, "{flags:?}: {run}");
        assert!(
            run["server_cpu_seconds"].as_f64().unwrap_or(0.0) > 0.0,
            "{run}"
        );
    }
    // The text report carries it too; without the flags it is absent.
    let text = |extra: &[&str]| {
        let mut args = vec!["--url", url, "--duration", "0.5", "--warmup", "0"];
        args.extend_from_slice(&["--model", "echo", "--input", "INPUT0:UINT32:1x16"]);
        let output = Command::new(build_dir().join("kiln-load"))
            .args(args)
            .args(extra)
            .output()
            .expect("run kiln-load");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    assert!(text(&["--server-pid", &pid]).contains("us/req"));
    assert!(!text(&[]).contains("server_cpu"));
    // A process that is not there is an error, not a silent 0.
    let output = Command::new(build_dir().join("kiln-load"))
        .args(["--url", url, "--duration", "0.2", "--warmup", "0"])
        .args(["--input", "INPUT0:UINT32:1x16", "--server-pid", "0"])
        .output()
        .expect("run kiln-load");
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("/proc/0/stat"),
        "{output:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_stream_sessions() {
    let kiln = kiln_tests::stream::invert_video(&[]);
    let runs = run_load(&[
        "--url",
        &kiln.url,
        "--stream",
        "--model",
        "invert-video",
        "--frame-size",
        "64x48",
        "--concurrency",
        "1,3",
    ]);
    assert_eq!(runs.len(), 2);
    for (run, sessions) in runs.iter().zip([1, 3]) {
        assert_eq!(run["mode"], "stream");
        assert_eq!(run["sessions"], sessions);
        assert!(run["frames"].as_u64().expect("frames") > 0, "{run}");
        assert_eq!(run["errors"], 0, "{run}");
        assert_eq!(run["dropped"], 0, "closed loop: nothing dropped: {run}");
        assert!(run["p99_ms"].as_f64().expect("p99") >= run["p50_ms"].as_f64().expect("p50"));
        assert!(
            run["mean_batch"].as_f64().expect("mean batch") >= 1.0,
            "{run}"
        );
    }
}
