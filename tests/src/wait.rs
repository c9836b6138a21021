//! Waiting for what the server reports, instead of sleeping to order events.

use std::time::Duration;

use kiln_client::HttpClient;

use crate::{metric, requests_outcome};

/// Waits up to `within` until the sample `name{labels}` of the server behind `c`
/// satisfies `ok` (an absent sample never does); returns it.
pub async fn wait_sample(
    c: &HttpClient,
    name: &str,
    labels: &[(&str, &str)],
    within: Duration,
    ok: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = std::time::Instant::now() + within;
    loop {
        let text = c.metrics().await.expect("metrics");
        let last = metric(&text, name, labels);
        if let Some(v) = last.filter(|&v| ok(v)) {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "`{name}`{labels:?} never reached the expected value (last: {last:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 20 s) until the sample `name{model=...}` satisfies `ok`; returns it.
pub async fn wait_metric_until(
    c: &HttpClient,
    name: &str,
    model: &str,
    ok: impl Fn(f64) -> bool,
) -> f64 {
    wait_sample(c, name, &[("model", model)], Duration::from_secs(20), ok).await
}

/// Waits until the gauge `name{model}` of the server behind `c` reads `value`:
/// ordering a test by what the server has seen, not by sleeping. Panics after
/// 20 s.
pub async fn wait_metric(c: &HttpClient, name: &str, model: &str, value: f64) {
    wait_metric_until(c, name, model, |v| v == value).await;
}

/// Waits until `model` has `n` requests accepted and not yet answered
/// (`kiln_pending_requests`).
pub async fn wait_pending(c: &HttpClient, model: &str, n: f64) {
    wait_metric(c, "kiln_pending_requests", model, n).await;
}

/// How many requests `model` has accepted in all: pending plus answered
/// (`success`, `failure`), read from the server's metrics.
pub async fn accepted(c: &HttpClient, model: &str) -> f64 {
    let text = c.metrics().await.unwrap();
    metric(&text, "kiln_pending_requests", &[("model", model)]).unwrap_or(0.0)
        + requests_outcome(&text, model, "success").unwrap_or(0.0)
        + requests_outcome(&text, model, "failure").unwrap_or(0.0)
}

/// Waits until `model` has accepted `n` requests in all (see [`accepted`]),
/// however many have finished meanwhile.
pub async fn wait_accepted(c: &HttpClient, model: &str, n: f64) {
    let mut last = 0.0;
    for _ in 0..1000 {
        last = accepted(c, model).await;
        if last == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("model `{model}` never accepted {n} requests (last: {last})");
}

/// Fills `model`'s queue while slow requests hold its only buffer set: `send(v)`
/// sends one request with value `v` (1, 2, …), each once the server has accepted
/// the one before (counted by [`accepted`], so a request finishing meanwhile does
/// not matter), until one ends without being accepted: the refused one, returned
/// beside the accepted ones (value, task). Panics when more than `most` are
/// accepted.
pub async fn fill_until_refused<T: Send + 'static>(
    c: &HttpClient,
    model: &str,
    most: usize,
    mut send: impl FnMut(i32) -> tokio::task::JoinHandle<T>,
) -> (Vec<(i32, tokio::task::JoinHandle<T>)>, T) {
    let before = accepted(c, model).await;
    let mut taken = Vec::new();
    loop {
        let value = taken.len() as i32 + 1;
        let request = send(value);
        let want = before + taken.len() as f64 + 1.0;
        let mut queued = false;
        for _ in 0..1000 {
            if request.is_finished() {
                break;
            }
            queued = accepted(c, model).await == want;
            if queued {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if !queued {
            return (taken, request.await.unwrap());
        }
        taken.push((value, request));
        assert!(taken.len() <= most, "{} accepted", taken.len());
    }
}
