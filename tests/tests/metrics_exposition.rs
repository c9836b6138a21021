//! kiln's `/metrics` checked by the real Prometheus from Debian (installed by
//! `scripts/setup-prometheus`, which `scripts/test` runs): `promtool check metrics`
//! accepts the exposition, a real Prometheus scraping kiln answers a rate and a
//! histogram quantile through its HTTP API, and every metric the shipped Grafana
//! dashboard (`docs/grafana/kiln.json`) queries is one kiln serves.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_tests::fixtures::TempRepository;
use kiln_tests::Kiln;
use serde_json::{json, Value};

/// `name` on the PATH (or in /usr/bin), which `scripts/setup-prometheus` installs.
fn tool(name: &str) -> PathBuf {
    let dirs = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&dirs)
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("`{name}` is missing: run scripts/setup-prometheus"))
}

/// Runs a few echo requests (successes, and one invalid) so every family has data.
async fn traffic(kiln: &Kiln, n: usize) {
    let client = reqwest::Client::new();
    let url = format!("{}/v2/models/echo/infer", kiln.url);
    for i in 0..n {
        let body = json!({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "UINT32",
                                      "data": [i, i + 1]}]});
        let r = client
            .post(&url)
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    let bad =
        json!({"inputs": [{"name": "NOPE", "shape": [1], "datatype": "UINT32", "data": [1]}]});
    let r = client
        .post(&url)
        .body(bad.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_exposition() {
    let kiln = Kiln::start(&["--load", "echo", "--load", "accumulate:batcher=sequence,state.STATE=STATE_OUT,control.start=START,control.end=END,control.ready=READY,control.corrid=CORRID"]);
    traffic(&kiln, 5).await;
    let text = kiln.client.metrics().await.unwrap();
    let mut promtool = Command::new(tool("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}\n{}{}\n{text}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A Prometheus server, killed on drop.
struct Prometheus {
    child: Child,
    url: String,
    _dir: TempRepository,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus on a free loopback port, its storage in a temporary
    /// folder, scraping `target` (`host:port`) every second.
    fn start(target: &str) -> Prometheus {
        // An empty repository: a fresh folder, removed on drop.
        let dir = TempRepository::new(&[]);
        std::fs::create_dir_all(dir.path()).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: kiln\n    static_configs:\n      \
                 - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new(tool("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The value of the instant query `query`'s first sample, if any.
    async fn query(&self, query: &str) -> Option<f64> {
        let answer: Value = reqwest::Client::new()
            .post(format!("{}/api/v1/query", self.url))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("query={}", form_encode(query)))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        assert_eq!(answer["status"], "success", "{query}: {answer}");
        answer["data"]["result"][0]["value"][1]
            .as_str()?
            .parse()
            .ok()
    }
}

/// `text` percent-encoded for a form body.
fn form_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_kiln_and_answers_a_rate_and_a_quantile() {
    let kiln = Kiln::start(&["--load", "echo"]);
    let prometheus = Prometheus::start(kiln.url.trim_start_matches("http://"));
    let rate = r#"sum(rate(kiln_requests_total{job="kiln",model="echo",outcome="success"}[10s]))"#;
    let quantile = r#"histogram_quantile(0.9, sum by (le) (rate(kiln_queue_duration_seconds_bucket{model="echo"}[10s])))"#;
    let cpu = r#"rate(process_cpu_seconds_total{job="kiln"}[10s])"#;
    // Traffic while Prometheus scrapes, until both answers are there (a rate needs
    // two scrapes with the counter grown).
    let deadline = Instant::now() + Duration::from_secs(60);
    let answers = loop {
        traffic(&kiln, 20).await;
        let answers = (
            prometheus.query(rate).await,
            prometheus.query(quantile).await,
            prometheus.query(cpu).await,
        );
        if let (Some(r), Some(q), Some(_)) = answers {
            if r > 0.0 && q.is_finite() {
                break answers;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no answers from Prometheus: {answers:?}\nits log:\n{}",
            prometheus.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let (_, quantile, _) = answers;
    // A queue time quantile of an idle-ish echo: seconds, between 0 and the
    // histogram's last finite bucket.
    let q = quantile.unwrap();
    assert!((0.0..=90.0).contains(&q), "{q}");
    // What Prometheus scraped is up.
    assert_eq!(prometheus.query(r#"up{job="kiln"}"#).await, Some(1.0));
}

/// The metric names a PromQL expression uses: `kiln_…` and `process_…` words.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        if word(bytes[i]) && (i == 0 || !word(bytes[i - 1])) {
            let end = (i..bytes.len())
                .find(|&j| !word(bytes[j]))
                .unwrap_or(bytes.len());
            let token = &expr[i..end];
            if token.starts_with("kiln_") || token.starts_with("process_") {
                names.push(token.to_owned());
            }
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_queries_only_metrics_kiln_serves() {
    let path = kiln_tests::repo_root().join("docs/grafana/kiln.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // A Grafana dashboard with a Prometheus data-source variable every panel uses.
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(variables.iter().any(|v| v["type"] == "datasource"
        && v["query"] == "prometheus"
        && v["name"] == "datasource"));
    let panels = dashboard["panels"].as_array().unwrap();
    assert!(panels.len() >= 8, "{}", panels.len());
    let mut exprs = Vec::new();
    for panel in panels {
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "{}",
            panel["title"]
        );
        for target in panel["targets"].as_array().unwrap() {
            exprs.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    let kiln = Kiln::start(&["--load", "echo"]);
    traffic(&kiln, 2).await;
    let text = kiln.client.metrics().await.unwrap();
    let served: std::collections::HashSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let mut used: Vec<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    used.sort();
    used.dedup();
    assert!(used.len() >= 12, "{used:?}");
    let missing: Vec<&String> = used
        .iter()
        .filter(|n| !served.contains(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard uses metrics kiln does not serve: {missing:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_gauges_follow_a_busy_model() {
    use kiln_tests::wait::{wait_metric, wait_metric_until};
    // One buffer set: a slow request (-3 takes 1 s) holds it, two more wait.
    let kiln = Kiln::start(&["--load", "faulty:batch_size=1,max_buffers=1,queue_size=3"]);
    let c = &kiln.client;
    wait_metric(c, "kiln_buffer_pool_free", "faulty", 1.0).await;
    wait_metric(c, "kiln_queue_depth", "faulty", 0.0).await;
    let url = format!("{}/v2/models/faulty/infer", kiln.url);
    let slow = json!({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "INT32",
                                  "data": [-3]}]})
    .to_string();
    let send = || {
        let (url, body) = (url.clone(), slow.clone());
        tokio::spawn(async move {
            let r = reqwest::Client::new()
                .post(url)
                .body(body)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        })
    };
    let first = send();
    wait_metric(c, "kiln_buffer_pool_free", "faulty", 0.0).await;
    let rest = [send(), send()];
    wait_metric(c, "kiln_queue_depth", "faulty", 2.0).await;
    wait_metric(c, "kiln_buffer_pool_in_use", "faulty", 1.0).await;
    // Running one batch: busy since the previous scrape.
    wait_metric_until(c, "kiln_instance_busy_fraction", "faulty", |f| f > 0.0).await;
    assert_eq!(first.await.unwrap(), 200);
    for task in rest {
        assert_eq!(task.await.unwrap(), 200);
    }
    // Three batches of about a second each.
    let busy = wait_metric_until(c, "kiln_instance_busy_seconds_total", "faulty", |s| {
        s >= 2.9
    })
    .await;
    assert!(busy < 60.0, "{busy}");
    wait_metric(c, "kiln_queue_depth", "faulty", 0.0).await;
    wait_metric(c, "kiln_buffer_pool_free", "faulty", 1.0).await;
}
