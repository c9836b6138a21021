//! Waiting for what the server reports, instead of sleeping to order events.

use std::time::Duration;

use kiln_client::HttpClient;

use crate::metric;

/// Waits (up to 10 s) until `model`'s `kiln_pending_requests` is `n`: requests
/// accepted and not yet answered.
pub async fn wait_pending(c: &HttpClient, model: &str, n: f64) {
    wait_metric(c, "kiln_pending_requests", model, |v| v == n).await;
}

/// Waits (up to 10 s) until the sample `name{model=...}` satisfies `ok`; returns it.
pub async fn wait_metric(c: &HttpClient, name: &str, model: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let mut last = None;
    for _ in 0..1000 {
        let text = c.metrics().await.expect("metrics");
        last = metric(&text, name, &[("model", model)]);
        if let Some(v) = last.filter(|&v| ok(v)) {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("`{name}` of model `{model}` never reached the expected value (last: {last:?})");
}
