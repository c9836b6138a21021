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
//! Two such containers on one Redis (`--jobs=redis://...`, deploy/kubernetes/redis.yaml)
//! share one job queue: jobs submitted to one are run by the other, and both
//! serve realtime requests beside it.
//! Needs scripts/setup-podman and scripts/setup-kubernetes-validate (scripts/test
//! runs them). Also: every manifest passes deploy/check.

// Test code: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Once;
use std::time::{Duration, Instant};

use kiln_client::{DataType, HttpClient, InferRequest, InputTensor, Param, ParamValue};
use kiln_tests::jobs::{
    echo_job, echoed, json_lines, list_all, submit_ok, wait_finished, ADMIN_ARG,
};
use kiln_tests::redis::RedisServer;
use kiln_tests::{build_dir, cache_dir, metric, model_repository, repo_root};
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

/// Builds the image once per test process (the tests share it).
fn build_image() {
    static BUILT: Once = Once::new();
    BUILT.call_once(|| {
        let built = Instant::now();
        run(Command::new(repo_root().join("scripts/build-image"))
            .args(["--profile", "debug", "--prebuilt", "--tag", IMAGE])
            .env("CARGO_TARGET_DIR", build_dir().parent().unwrap())
            .env("KILN_CACHE", cache_dir()));
        let size = podman(&["image", "inspect", IMAGE, "--format", "{{.Size}}"]);
        eprintln!(
            "image {IMAGE}: {size} bytes, built in {:?}",
            built.elapsed()
        );
    });
}

/// The Deployment's kiln container as `deploy/check --container` gives it.
fn manifest() -> Value {
    let out = run(Command::new(repo_root().join("deploy/check")).arg("--container"));
    let spec: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(spec["ports"]["http"], 8080);
    assert_eq!(spec["ports"]["grpc"], 9000);
    assert_eq!(spec["readOnlyRootFilesystem"], true);
    spec
}

/// A free loopback port (bound, read, released).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A model repository holding copies of the example `models` (following the
/// links scripts/fetch-models made into .cache, not visible in the container).
fn repository(name: &str, models: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for model in models {
        run(Command::new("cp")
            .arg("-rL")
            .arg(model_repository().join(model))
            .arg(&dir));
    }
    run(Command::new("chmod").arg("-R").arg("a+rX").arg(&dir));
    dir
}

/// A running container of the image, removed on drop.
struct Container {
    name: String,
    grpc: u16,
    url: String,
}

impl Container {
    /// Runs the image as these machines allow, with the manifest's args (its
    /// ports swapped for free ones) and `more`, `models` mounted read-only at
    /// /mnt/models and a read-only root file system.
    fn start(name: &str, spec: &Value, models: &Path, more: &[String]) -> Container {
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
            .chain(more.iter().cloned())
            .collect();
        let name = format!("kiln-test-{name}-{}", std::process::id());
        let _ = Command::new("podman").args(["rm", "-f", &name]).output();
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
        Container {
            name,
            grpc,
            url: format!("http://127.0.0.1:{http}"),
        }
    }

    /// The URL of the manifest's probe `kind` (`startupProbe`, ...).
    fn probe(&self, spec: &Value, kind: &str) -> String {
        format!("{}{}", self.url, spec["probes"][kind].as_str().unwrap())
    }

    /// Waits for the startup probe's 200, within the manifest's 2 minutes.
    async fn wait_started(&self, spec: &Value) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while status(&self.probe(spec, "startupProbe")).await != Some(200) {
            assert!(Instant::now() < deadline, "not ready:\n{}", self.logs());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Its log: stdout and stderr (`podman logs` keeps them apart).
    fn logs(&self) -> String {
        let out = run(Command::new("podman").args(["logs", &self.name]));
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    }

    /// `podman stop` (SIGTERM; kiln is PID 1): the exit code once it has stopped.
    fn stop(&self) -> String {
        podman(&["stop", "-t", "40", &self.name]);
        podman(&["inspect", &self.name, "--format", "{{.State.ExitCode}}"])
    }

    /// The uid kiln runs as, read from the host's /proc.
    fn uid(&self) -> String {
        let pid = podman(&["inspect", &self.name, "--format", "{{.State.Pid}}"]);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap();
        line.split_whitespace().next().unwrap().to_owned()
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args(["rm", "-f", "-t", "0", &self.name])
            .output();
    }
}

async fn status(url: &str) -> Option<u16> {
    reqwest::get(url).await.ok().map(|r| r.status().as_u16())
}

fn echo_request() -> InferRequest {
    InferRequest {
        model: "echo".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, 3],
            &[1u32, 2, 3],
        )],
        ..Default::default()
    }
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
    build_image();
    let spec = manifest();
    assert!(
        spec["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--model-store=/mnt/models"),
        "{spec}"
    );
    let models = repository("container", &["echo", "silero-vad"]);
    let started = Instant::now();
    let kiln = Container::start("serve", &spec, &models, &[]);
    kiln.wait_started(&spec).await;
    eprintln!("container ready {:?} after podman run", started.elapsed());
    assert_eq!(
        status(&kiln.probe(&spec, "readinessProbe")).await,
        Some(200)
    );
    assert_eq!(status(&kiln.probe(&spec, "livenessProbe")).await, Some(200));

    let client = HttpClient::new(&kiln.url).unwrap();
    let answer = client.infer(&echo_request()).await.unwrap();
    assert_eq!(answer.outputs[0].values::<u32>(), [2, 3, 4]);
    // An ONNX model: ONNX Runtime is in the image.
    let vad = client.infer(&vad_chunk()).await.unwrap();
    let probability = vad.outputs.iter().find(|o| o.name == "output").unwrap();
    let p = probability.values::<f32>()[0];
    assert!((0.0..=1.0).contains(&p), "{p}");
    let grpc = kiln_client::GrpcClient::connect(&format!("http://127.0.0.1:{}", kiln.grpc))
        .await
        .unwrap();
    assert!(grpc.is_ready().await.unwrap());
    // It runs as the manifests' user, not root.
    assert_eq!(kiln.uid(), spec["runAsUser"].to_string());

    let code = kiln.stop();
    let log = kiln.logs();
    assert_eq!(code, "0", "{log}");
    assert!(log.contains("every accepted request was answered"), "{log}");
    let _ = std::fs::remove_dir_all(&models);
}

/// `kiln_jobs_completed_total` of the server at `url`.
async fn completed(url: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metric(&text, "kiln_jobs_completed_total", &[]).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_containers_on_one_redis_share_the_job_queue_and_serve_realtime_beside_it() {
    build_image();
    let spec = manifest();
    let redis = RedisServer::start();
    let models = repository("replicas", &["echo"]);
    let jobs = format!("--jobs={}", redis.url());
    // The first replica takes jobs in but runs none (max_sys 0): the second runs them.
    let front = Container::start(
        "front",
        &spec,
        &models,
        &[jobs.clone(), "--jobs-max-sys=0".into()],
    );
    let back = Container::start("back", &spec, &models, &[jobs]);
    front.wait_started(&spec).await;
    back.wait_started(&spec).await;

    let requests: Vec<Value> = (0..40).map(echo_job).collect();
    let ids = submit_ok(&front.url, "echo", json_lines(&requests)).await;
    assert_eq!(ids.len(), 40);
    for (n, id) in ids.iter().enumerate() {
        let job = wait_finished(&front.url, id, Duration::from_secs(60)).await;
        assert_eq!(job["state"], "done", "{job}");
        assert_eq!(echoed(&job), n as u64 + 1);
    }
    assert_eq!(completed(&front.url).await, 0.0);
    assert_eq!(completed(&back.url).await, 40.0);
    // Realtime on both, beside the queue.
    for replica in [&front, &back] {
        let client = HttpClient::new(&replica.url).unwrap();
        let answer = client.infer(&echo_request()).await.unwrap();
        assert_eq!(answer.outputs[0].values::<u32>(), [2, 3, 4]);
    }
    for replica in [&back, &front] {
        assert_eq!(replica.stop(), "0", "{}", replica.logs());
    }
    // Nothing left claimed: every job listed is done.
    let restarted = Container::start(
        "after",
        &spec,
        &models,
        &[
            format!("--jobs={}", redis.url()),
            "--jobs-max-sys=0".into(),
            ADMIN_ARG.into(),
        ],
    );
    restarted.wait_started(&spec).await;
    let listed = list_all(&restarted.url, "", 500).await;
    assert_eq!(listed.len(), 40);
    assert!(listed.iter().all(|j| j["state"] == "done"), "{listed:?}");
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
