//! A remote KServe v2 server as a [`DispatchTarget`] (`--jobs-target URL`): the
//! gateway case, a dispatcher feeding another server over HTTP.
//!
//! - **Reading** its load: `GET URL/metrics` (Prometheus text, read with
//!   [`crate::prom_text`]), summed over its models: `cur_q` = `kiln_queue_depth`,
//!   `cur_sys` = `kiln_pending_requests` − `kiln_queue_depth` (accepted and in a
//!   batch), `max_sys` = `kiln_request_capacity` (or `--jobs-max-sys`). At most one
//!   scrape per `scrape_interval`; between scrapes the last reading stands (its
//!   `taken` time unchanged, so an overload latch holds until a real new one).
//!   No answer, an error status, text that does not parse or lacks kiln's gauges:
//!   no reading, so a budget of 0.
//! - **Dispatching** a job: `POST URL/v2/models/{model}/infer` with its request,
//!   any `priority` parameter of the client's removed (a job never asks for more
//!   than realtime) and, with `--jobs-target-priority N`, set to `N` (the target's
//!   lowest level). 200: done, with the response; 429: overloaded (the dispatcher
//!   drops its budget to 0 until the next reading, the job goes back to the queue);
//!   503 or no answer: unavailable, back to the queue; any other status (404: the
//!   model is not loaded there, as the local target fails a job whose model is
//!   not loaded) the job failed with the target's `error`. No retry here: the job
//!   waits in the queue for the next budget.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::Value;

use crate::budget::{BoxFuture, DispatchTarget, Dispatched, Reading};
use crate::prom_text;
use crate::queue::{ClaimedJob, Outcome};

/// The remote target's settings.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// The target's base URL (`http://HOST:PORT`).
    pub url: String,
    /// At most one `/metrics` scrape per this.
    pub scrape_interval: Duration,
    /// The `priority` parameter jobs carry to the target (`None`: none).
    pub priority: Option<u32>,
    /// How long one job's request may take (queued there included).
    pub request_timeout: Duration,
}

impl RemoteConfig {
    /// Defaults for `url`: a scrape per 100 ms, no priority, 300 s per request.
    pub fn new(url: &str) -> RemoteConfig {
        RemoteConfig {
            url: url.trim_end_matches('/').to_owned(),
            scrape_interval: Duration::from_millis(100),
            priority: None,
            request_timeout: Duration::from_secs(300),
        }
    }
}

/// The last scrape: when it was tried and what it gave.
struct Scrape {
    tried: Instant,
    reading: Option<Reading>,
}

/// A KServe v2 server reached over HTTP.
pub struct RemoteTarget {
    config: Arc<RemoteConfig>,
    http: reqwest::Client,
    last: Mutex<Option<Scrape>>,
}

impl RemoteTarget {
    /// A target for `config` (no connection is made until the first read).
    pub fn new(config: RemoteConfig) -> Result<RemoteTarget, String> {
        if !(config.url.starts_with("http://") || config.url.starts_with("https://")) {
            return Err(format!(
                "--jobs-target `{}`: expected http://HOST:PORT",
                config.url
            ));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(1))
            .build()
            .map_err(|e| format!("--jobs-target: {e}"))?;
        Ok(RemoteTarget {
            config: Arc::new(config),
            http,
            last: Mutex::new(None),
        })
    }

    async fn scrape(&self) -> Result<Reading, String> {
        let response = self
            .http
            .get(format!("{}/metrics", self.config.url))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("/metrics answered {}", response.status()));
        }
        let text = response.text().await.map_err(|e| e.to_string())?;
        reading_of(&text, Instant::now())
    }
}

/// The reading `text` (a `/metrics` exposition) gives, summed over models.
pub fn reading_of(text: &str, taken: Instant) -> Result<Reading, String> {
    let samples = prom_text::parse(text).map_err(|e| e.to_string())?;
    let sum = |name: &str| -> Option<f64> {
        let mut found = None;
        for s in samples.iter().filter(|s| s.name == name) {
            *found.get_or_insert(0.0) += s.value;
        }
        found
    };
    let (Some(pending), Some(queued)) = (sum("kiln_pending_requests"), sum("kiln_queue_depth"))
    else {
        return Err(
            "no kiln_pending_requests / kiln_queue_depth: no model loaded there, or not kiln"
                .into(),
        );
    };
    Ok(Reading {
        cur_sys: (pending - queued).max(0.0),
        cur_q: queued.max(0.0),
        max_sys: sum("kiln_request_capacity").unwrap_or(0.0),
        taken,
    })
}

/// `request` (JSON) with the client's `priority` parameter removed and, when
/// `priority` is given, set to it.
pub fn with_priority(request: &[u8], priority: Option<u32>) -> Result<Vec<u8>, String> {
    let mut value: Value =
        serde_json::from_slice(request).map_err(|e| format!("a stored request: {e}"))?;
    let Some(object) = value.as_object_mut() else {
        return Err("a stored request that is not a JSON object".into());
    };
    if let Some(Value::Object(params)) = object.get_mut("parameters") {
        params.retain(|k, _| !k.eq_ignore_ascii_case("priority"));
    }
    if let Some(level) = priority {
        let params = object
            .entry("parameters")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(params) = params.as_object_mut() {
            params.insert("priority".into(), Value::from(level));
        }
    }
    serde_json::to_vec(&value).map_err(|e| e.to_string())
}

impl DispatchTarget for RemoteTarget {
    fn read(&self) -> BoxFuture<'_, Option<Reading>> {
        Box::pin(async move {
            if let Some(last) = self.last.lock().as_ref() {
                if last.tried.elapsed() < self.config.scrape_interval {
                    return last.reading;
                }
            }
            let tried = Instant::now();
            let reading = match self.scrape().await {
                Ok(reading) => Some(reading),
                Err(e) => {
                    spdlog::debug!("jobs: target {} unreadable: {e}", self.config.url);
                    None
                }
            };
            *self.last.lock() = Some(Scrape { tried, reading });
            reading
        })
    }

    fn dispatch(&self, job: ClaimedJob) -> BoxFuture<'static, Dispatched> {
        let config = self.config.clone();
        let http = self.http.clone();
        Box::pin(async move {
            let body = match with_priority(&job.request, config.priority) {
                Ok(body) => body,
                Err(e) => return Dispatched::Ran(Outcome::Failed(e)),
            };
            let sent = http
                .post(format!("{}/v2/models/{}/infer", config.url, job.model))
                .header("content-type", "application/json")
                .timeout(config.request_timeout)
                .body(body)
                .send()
                .await;
            let response = match sent {
                Ok(response) => response,
                Err(e) => return Dispatched::Unavailable(e.to_string()),
            };
            let status = response.status().as_u16();
            let bytes = match response.bytes().await {
                Ok(bytes) => bytes.to_vec(),
                Err(e) => return Dispatched::Unavailable(e.to_string()),
            };
            match status {
                200 => Dispatched::Ran(Outcome::Done(bytes)),
                429 => Dispatched::Overloaded,
                503 => Dispatched::Unavailable(error_text(status, &bytes)),
                // 404 among them (not loaded there): failed, as the local target
                // fails a job whose model is not loaded (no retry of a model that
                // may never come).
                _ => Dispatched::Ran(Outcome::Failed(error_text(status, &bytes))),
            }
        })
    }
}

/// The `error` of a KServe v2 error body, else the status and the body's start.
fn error_text(status: u16, body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            format!("the target answered {status}: {text}")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_sums_the_models() {
        let text = "# TYPE kiln_pending_requests gauge\n\
                    kiln_pending_requests{model=\"a\"} 7\n\
                    kiln_pending_requests{model=\"b\"} 3\n\
                    kiln_queue_depth{model=\"a\"} 4\n\
                    kiln_queue_depth{model=\"b\"} 0\n\
                    kiln_request_capacity{model=\"a\"} 16\n\
                    kiln_request_capacity{model=\"b\"} 8\n";
        let r = reading_of(text, Instant::now()).unwrap();
        assert_eq!((r.cur_sys, r.cur_q, r.max_sys), (6.0, 4.0, 24.0));
    }

    #[test]
    fn no_kiln_gauges_or_bad_text_is_no_reading() {
        assert!(reading_of("process_open_fds 3\n", Instant::now()).is_err());
        assert!(reading_of("kiln_queue_depth{model=\"a\" 1\n", Instant::now()).is_err());
        // Gauges without a capacity: a reading with max_sys 0 (--jobs-max-sys decides).
        let r = reading_of(
            "kiln_pending_requests{model=\"a\"} 1\nkiln_queue_depth{model=\"a\"} 1\n",
            Instant::now(),
        )
        .unwrap();
        assert_eq!((r.cur_sys, r.cur_q, r.max_sys), (0.0, 1.0, 0.0));
    }

    #[test]
    fn the_clients_priority_is_replaced() {
        let request = br#"{"inputs":[],"parameters":{"Priority":1,"x":2}}"#;
        let out: Value = serde_json::from_slice(&with_priority(request, None).unwrap()).unwrap();
        assert_eq!(out["parameters"], serde_json::json!({"x": 2}));
        let out: Value =
            serde_json::from_slice(&with_priority(br#"{"inputs":[]}"#, Some(3)).unwrap()).unwrap();
        assert_eq!(out["parameters"]["priority"], 3);
        assert!(with_priority(b"[1]", None).is_err());
    }

    #[test]
    fn error_bodies() {
        assert_eq!(error_text(400, br#"{"error":"bad shape"}"#), "bad shape");
        assert_eq!(error_text(500, b"oops"), "the target answered 500: oops");
    }
}
