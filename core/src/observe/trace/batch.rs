//! What an instance thread keeps of a batch for its trace: the batch's sampled
//! requests (usually none, and then nothing is allocated or recorded), what the
//! worker recorded while running it, and, once answered, its spans.

use std::time::Instant;

use super::spans::{record_batch, BatchRecord};
use super::worker::{self, WorkerRecord};
use super::SpanIds;

/// A batch's trace, from when an instance takes it until it is answered.
pub(crate) struct BatchTrace {
    members: Vec<(SpanIds, Instant)>,
    worker: Vec<WorkerRecord>,
    started: Instant,
    requests: usize,
    rows: usize,
}

impl BatchTrace {
    /// `members`: each request's span (if sampled) and when it was queued.
    pub(crate) fn of(
        members: impl Iterator<Item = (Option<SpanIds>, Instant)>,
        started: Instant,
        requests: usize,
        rows: usize,
    ) -> BatchTrace {
        BatchTrace {
            members: members
                .filter_map(|(ids, arrived)| ids.map(|ids| (ids, arrived)))
                .collect(),
            worker: Vec::new(),
            started,
            requests,
            rows,
        }
    }

    /// While the worker runs a traced batch, its spans and events are collected.
    pub(crate) fn begin_worker(&self) {
        if !self.members.is_empty() {
            worker::begin();
        }
    }

    pub(crate) fn end_worker(&mut self) {
        if !self.members.is_empty() {
            self.worker = worker::end();
        }
    }

    /// ` (trace_id ...)`: the traces of the batch's sampled requests, for a log
    /// line about the batch (empty when none is sampled).
    pub(crate) fn log_suffix(&self) -> String {
        if self.members.is_empty() {
            return String::new();
        }
        let ids: Vec<String> = self
            .members
            .iter()
            .map(|(ids, _)| ids.trace_id.to_string())
            .collect();
        format!(" (trace_id {})", ids.join(", "))
    }

    /// The batch's span and its sampled requests' `queue`, `batch formation` and
    /// `worker run` spans, once the batch is answered (`stages`: building began,
    /// `run` called, `run` returned; `None` when the batch failed).
    pub(crate) fn record(
        self,
        model: &str,
        version: &str,
        stages: Option<(Instant, Instant, Instant)>,
        error: Option<&str>,
    ) {
        if self.members.is_empty() {
            return;
        }
        record_batch(BatchRecord {
            model,
            version,
            started: self.started,
            stages,
            requests: self.requests,
            rows: self.rows,
            error,
            members: self.members,
            worker: self.worker,
        });
    }
}
