//! Spans built after the fact, from the `Instant`s the inference path takes
//! anyway, for sampled requests only.

use std::time::{Instant, SystemTime};

use opentelemetry::trace::{
    Link, SpanBuilder, SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

use super::SpanIds;

/// How a request ended.
pub(crate) enum Outcome {
    Ok,
    Error(String),
    /// Dropped before answering: the client left, or the request was cancelled.
    Cancelled,
}

/// A sampled request, from receipt to response.
pub(crate) struct Request {
    pub(crate) tracer: SdkTracer,
    pub(crate) ids: SpanIds,
    pub(crate) parent: Option<SpanContext>,
    pub(crate) model: String,
    pub(crate) version: String,
    pub(crate) received: Instant,
    pub(crate) submitted: Instant,
    pub(crate) answered: Option<Instant>,
    pub(crate) request_bytes: usize,
    pub(crate) response_bytes: usize,
}

/// Monotonic instants as wall-clock times, against one reading of both clocks.
struct Clock(SystemTime, Instant);

impl Clock {
    fn now() -> Clock {
        Clock(SystemTime::now(), Instant::now())
    }

    fn wall(&self, t: Instant) -> SystemTime {
        match self.1.checked_duration_since(t) {
            Some(ago) => self.0 - ago,
            None => self.0 + t.duration_since(self.1),
        }
    }
}

/// The context whose span is `ids` (a request span, or the caller's).
fn parent_context(sc: SpanContext) -> Context {
    Context::new().with_remote_span_context(sc)
}

fn local(ids: SpanIds) -> SpanContext {
    SpanContext::new(
        ids.trace_id,
        ids.span_id,
        TraceFlags::SAMPLED,
        false,
        TraceState::default(),
    )
}

/// Builds and ends one span.
fn emit(
    tracer: &SdkTracer,
    builder: SpanBuilder,
    parent: &Context,
    clock: &Clock,
    span: (Instant, Instant),
) {
    use opentelemetry::trace::Span as _;
    let mut span_ = builder
        .with_start_time(clock.wall(span.0))
        .start_with_context(tracer, parent);
    span_.end_with_timestamp(clock.wall(span.1.max(span.0)));
}

impl Request {
    /// The request's span and its ingress-side children.
    pub(crate) fn finish(self, outcome: Outcome) {
        let clock = Clock::now();
        let end = clock.1;
        let parent = self
            .parent
            .clone()
            .map_or_else(Context::new, parent_context);
        let (label, status) = match &outcome {
            Outcome::Ok => ("ok", Status::Ok),
            Outcome::Error(e) => ("error", Status::error(e.clone())),
            Outcome::Cancelled => ("cancelled", Status::error("cancelled before its answer")),
        };
        let mut attributes = vec![
            KeyValue::new("kiln.model", self.model.clone()),
            KeyValue::new("kiln.model.version", self.version.clone()),
            KeyValue::new("kiln.request.bytes", self.request_bytes as i64),
            KeyValue::new("kiln.response.bytes", self.response_bytes as i64),
            KeyValue::new("kiln.outcome", label),
        ];
        if let Outcome::Error(e) = &outcome {
            attributes.push(KeyValue::new("error.message", e.clone()));
        }
        let root = self
            .tracer
            .span_builder("infer")
            .with_kind(SpanKind::Server)
            .with_trace_id(self.ids.trace_id)
            .with_span_id(self.ids.span_id)
            .with_attributes(attributes)
            .with_status(status);
        emit(&self.tracer, root, &parent, &clock, (self.received, end));
        let own = parent_context(local(self.ids));
        let child =
            |name: &'static str| self.tracer.span_builder(name).with_kind(SpanKind::Internal);
        emit(
            &self.tracer,
            child("receive and decode"),
            &own,
            &clock,
            (self.received, self.submitted),
        );
        if let Some(answered) = self.answered {
            emit(
                &self.tracer,
                child("encode and respond"),
                &own,
                &clock,
                (answered, end),
            );
        }
    }
}

/// What an instance knows of a batch that held sampled requests.
pub(crate) struct BatchRecord<'a> {
    pub(crate) model: &'a str,
    pub(crate) version: &'a str,
    /// When the instance took the batch.
    pub(crate) started: Instant,
    /// Building the boundary batch began, `run` was called, `run` returned
    /// (`None`: the batch failed before or in `run`).
    pub(crate) stages: Option<(Instant, Instant, Instant)>,
    pub(crate) requests: usize,
    pub(crate) rows: usize,
    pub(crate) error: Option<&'a str>,
    /// The sampled requests: their span, and when each was queued.
    pub(crate) members: Vec<(SpanIds, Instant)>,
    /// What the worker recorded while it ran the batch.
    pub(crate) worker: Vec<super::worker::WorkerRecord>,
}

/// The batch's span (its own trace, linked to each sampled request's span) and,
/// under each sampled request's span, its `queue`, `batch formation` and
/// `worker run`.
pub(crate) fn record_batch(b: BatchRecord<'_>) {
    let Some(exporting) = super::EXPORTING.get() else {
        return;
    };
    let tracer = &exporting.tracer;
    let clock = Clock::now();
    let batch_ids = SpanIds {
        trace_id: opentelemetry_sdk::trace::IdGenerator::new_trace_id(
            &opentelemetry_sdk::trace::RandomIdGenerator::default(),
        ),
        span_id: opentelemetry_sdk::trace::IdGenerator::new_span_id(
            &opentelemetry_sdk::trace::RandomIdGenerator::default(),
        ),
    };
    let mut attributes = vec![
        KeyValue::new("kiln.model", b.model.to_owned()),
        KeyValue::new("kiln.model.version", b.version.to_owned()),
        KeyValue::new("kiln.batch.size", b.requests as i64),
        KeyValue::new("kiln.batch.rows", b.rows as i64),
        KeyValue::new(
            "kiln.outcome",
            if b.error.is_some() { "error" } else { "ok" },
        ),
    ];
    if let Some(e) = b.error {
        attributes.push(KeyValue::new("error.message", e.to_owned()));
    }
    let links = b
        .members
        .iter()
        .map(|(ids, _)| Link::with_context(local(*ids)))
        .collect();
    let (worker_spans, events): (Vec<_>, Vec<_>) =
        b.worker.into_iter().partition(|r| r.end.is_some());
    let events = events
        .into_iter()
        .map(|e| opentelemetry::trace::Event::new(e.name, e.start, e.attributes, 0))
        .collect();
    let batch = tracer
        .span_builder("batch")
        .with_events(events)
        .with_kind(SpanKind::Internal)
        .with_trace_id(batch_ids.trace_id)
        .with_span_id(batch_ids.span_id)
        .with_attributes(attributes)
        .with_links(links)
        .with_status(b.error.map_or(opentelemetry::trace::Status::Ok, |e| {
            opentelemetry::trace::Status::error(e.to_owned())
        }));
    emit(tracer, batch, &Context::new(), &clock, (b.started, clock.1));
    let in_batch = parent_context(local(batch_ids));
    for record in worker_spans {
        use opentelemetry::trace::Span as _;
        let mut span = tracer
            .span_builder(record.name)
            .with_kind(SpanKind::Internal)
            .with_start_time(record.start)
            .with_attributes(record.attributes)
            .start_with_context(tracer, &in_batch);
        span.end_with_timestamp(record.end.unwrap_or(record.start));
    }
    let to_batch = || vec![Link::with_context(local(batch_ids))];
    for (ids, arrived) in &b.members {
        let own = parent_context(local(*ids));
        let child = |name: &'static str| {
            tracer
                .span_builder(name)
                .with_kind(SpanKind::Internal)
                .with_links(to_batch())
        };
        emit(tracer, child("queue"), &own, &clock, (*arrived, b.started));
        if let Some((building, built, ran)) = b.stages {
            emit(
                tracer,
                child("batch formation"),
                &own,
                &clock,
                (building, built),
            );
            emit(tracer, child("worker run"), &own, &clock, (built, ran));
        }
    }
}
