//! The WebSocket ingress's metrics (kiln-server's `stream` module), per model:
//! sessions, frames, drops and each frame's latency. Registered with the rest
//! ([`crate::observe::metrics::Metrics`]); a session takes its model's handles once as it
//! opens, so a frame only touches atomics and the histogram's lock.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    model: String,
    reason: String,
}

/// Why a frame was dropped, as counted in `kiln_stream_frames_dropped_total{reason}`
/// (see docs/websocket.md, "Flow control").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// A waiting frame displaced by a newer one: the client sends faster than the
    /// model answers.
    Overrun,
    /// An unsent result displaced by a newer one: the client reads too slowly.
    SlowReader,
    /// The model's queue refused the frame.
    Rejected,
    /// The server's client-bytes budget (`--max-client-bytes`) had no room for
    /// the decoded frame or its result.
    Memory,
}

impl DropReason {
    /// Every reason, in the order of [`DropReason::index`].
    pub const ALL: [DropReason; 4] = [
        DropReason::Overrun,
        DropReason::SlowReader,
        DropReason::Rejected,
        DropReason::Memory,
    ];

    /// The label value (and the key in the stream's `dropped` object).
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Overrun => "overrun",
            DropReason::SlowReader => "slow_reader",
            DropReason::Rejected => "rejected",
            DropReason::Memory => "memory",
        }
    }

    /// Its place in [`DropReason::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~210 s
    Histogram::new(exponential_buckets(1e-4, 2.0, 22))
}

type HistogramFamily = Family<ModelLabels, Histogram, fn() -> Histogram>;

/// The stream families.
pub struct StreamMetrics {
    sessions: Family<ModelLabels, Gauge>,
    opened: Family<ModelLabels, Counter>,
    frames: Family<ModelLabels, Counter>,
    errors: Family<ModelLabels, Counter>,
    dropped: Family<DropLabels, Counter>,
    latency: HistogramFamily,
}

/// One model's stream handles.
#[derive(Clone)]
pub struct ModelStreamMetrics {
    /// Open sessions.
    pub sessions: Gauge,
    /// Sessions opened.
    pub opened: Counter,
    /// Frames received from clients or read from sources.
    pub frames: Counter,
    /// Frames answered with an error message.
    pub errors: Counter,
    /// Frames dropped, by [`DropReason::index`].
    pub dropped: [Counter; DropReason::ALL.len()],
    /// A frame's arrival to its result ready to send, in seconds.
    pub latency: Histogram,
}

impl StreamMetrics {
    /// The families, registered in `registry`.
    pub fn register(registry: &mut Registry) -> StreamMetrics {
        let metrics = StreamMetrics {
            sessions: Family::default(),
            opened: Family::default(),
            frames: Family::default(),
            errors: Family::default(),
            dropped: Family::default(),
            latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
        };
        registry.register(
            "kiln_stream_sessions",
            "Open WebSocket stream sessions",
            metrics.sessions.clone(),
        );
        registry.register(
            "kiln_stream_sessions_opened",
            "WebSocket stream sessions opened",
            metrics.opened.clone(),
        );
        registry.register(
            "kiln_stream_frames",
            "Stream frames received from clients or read from server-side sources",
            metrics.frames.clone(),
        );
        registry.register(
            "kiln_stream_frame_errors",
            "Stream frames answered with an error message",
            metrics.errors.clone(),
        );
        registry.register(
            "kiln_stream_frames_dropped",
            "Stream frames dropped by flow control or refused by the model's queue, by reason",
            metrics.dropped.clone(),
        );
        registry.register(
            "kiln_stream_frame_duration_seconds",
            "Time from a stream frame's arrival to its result ready to send",
            metrics.latency.clone(),
        );
        metrics
    }

    /// Drops every stream series of `model` (after it is unloaded).
    pub fn remove(&self, model: &str) {
        let m = ModelLabels {
            model: model.to_owned(),
        };
        self.sessions.remove(&m);
        self.opened.remove(&m);
        self.frames.remove(&m);
        self.errors.remove(&m);
        self.latency.remove(&m);
        for reason in DropReason::ALL {
            self.dropped.remove(&DropLabels {
                model: model.to_owned(),
                reason: reason.as_str().to_owned(),
            });
        }
    }

    /// The handles for `model`, created on first use.
    pub fn model(&self, model: &str) -> ModelStreamMetrics {
        let m = ModelLabels {
            model: model.to_owned(),
        };
        let dropped = DropReason::ALL.map(|reason| {
            self.dropped.get_or_create_owned(&DropLabels {
                model: model.to_owned(),
                reason: reason.as_str().to_owned(),
            })
        });
        ModelStreamMetrics {
            sessions: self.sessions.get_or_create_owned(&m),
            opened: self.opened.get_or_create_owned(&m),
            frames: self.frames.get_or_create_owned(&m),
            errors: self.errors.get_or_create_owned(&m),
            dropped,
            latency: self.latency.get_or_create_owned(&m),
        }
    }
}
