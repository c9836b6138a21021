//! What every log line about one request carries, and the one macro that writes
//! such lines ([`request_log!`]). The [`RequestLog`] travels with the request (in
//! its [`crate::request::answer::Reply`]) from admission to its answer, so a line written on
//! any thread (the ingress, the batcher, the instance) names the same request.
//!
//! It holds the request id and, when the request is traced, its trace id
//! ([`crate::observe::trace`]): a line about a traced request can be found in the trace and
//! the trace's spans from the line.

use std::sync::atomic::{AtomicBool, Ordering};

/// The context of the log lines about one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestLog {
    /// The client's request id (KServe's `id`); `None` when it gave none.
    pub id: Option<String>,
    /// The request's trace id, when it is traced (sampled). Boxed: a request
    /// that is not traced carries one word for it (it travels with the request
    /// through the group's queue and its batch).
    pub trace_id: Option<Box<opentelemetry::trace::TraceId>>,
}

/// What a line shows for a request without an id (Triton's words).
pub const UNKNOWN_ID: &str = "<id_unknown>";

impl RequestLog {
    /// The request id as log lines show it.
    pub fn request_id(&self) -> &str {
        self.id.as_deref().unwrap_or(UNKNOWN_ID)
    }
}

/// Logs a line about one request: `request_log!(level, &RequestLog, "format", args…)`.
/// The line carries the request's key-values (`request_id`, and `trace_id` when the
/// request is traced), which every log format writes (`{ request_id=… }`, JSON's
/// `kv`). Costs a level check when the level is off.
#[macro_export]
macro_rules! request_log {
    ($level:expr, $log:expr, $($arg:tt)+) => {{
        let log: &$crate::observe::request_log::RequestLog = $log;
        match log.trace_id.as_deref() {
            Some(trace_id) => spdlog::log!(
                $level,
                $($arg)+,
                kv: { request_id = log.request_id(), trace_id: = *trace_id }
            ),
            None => spdlog::log!($level, $($arg)+, kv: { request_id = log.request_id() }),
        }
    }};
}

/// The ids of several requests (a batch's) as one log value: `a,b,<id_unknown>`.
pub fn request_ids<'a>(logs: impl Iterator<Item = &'a RequestLog>) -> String {
    let mut ids = String::new();
    for log in logs {
        if !ids.is_empty() {
            ids.push(',');
        }
        ids.push_str(log.request_id());
    }
    ids
}

/// Logs (verbose level 1: `debug`) that one request for `model` was answered with
/// `error`.
pub fn failed(log: &RequestLog, model: &str, error: &dyn std::fmt::Display) {
    request_log!(
        spdlog::Level::Debug,
        log,
        "model `{model}`: request failed: {error}"
    );
}

/// Whether lines about requests are written at the verbose level 1 (`debug`): a
/// copy of the logger's setting that the hot path can read for the price of a
/// plain load (`spdlog::default_logger()` clones an `Arc` on each call). Set by
/// whoever sets up the logger (`kiln_server::log_settings`).
static VERBOSE: AtomicBool = AtomicBool::new(false);

/// Records whether verbose (`debug`) lines are written.
pub fn set_verbose(on: bool) {
    VERBOSE.store(on, Ordering::Relaxed);
}

/// A [`RequestLog`] for `id` (and the request's `trace_id`), copied only when
/// [`failed`] lines are written: for a line that may come after the id has gone
/// into an answer, without a copy per request otherwise.
pub fn when_logged(
    id: &Option<String>,
    trace_id: Option<opentelemetry::trace::TraceId>,
) -> RequestLog {
    if VERBOSE.load(Ordering::Relaxed) {
        RequestLog {
            id: id.clone(),
            trace_id: trace_id.map(Box::new),
        }
    } else {
        RequestLog::default()
    }
}
