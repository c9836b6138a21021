//! What kiln tells operators: Prometheus metrics (`metrics`, `process_metrics`,
//! `stream_metrics`), Triton's statistics (`stats`), logs (`logging`, `request_log`)
//! and OpenTelemetry tracing (`trace`).

pub mod logging;
pub mod metrics;
pub mod process_metrics;
pub mod request_log;
pub mod stats;
pub mod stream_metrics;
pub mod trace;
