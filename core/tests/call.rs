//! A [`Call`] over the fake worker, in-process: its trace ends when it is
//! dropped unanswered, a failure is logged once (by whoever failed the request),
//! and its delivery is counted once, as a success or as a failure.
//!
//! The trace exporter and the logger are the process's: this file's tests each
//! look for their own request ids and outcomes.

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::Write;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use parking_lot::Mutex;

use kiln_core::models::Served;
use kiln_core::observe::stats::StatsSnapshot;
use kiln_core::observe::trace::{self, Trace, TraceConfig};
use kiln_core::request::serve::Call;
use kiln_core::{Server, ServerError};
use support::{gate, params, request, server};

/// The spans exported in this process.
#[derive(Debug, Clone, Default)]
struct Spans(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Spans {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.lock().extend(batch);
        Ok(())
    }
}

/// The lines logged in this process.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    /// The lines that say `needle`.
    fn with(&self, needle: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock())
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect()
    }
}

/// Every request traced, spans exported at once; verbose lines captured.
fn observed() -> &'static (Spans, Lines) {
    static OBSERVED: OnceLock<(Spans, Lines)> = OnceLock::new();
    OBSERVED.get_or_init(|| {
        // Read by the batch span processor as it starts (ms).
        std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "10");
        let spans = Spans::default();
        trace::configure(TraceConfig {
            timestamps: true,
            rate: 1,
            count: -1,
        });
        trace::export(spans.clone()).unwrap();
        let lines = Lines::default();
        let sink = spdlog::sink::WriteSink::builder()
            .target(lines.clone())
            .build()
            .unwrap();
        let logger = spdlog::Logger::builder()
            .sink(Arc::new(sink))
            .level_filter(spdlog::LevelFilter::All)
            .build()
            .unwrap();
        spdlog::set_default_logger(Arc::new(logger));
        kiln_core::observe::request_log::set_verbose(true);
        (spans, lines)
    })
}

/// `fake` loaded into a new server, with its group.
async fn fake(load: &[(&str, i64)]) -> (Server, Served) {
    let server = server();
    let model = server.load("fake", params(load)).await.unwrap();
    let group = server.lookup(&model, None).unwrap();
    (server, group)
}

/// A request of `fake` with the id `id`.
fn with_id(model: &str, id: &str, values: &[u32]) -> kiln_core::InferRequest {
    kiln_core::InferRequest {
        id: Some(id.to_owned()),
        ..request(model, values)
    }
}

/// The group's statistics once `done` holds of them (answers are counted when
/// the batch's last answer is let go, maybe on the instance's thread).
fn settled(group: &Served, done: impl Fn(&StatsSnapshot) -> bool) -> StatsSnapshot {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = group.stats().snapshot();
        if done(&stats) || Instant::now() > deadline {
            return stats;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test]
async fn a_call_dropped_before_its_answer_ends_its_trace_cancelled() {
    let (spans, _) = observed();
    let gate_n = 201;
    let (_server, group) = fake(&[("gate", gate_n), ("batch_size", 1)]).await;
    // The first request holds the instance at the gate: the second stays queued.
    let model = group.endpoint().to_owned();
    let (mut first, ()) = Call::start(
        group.clone(),
        Ok((request(&model, &[1]), ())),
        Trace::receive(Default::default),
    )
    .unwrap();
    gate(gate_n).wait_arrived(1);
    let (queued, ()) = Call::start(
        group.clone(),
        Ok((request(&model, &[2]), ())),
        Trace::receive(Default::default),
    )
    .unwrap();
    drop(queued);
    gate(gate_n).open();
    first.answer().await.unwrap();
    first.end(Ok(())).unwrap();
    let outcome = |s: &SpanData| {
        s.attributes
            .iter()
            .find(|kv| kv.key.as_str() == "kiln.outcome")
            .map(|kv| kv.value.to_string())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let outcomes = loop {
        let outcomes: Vec<String> = spans
            .0
            .lock()
            .iter()
            .filter(|s| s.name == "infer")
            .filter_map(outcome)
            .collect();
        let both = outcomes.iter().any(|o| o == "cancelled") && outcomes.iter().any(|o| o == "ok");
        if both || Instant::now() > deadline {
            break outcomes;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        outcomes.iter().filter(|o| *o == "cancelled").count(),
        1,
        "the dropped call's span, once: {outcomes:?}"
    );
    assert!(outcomes.iter().any(|o| o == "ok"), "{outcomes:?}");
}

#[tokio::test]
async fn an_answer_that_cannot_be_encoded_is_logged_once_and_counted_a_failure_once() {
    let (_, lines) = observed();
    let (_server, group) = fake(&[]).await;
    let model = group.endpoint().to_owned();
    let (mut call, ()) = Call::start(
        group.clone(),
        Ok((with_id(&model, "call-encode-fails", &[3]), ())),
        Trace::default(),
    )
    .unwrap();
    let response = call.answer().await.unwrap();
    assert_eq!(response.outputs[0].values::<u32>(), vec![4]);
    let ended = call.end::<()>(Err(ServerError::Internal("too large to encode".into())));
    assert!(matches!(ended, Err(ServerError::Internal(_))), "{ended:?}");
    let stats = settled(&group, |s| s.fail.count > 0);
    assert_eq!((stats.success.count, stats.fail.count), (0, 1));
    let logged = lines.with("call-encode-fails");
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(
        logged[0].contains("request failed: internal error: too large to encode"),
        "{}",
        logged[0]
    );
}

#[tokio::test]
async fn an_answer_delivered_is_counted_a_success_once_and_logs_nothing() {
    let (_, lines) = observed();
    let (_server, group) = fake(&[]).await;
    let model = group.endpoint().to_owned();
    let (mut call, ()) = Call::start(
        group.clone(),
        Ok((with_id(&model, "call-delivered", &[5]), ())),
        Trace::default(),
    )
    .unwrap();
    let response = call.answer().await.unwrap();
    assert_eq!(call.end(Ok(response.outputs.len())).unwrap(), 1);
    let stats = settled(&group, |s| s.success.count > 0);
    assert_eq!((stats.success.count, stats.fail.count), (1, 0));
    assert_eq!(lines.with("call-delivered"), Vec::<String>::new());
}

#[tokio::test]
async fn a_request_failed_by_its_worker_is_logged_once() {
    let (_, lines) = observed();
    let (_server, group) = fake(&[]).await;
    let model = group.endpoint().to_owned();
    // The fake fails a request holding 7 (invalid), alone.
    let (mut call, ()) = Call::start(
        group.clone(),
        Ok((with_id(&model, "call-worker-fails", &[7]), ())),
        Trace::default(),
    )
    .unwrap();
    let answered = call.answer().await;
    assert!(
        matches!(answered, Err(ServerError::InvalidRequest(_))),
        "{answered:?}"
    );
    drop(call);
    let logged = lines.with("call-worker-fails");
    assert_eq!(logged.len(), 1, "the instance's line only: {logged:?}");
}

#[tokio::test]
async fn a_request_that_failed_to_decode_is_refused_and_logged_once() {
    let (_, lines) = observed();
    let (_server, group) = fake(&[]).await;
    let decoded: kiln_core::error::Result<(kiln_core::InferRequest, ())> =
        Err(ServerError::invalid("call-undecodable: not a tensor"));
    let refused = Call::start(group.clone(), decoded, Trace::default()).err();
    assert!(
        matches!(refused, Some(ServerError::InvalidRequest(_))),
        "{:?}",
        refused.map(|e| e.to_string())
    );
    assert_eq!(lines.with("call-undecodable").len(), 1);
}
