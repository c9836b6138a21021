//! Worker spans and events in the request's trace, with no OpenTelemetry in the
//! plugin: the host hands each plugin a callback set (as it does for logging,
//! [`crate::logging`]), and what a worker records while its `run` is traced
//! becomes a child span (or an event) of that batch's span on the host.
//!
//! ```no_run
//! # fn infer() {}
//! let mut span = kiln_worker_sdk::trace::span("preprocess");
//! span.attribute("pixels", 640 * 480);
//! infer();
//! drop(span); // ends it
//! kiln_worker_sdk::trace::event("cache miss", &[("key", "abc")]);
//! ```
//!
//! When the running batch is not traced (the usual case) [`span`] and [`event`]
//! cost one call into the host and allocate nothing.

use std::fmt::Display;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use abi_stable::std_types::{RSlice, RStr, Tuple2};
use abi_stable::StableAbi;

/// An attribute crossing the boundary: key and value.
pub type AttributeFfi<'a> = Tuple2<RStr<'a>, RStr<'a>>;

/// The host's tracing callbacks.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct TraceSink {
    /// Whether the batch this thread runs now is traced.
    pub enabled: extern "C" fn() -> bool,
    /// A span the worker timed: start and end in nanoseconds since the Unix epoch.
    pub span: extern "C" fn(
        name: RStr<'_>,
        start: u64,
        end: u64,
        attributes: RSlice<'_, AttributeFfi<'_>>,
    ),
    /// An event at `at` (nanoseconds since the Unix epoch).
    pub event: extern "C" fn(name: RStr<'_>, at: u64, attributes: RSlice<'_, AttributeFfi<'_>>),
}

static SINK: OnceLock<TraceSink> = OnceLock::new();

/// Installs the host's callbacks for this plugin (first call wins).
pub fn install(sink: TraceSink) {
    let _ = SINK.set(sink);
}

/// Whether what the worker records now reaches a trace: the batch it runs holds
/// a sampled request. Check it before computing costly attributes.
pub fn enabled() -> bool {
    SINK.get().is_some_and(|sink| (sink.enabled)())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos().min(u128::from(u64::MAX)) as u64)
}

/// A span of the worker's, from [`span`] until dropped.
#[must_use = "a span ends when dropped"]
pub struct Span {
    /// `None` while the batch is not traced: nothing is kept.
    open: Option<Open>,
}

/// A traced span's name, start (ns since the epoch) and attributes.
struct Open {
    name: String,
    start: u64,
    attributes: Vec<(String, String)>,
}

/// Starts a span named `name` under the running batch's span.
pub fn span(name: &str) -> Span {
    Span {
        open: enabled().then(|| Open {
            name: name.to_owned(),
            start: now(),
            attributes: Vec::new(),
        }),
    }
}

impl Span {
    /// Adds an attribute (kept only while traced).
    pub fn attribute(&mut self, key: &str, value: impl Display) {
        if let Some(open) = &mut self.open {
            open.attributes.push((key.to_owned(), value.to_string()));
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let (Some(open), Some(sink)) = (self.open.take(), SINK.get()) else {
            return;
        };
        let attributes: Vec<AttributeFfi<'_>> = open
            .attributes
            .iter()
            .map(|(k, v)| Tuple2(k.as_str().into(), v.as_str().into()))
            .collect();
        let name = open.name.as_str().into();
        (sink.span)(name, open.start, now(), attributes.as_slice().into());
    }
}

/// Records an event named `name`, now, on the running batch's span.
pub fn event(name: &str, attributes: &[(&str, &str)]) {
    if !enabled() {
        return;
    }
    if let Some(sink) = SINK.get() {
        let attributes: Vec<AttributeFfi<'_>> = attributes
            .iter()
            .map(|(k, v)| Tuple2((*k).into(), (*v).into()))
            .collect();
        (sink.event)(name.into(), now(), attributes.as_slice().into());
    }
}
