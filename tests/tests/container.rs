//! The container image (docs/operations.md, "Container image"), built here by
//! `scripts/build-image` from the debug binaries the suite built (kiln-server and
//! the plugins the image ships) and run with podman as these
//! machines allow (`--runtime runc --network host`, lowered ulimits), the way the
//! manifests under deploy/ run it: the Deployment's args (`deploy/check
//! --container`; only the two port numbers swapped for free ones, as the host's
//! network is shared), its probes, a read-only root file system, the example
//! models mounted read-only at /mnt/models. It serves `echo` and the ONNX model
//! `silero-vad` (ONNX Runtime inside the image), runs as the unprivileged user the
//! manifests name, and drains to exit status 0 on `podman stop` (SIGTERM).
//! Needs scripts/setup-podman and scripts/setup-kubernetes-validate (scripts/test
//! runs them). Also: every manifest passes deploy/check.

// Test code: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kiln_client::{DataType, HttpClient, InferRequest, InputTensor, Param, ParamValue};
use kiln_tests::{build_dir, cache_dir, model_repository, repo_root};
use serde_json::Value;

const IMAGE: &str = "localhost/kiln:test";

fn run(command: &mut Command) -> Output {
    let out = command.output().expect("run a command");
    assert!(
        out.status.success(),
        "{command:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn podman(args: &[&str]) -> String {
    let out = run(Command::new("podman").args(args));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The container's log: its stdout and stderr (`podman logs` keeps them apart).
fn logs(name: &str) -> String {
    let out = run(Command::new("podman").args(["logs", name]));
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// A free loopback port (bound, read, released).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Copies model `name` of the example repository into `to`, following the links
/// scripts/fetch-models made into .cache (not visible inside the container).
fn copy_model(name: &str, to: &Path) {
    let from = model_repository().join(name);
    run(Command::new("cp").arg("-rL").arg(&from).arg(to));
}

/// The container, removed on drop.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args(["rm", "-f", "-t", "0", &self.0])
            .output();
    }
}

async fn status(url: &str) -> Option<u16> {
    reqwest::get(url).await.ok().map(|r| r.status().as_u16())
}

fn vad_chunk() -> InferRequest {
    let param = |key: &str, value| Param {
        key: key.into(),
        value,
    };
    InferRequest {
        model: "silero-vad".into(),
        inputs: vec![InputTensor::from_slice(
            "input",
            DataType::Fp32,
            &[1, 576],
            &[0.0f32; 576],
        )],
        parameters: vec![
            param("sequence_id", ParamValue::Int(1)),
            param("sequence_start", ParamValue::Bool(true)),
            param("sequence_end", ParamValue::Bool(true)),
        ],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_serves_models_as_the_manifests_run_it_and_drains_on_sigterm() {
    let root = repo_root();
    let built = Instant::now();
    run(Command::new(root.join("scripts/build-image"))
        .args(["--profile", "debug", "--prebuilt", "--tag", IMAGE])
        .env("CARGO_TARGET_DIR", build_dir().parent().unwrap())
        .env("KILN_CACHE", cache_dir()));
    let built = built.elapsed();
    let size = podman(&["image", "inspect", IMAGE, "--format", "{{.Size}}"]);
    eprintln!("image {IMAGE}: {size} bytes, built in {built:?}");

    let spec: Value = serde_json::from_slice(
        &run(Command::new(root.join("deploy/check")).arg("--container")).stdout,
    )
    .unwrap();
    assert_eq!(spec["ports"]["http"], 8080);
    assert_eq!(spec["ports"]["grpc"], 9000);
    assert_eq!(spec["readOnlyRootFilesystem"], true);
    let (http, grpc) = (free_port(), free_port());
    let args: Vec<String> = spec["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| match a.as_str().unwrap() {
            "--http-port=8080" => format!("--http-port={http}"),
            "--grpc-port=9000" => format!("--grpc-port={grpc}"),
            other => other.to_owned(),
        })
        .collect();
    assert!(
        args.iter().any(|a| a == "--model-store=/mnt/models"),
        "{args:?}"
    );

    let models = std::env::temp_dir().join(format!("kiln-container-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&models);
    std::fs::create_dir_all(&models).unwrap();
    copy_model("echo", &models);
    copy_model("silero-vad", &models);
    run(Command::new("chmod").arg("-R").arg("a+rX").arg(&models));

    let name = format!("kiln-test-{}", std::process::id());
    let started = Instant::now();
    let mut command = Command::new("podman");
    command
        .args([
            "run",
            "-d",
            "--name",
            &name,
            "--runtime",
            "runc",
            "--network",
            "host",
        ])
        .args([
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ])
        .arg("--read-only")
        .arg("-v")
        .arg(format!("{}:/mnt/models:ro", models.display()))
        .arg(IMAGE)
        .args(&args);
    run(&mut command);
    let container = Container(name);

    let base = format!("http://127.0.0.1:{http}");
    let probe = |kind: &str| format!("{base}{}", spec["probes"][kind].as_str().unwrap());
    // The startup probe: ready within the manifest's 2 minutes.
    let deadline = Instant::now() + Duration::from_secs(120);
    while status(&probe("startupProbe")).await != Some(200) {
        assert!(
            Instant::now() < deadline,
            "not ready; its log:\n{}",
            logs(&container.0)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("container ready {:?} after podman run", started.elapsed());
    assert_eq!(status(&probe("readinessProbe")).await, Some(200));
    assert_eq!(status(&probe("livenessProbe")).await, Some(200));

    let client = HttpClient::new(&base).unwrap();
    let echo = InferRequest {
        model: "echo".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, 3],
            &[1u32, 2, 3],
        )],
        ..Default::default()
    };
    let answer = client.infer(&echo).await.unwrap();
    assert_eq!(answer.outputs[0].values::<u32>(), [2, 3, 4]);
    let vad = client.infer(&vad_chunk()).await.unwrap();
    let probability = vad.outputs.iter().find(|o| o.name == "output").unwrap();
    let p = probability.values::<f32>()[0];
    assert!((0.0..=1.0).contains(&p), "{p}");
    let grpc_client = kiln_client::GrpcClient::connect(&format!("http://127.0.0.1:{grpc}"))
        .await
        .unwrap();
    assert!(grpc_client.is_ready().await.unwrap());

    // It runs as the manifests' user, not root.
    let pid = podman(&["inspect", &container.0, "--format", "{{.State.Pid}}"]);
    let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = proc_status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    assert_eq!(uid, spec["runAsUser"].to_string());

    // `podman stop` sends SIGTERM (kiln is PID 1): it drains and exits 0.
    podman(&["stop", "-t", "40", &container.0]);
    let code = podman(&["inspect", &container.0, "--format", "{{.State.ExitCode}}"]);
    let log = logs(&container.0);
    assert_eq!(code, "0", "{log}");
    assert!(log.contains("every accepted request was answered"), "{log}");
    let _ = std::fs::remove_dir_all(&models);
}

/// Every manifest under deploy/ passes `deploy/check`: Kubernetes' schemas
/// (kubernetes-validate, strict), KServe's vendored CRDs (strict), and kiln's own
/// rules (probes on /v2/health/*, declared ports, a grace period that covers
/// preStop and --exit-timeout-secs).
#[test]
fn every_manifest_passes_the_offline_checks() {
    let out = run(&mut Command::new(repo_root().join("deploy/check")));
    let report = String::from_utf8_lossy(&out.stdout);
    for manifest in [
        "Deployment kiln",
        "Service kiln",
        "HorizontalPodAutoscaler kiln",
        "ServingRuntime kiln",
        "InferenceService silero-vad",
    ] {
        assert!(
            report.contains(manifest),
            "{manifest} not checked:\n{report}"
        );
    }
}
