//! Helpers for kiln's end-to-end tests: start the real `kiln` binary on a free
//! loopback port with the real plugins built beside it, and read its metrics.

// Test support: a failed setup step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod browser;
pub mod clients;
pub mod ensembles;
pub mod file_server;
pub mod fixtures;
pub mod golden;
pub mod grpc;
pub mod job_store;
pub mod jobs;
pub mod media;
pub mod ocr;
pub mod otlp;
pub mod pytest;
pub mod redis;
pub mod stream;
pub mod wait;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

pub use kiln_client::{GrpcClient, HttpClient};
pub use wait::{
    accepted, fill_until_refused, wait_accepted, wait_metric, wait_metric_until, wait_pending,
};

/// The directory holding the `kiln` binary and the plugins (`target/debug` when the
/// tests run from `target/debug/deps`).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let mut dir = exe.parent().expect("executable dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// The repository's root directory: `$KILN_REPO_ROOT`, for test binaries run away
/// from their build tree (`scripts/gpu-check`), else where they were built.
pub fn repo_root() -> PathBuf {
    if let Some(root) = std::env::var_os("KILN_REPO_ROOT") {
        return PathBuf::from(root);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repository root")
        .to_path_buf()
}

/// The project's cache (`$KILN_CACHE`, else `.cache` in the repository): the ONNX
/// Runtime library, the models and the reference virtualenv, as
/// `scripts/fetch-models` and `scripts/setup-python` leave them.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("KILN_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache"))
}

/// The example model repository, checked to hold the fetched models.
pub fn model_repository() -> PathBuf {
    let repo = repo_root().join("examples/models");
    for model in ["ocr-det", "ocr-cls", "ocr-rec", "silero-vad"] {
        let file = repo.join(model).join("1/model.onnx");
        assert!(
            file.is_file(),
            "{} is missing: run scripts/fetch-models",
            file.display()
        );
    }
    repo
}

/// A running `kiln serve`, stopped on drop.
pub struct Kiln {
    child: Child,
    pub url: String,
    /// The gRPC server's URL (`http://127.0.0.1:PORT`).
    pub grpc_url: String,
    pub client: HttpClient,
    log: Arc<Mutex<String>>,
}

impl Kiln {
    /// Starts `kiln serve` on 127.0.0.1 with free HTTP and gRPC ports, plugins from
    /// the build directory, and `args` added.
    pub fn start(args: &[&str]) -> Kiln {
        Kiln::start_with_env(args, &[])
    }

    /// [`Kiln::start`] on the example repository ([`model_repository`]) with
    /// `models` loaded (`--load-model` each).
    pub fn serve_examples(models: &[&str]) -> Kiln {
        let repo = model_repository();
        let mut args = vec!["--model-repository", repo.to_str().unwrap_or_default()];
        for model in models {
            args.extend(["--load-model", model]);
        }
        Kiln::start(&args)
    }

    /// [`Kiln::start`] with `env` added to the server's environment.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Kiln {
        Kiln::start_on(0, args, env)
    }

    /// [`Kiln::start_with_env`] with HTTP on `http_port` (0: any free port), for a
    /// server started again where another one was.
    pub fn start_on(http_port: u16, args: &[&str], env: &[(&str, &str)]) -> Kiln {
        let dir = build_dir();
        let binary = dir.join("kiln");
        assert!(
            binary.is_file(),
            "{} is missing: build the workspace first (cargo build --workspace)",
            binary.display()
        );
        let mut child = Command::new(&binary)
            .current_dir(repo_root())
            .env("KILN_CACHE", cache_dir())
            .envs(env.iter().copied())
            .args([
                "serve",
                "--http-port",
                &http_port.to_string(),
                "--grpc-port",
                "0",
                "--grpc-threads",
                "2",
                "--host",
                "127.0.0.1",
                "--http-workers",
                "2",
            ])
            .arg("--plugin-dir")
            .arg(&dir)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kiln");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let log_sink = Arc::clone(&log);
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stderr);
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 {
                log_sink.lock().unwrap().push_str(&line);
                line.clear();
            }
        });
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 {
                for (protocol, prefix) in [
                    ("http", "kiln: HTTP listening on "),
                    ("grpc", "kiln: gRPC listening on "),
                ] {
                    if let Some(addr) = line.trim().strip_prefix(prefix) {
                        let _ = tx.send((protocol, addr.to_owned()));
                    }
                }
                line.clear();
            }
            let _ = reader.read_to_string(&mut line);
        });
        // The HTTP line (the first, if several) comes before the gRPC line.
        let (mut http, mut grpc) = (None, None);
        while grpc.is_none() {
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(("http", addr)) => http = http.or(Some(addr)),
                Ok((_, addr)) => grpc = Some(addr),
                Err(_) => {
                    let _ = child.kill();
                    panic!("kiln did not start; its log:\n{}", log.lock().unwrap());
                }
            }
        }
        let url = format!(
            "http://{}",
            http.expect("an HTTP address before the gRPC one")
        );
        let grpc_url = format!("http://{}", grpc.expect("gRPC address"));
        let client = HttpClient::new(&url).expect("client");
        Kiln {
            child,
            url,
            grpc_url,
            client,
            log,
        }
    }

    /// A client of one caller: HTTP, or (`stream`) its own gRPC `ModelStreamInfer`
    /// stream, as sequences of stateful models are sent.
    pub async fn caller(&self, stream: bool) -> Caller {
        if stream {
            let stream = self.grpc().await.stream().await.expect("gRPC stream");
            Caller::Stream(Box::new(stream))
        } else {
            Caller::Http(self.client.clone())
        }
    }

    /// A gRPC client connected to this server.
    pub async fn grpc(&self) -> GrpcClient {
        GrpcClient::connect(&self.grpc_url)
            .await
            .expect("gRPC connection")
    }

    /// Kills the server with SIGKILL (no shutdown: a crash) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The kiln process's id (for `/proc/PID/...`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How the server ended, once it has exited by itself within `within`
    /// (`None`: it still runs).
    pub fn exit_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("kiln's status") {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything kiln logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The log once it contains `needle` (stderr is read on its own thread, so a
    /// line logged before the listening line may arrive after it), or as it is
    /// after 30 s.
    pub fn log_with(&self, needle: &str) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let log = self.log();
            if log.contains(needle) || std::time::Instant::now() >= deadline {
                return log;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Runs `kiln serve` on free loopback ports with `args` added, expecting it to stop
/// by itself (a start-up error), within 30 s; returns its exit code and stderr.
/// Panics, after killing it, when it keeps running.
pub fn serve_until_exit(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(build_dir().join("kiln"))
        .current_dir(repo_root())
        .env("KILN_CACHE", cache_dir())
        .args(["serve", "--http-port", "0", "--grpc-port", "0"])
        .args(["--host", "127.0.0.1", "--plugin-dir"])
        .arg(build_dir())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kiln");
    for _ in 0..300 {
        if child.try_wait().expect("kiln's status").is_some() {
            let out = child.wait_with_output().expect("kiln's output");
            return (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("kiln {args:?} kept running");
}

/// A model's Triton configuration (`GET {url}/v2/models/{model}/config`).
pub async fn triton_config(url: &str, model: &str) -> serde_json::Value {
    reqwest::get(format!("{url}/v2/models/{model}/config"))
        .await
        .expect("GET the model's config")
        .json()
        .await
        .expect("the config as JSON")
}

/// One caller's way to the server (see [`Kiln::caller`]).
pub enum Caller {
    Http(HttpClient),
    Stream(Box<kiln_client::InferStream>),
}

impl Caller {
    /// Sends `request` and waits for its answer.
    pub async fn infer(
        &mut self,
        request: &kiln_client::InferRequest,
    ) -> Result<kiln_client::InferResponse, kiln_client::ClientError> {
        match self {
            Caller::Http(client) => client.infer(request).await,
            Caller::Stream(stream) => stream.infer(request).await,
        }
    }
}

impl Drop for Kiln {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of the sample `name{labels}` where every `key="value"` in `labels`
/// appears among the sample's labels; `None` when absent.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric_name, rest) = series.split_once('{').unwrap_or((series, ""));
            if metric_name != name {
                return None;
            }
            let all = labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            all.then(|| value.parse().ok()).flatten()
        })
}

/// `kiln_requests_total{model, outcome}`: how many requests for `model` ended with
/// `outcome` (`success`, `invalid`, `rejected`, `timeout`, …); `None` when absent.
pub fn requests_outcome(text: &str, model: &str, outcome: &str) -> Option<f64> {
    metric(
        text,
        "kiln_requests_total",
        &[("model", model), ("outcome", outcome)],
    )
}

/// Sends `head` (an HTTP/1.1 request's head, ending with the blank line) and then
/// `body` over a fresh connection, and reads the answer while still sending: a
/// server may answer (e.g. 413) and close before the whole body is out, so a
/// failed write is not an error here. Returns the status and the answer's body.
pub async fn http_raw(url: &str, head: &str, body: Vec<u8>) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = url.trim_start_matches("http://");
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let mut request = head.as_bytes().to_vec();
    request.extend_from_slice(&body);
    let sender = tokio::spawn(async move {
        let _ = writer.write_all(&request).await;
        writer
    });
    let mut answer = Vec::new();
    let mut chunk = vec![0; 64 * 1024];
    loop {
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
        }
        if complete_answer(&answer) {
            break;
        }
    }
    sender.abort();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete answer: {text:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head:?}"));
    (status, body.to_owned())
}

/// Whether `answer` holds a whole HTTP/1.1 answer with a `Content-Length`.
fn complete_answer(answer: &[u8]) -> bool {
    let text = String::from_utf8_lossy(answer);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    head.lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())
                .flatten()
        })
        .is_some_and(|len| body.len() >= len)
}

/// The names of process `pid`'s threads (`/proc/PID/task/*/comm`; Linux keeps 15
/// bytes of a name).
pub fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("proc tasks")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_owned())
        .collect()
}

/// The resident memory of process `pid` in bytes (`/proc/PID/status`, VmRSS).
pub fn rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS:")
}

/// The peak resident memory of process `pid` so far, in bytes (VmHWM): an
/// allocation freed again still shows.
pub fn peak_rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmHWM:")
}

fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"));
    kb * 1024
}
