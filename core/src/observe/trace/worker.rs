//! The host's side of the workers' spans and events
//! (`kiln_worker_sdk::trace`): while an instance thread runs a batch that holds a
//! sampled request, what its worker records is collected here (thread-local, at
//! most [`MAX_PER_BATCH`]), then becomes children and events of the batch's span.
//! While the batch is not traced nothing is collected.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kiln_worker_sdk::reexports::{RSlice, RStr};
use kiln_worker_sdk::trace::{AttributeFfi, TraceSink};
use opentelemetry::KeyValue;

/// Most spans and events one batch's worker may record; the rest are dropped.
pub const MAX_PER_BATCH: usize = 256;

/// A span (with an end) or an event (without) a worker recorded.
pub(crate) struct WorkerRecord {
    pub(crate) name: String,
    pub(crate) start: SystemTime,
    pub(crate) end: Option<SystemTime>,
    pub(crate) attributes: Vec<KeyValue>,
}

thread_local! {
    static COLLECTED: RefCell<Option<Vec<WorkerRecord>>> = const { RefCell::new(None) };
}

/// Starts collecting what this thread's worker records.
pub(crate) fn begin() {
    COLLECTED.with(|c| *c.borrow_mut() = Some(Vec::new()));
}

/// Stops collecting; returns what was recorded.
pub(crate) fn end() -> Vec<WorkerRecord> {
    COLLECTED
        .with(|c| c.borrow_mut().take())
        .unwrap_or_default()
}

/// The callbacks handed to each plugin.
pub fn plugin_trace_sink() -> TraceSink {
    TraceSink {
        enabled,
        span,
        event,
    }
}

extern "C" fn enabled() -> bool {
    COLLECTED.with(|c| c.try_borrow().is_ok_and(|c| c.is_some()))
}

fn time(nanos: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(nanos)
}

fn push(record: impl FnOnce() -> WorkerRecord) {
    // Nothing may unwind into the plugin.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        COLLECTED.with(|c| {
            if let Ok(mut c) = c.try_borrow_mut() {
                if let Some(records) = c.as_mut().filter(|r| r.len() < MAX_PER_BATCH) {
                    records.push(record());
                }
            }
        })
    }));
}

fn attributes(attributes: RSlice<'_, AttributeFfi<'_>>) -> Vec<KeyValue> {
    attributes
        .iter()
        .map(|kv| {
            KeyValue::new(
                format!("worker.{}", kv.0.as_str()),
                kv.1.as_str().to_owned(),
            )
        })
        .collect()
}

extern "C" fn span(name: RStr<'_>, start: u64, end: u64, attrs: RSlice<'_, AttributeFfi<'_>>) {
    push(|| WorkerRecord {
        name: name.as_str().to_owned(),
        start: time(start),
        end: Some(time(end.max(start))),
        attributes: attributes(attrs),
    });
}

extern "C" fn event(name: RStr<'_>, at: u64, attrs: RSlice<'_, AttributeFfi<'_>>) {
    push(|| WorkerRecord {
        name: name.as_str().to_owned(),
        start: time(at),
        end: None,
        attributes: attributes(attrs),
    });
}
