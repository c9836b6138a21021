//! OpenTelemetry traces of requests, through their batches.
//!
//! A request's trace begins at its ingress ([`Trace::receive`]): while tracing is
//! off (the default: no exporter, or `trace_level` `OFF`) that is one relaxed
//! atomic load and nothing else, so the hot path pays nothing. When on, the
//! request is sampled as Triton samples ([`settings`]: every `trace_rate`-th
//! request of a model) at admission ([`crate::request::serve::submit`]); a sampled request
//! joins the caller's trace ([`context`]: W3C `traceparent`/`tracestate`).
//!
//! Spans are built after the fact from the `Instant`s the path already takes,
//! only for sampled requests ([`spans`]): the request's span (`infer`, server kind)
//! with its children `receive and decode`, `queue`, `batch formation`,
//! `worker run` and `encode and respond`; and each batch that held a sampled
//! request gets its own span (`batch`, in a trace of its own) linked to the
//! request spans it served (a batch serves many traces: links, not parents).
//! Workers add spans and events of their own through the SDK's host callbacks
//! (`kiln_worker_sdk::trace`).
//!
//! Settings and the exporter are the process's, as OpenTelemetry's provider is.

mod batch;
pub mod context;
mod export;
pub mod settings;
pub(crate) mod spans;
pub mod worker;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use opentelemetry::trace::{SpanContext, SpanId, TraceId};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
use parking_lot::RwLock;

pub use context::Propagated;
pub use settings::{SettingMap, SettingValue, TraceConfig, Update};
pub use worker::plugin_trace_sink;

use crate::error::Result;
use crate::request::infer::{InferRequest, InferResponse};
use export::Exporting;
use settings::Table;

/// Whether an exporter runs and some scope's settings can trace: the one load
/// the hot path makes.
static ENABLED: AtomicBool = AtomicBool::new(false);
static TABLE: OnceLock<RwLock<Table>> = OnceLock::new();
static EXPORTING: OnceLock<Exporting> = OnceLock::new();

fn table() -> &'static RwLock<Table> {
    TABLE.get_or_init(|| RwLock::new(Table::new(TraceConfig::default())))
}

fn refresh() {
    let on = EXPORTING.get().is_some() && table().read().any_active();
    ENABLED.store(on, Ordering::Relaxed);
}

/// Sets the operator's settings (`--trace-level`, `--trace-rate`,
/// `--trace-count`). Before serving.
pub fn configure(config: TraceConfig) {
    *table().write() = Table::new(config);
    refresh();
}

/// Exports spans through `exporter` (kiln-server's OTLP exporter; the core has
/// no transport): until this is called nothing is traced. Once per process.
pub fn export<E>(exporter: E) -> Result<()>
where
    E: opentelemetry_sdk::trace::SpanExporter + 'static,
{
    if EXPORTING.set(Exporting::start(exporter)).is_err() {
        return Err(crate::ServerError::Internal(
            "the trace exporter is already configured".into(),
        ));
    }
    refresh();
    Ok(())
}

/// Exports the spans still queued; call when the server stops.
pub fn shutdown() {
    ENABLED.store(false, Ordering::Relaxed);
    if let Some(exporting) = EXPORTING.get() {
        exporting.shutdown();
    }
}

/// The trace settings of `model` (`None`: the server's), Triton's names and values.
pub fn get_settings(model: Option<&str>) -> SettingMap {
    table().read().get(model)
}

/// Applies a trace-setting request (all or nothing) and returns the settings then
/// in force. The caller checks that `model` is served.
pub fn update_settings(model: Option<&str>, updates: &[Update]) -> Result<SettingMap> {
    let map = {
        let mut table = table().write();
        table.update(model, updates)?;
        table.get(model)
    };
    refresh();
    Ok(map)
}

/// Which span a batch's work on a request belongs to: the request's span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanIds {
    pub trace_id: TraceId,
    pub span_id: SpanId,
}

/// A request's trace, held by its ingress from receipt to response: nothing at
/// all unless tracing is on and the request was sampled. Dropped unfinished (the
/// client left, the request was cancelled), its spans end as `cancelled`.
#[derive(Default)]
pub struct Trace(State);

#[derive(Default)]
enum State {
    #[default]
    Off,
    /// Not boxed: a request that is not sampled allocates nothing (but the
    /// headers it carries).
    Received(Instant, Propagated),
    Sampled(Box<spans::Request>),
}

impl Trace {
    /// The trace of a request just received; `headers` (the W3C headers it
    /// carries) is called only while tracing is on.
    #[inline]
    pub fn receive(headers: impl FnOnce() -> Propagated) -> Trace {
        if !ENABLED.load(Ordering::Relaxed) {
            return Trace(State::Off);
        }
        Trace(State::Received(Instant::now(), headers()))
    }

    /// Samples the request at admission into `model` (`version`), decoded as
    /// `request` (`None`: it failed to decode); returns the request span's ids
    /// the batch's work is recorded under, if sampled.
    pub(crate) fn admit(
        &mut self,
        model: &str,
        version: &str,
        request: Option<&InferRequest>,
    ) -> Option<SpanIds> {
        let State::Received(received, propagated) = std::mem::take(&mut self.0) else {
            return None;
        };
        let tracer = &EXPORTING.get()?.tracer;
        if !table().read().effective(model).sample() {
            return None;
        }
        let parent = context::parent(&propagated);
        let ids = SpanIds {
            trace_id: parent.as_ref().map_or_else(
                || RandomIdGenerator::default().new_trace_id(),
                SpanContext::trace_id,
            ),
            span_id: RandomIdGenerator::default().new_span_id(),
        };
        let bytes = request.map_or(0, |r| r.inputs.iter().map(|t| t.data.len()).sum());
        self.0 = State::Sampled(Box::new(spans::Request {
            tracer: tracer.clone(),
            ids,
            parent,
            model: model.to_owned(),
            version: version.to_owned(),
            received,
            submitted: Instant::now(),
            answered: None,
            request_bytes: bytes,
            response_bytes: 0,
        }));
        Some(ids)
    }

    /// The answer came back (`response`, when it is one): encoding begins.
    #[inline]
    pub fn answered(&mut self, response: Option<&InferResponse>) {
        if let State::Sampled(request) = &mut self.0 {
            request.answered = Some(Instant::now());
            request.response_bytes =
                response.map_or(0, |r| r.outputs.iter().map(|t| t.data.len()).sum());
        }
    }

    /// The response is on its way (`error`: the request failed with it): the
    /// request's spans are built and queued for export.
    #[inline]
    pub fn finish(mut self, error: Option<&dyn std::fmt::Display>) {
        if let State::Sampled(request) = std::mem::take(&mut self.0) {
            let outcome = match error {
                None => spans::Outcome::Ok,
                Some(e) => spans::Outcome::Error(e.to_string()),
            };
            request.finish(outcome);
        }
    }

    /// The request's trace id, when it is traced (for log lines about it).
    pub fn trace_id(&self) -> Option<TraceId> {
        match &self.0 {
            State::Sampled(request) => Some(request.ids.trace_id),
            _ => None,
        }
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        if let State::Sampled(request) = std::mem::take(&mut self.0) {
            request.finish(spans::Outcome::Cancelled);
        }
    }
}

pub(crate) use batch::BatchTrace;
