//! What a model name serves ([`Served`]): a worker group or an ensemble, each only
//! what it is (an ensemble has no queue, pool, batcher or instance to ask about),
//! with what they share as [`Model`]: name, version, tensors, readiness and
//! statistics. `Served` derefs to `dyn Model`, so code that needs only the shared
//! part (metadata, readiness, statistics) reads `served.endpoint()` and matches
//! on nothing; code that needs a group's or an ensemble's own parts matches.

use std::ops::Deref;
use std::sync::{Arc, Weak};

use kiln_worker_sdk::WorkerInfo;

use crate::ensemble::Ensemble;
use crate::error::{Result, ServerError};
use crate::group::WorkerGroup;
use crate::observe::metrics::ModelMetrics;
use crate::observe::stats::ModelStats;
use crate::request::infer::InferRequest;

/// What a worker group and an ensemble both are: a model clients address.
pub trait Model: Send + Sync {
    /// Its name.
    fn endpoint(&self) -> &str;
    /// The version it serves.
    fn version(&self) -> &str;
    /// Its tensors as clients see them.
    fn info(&self) -> &Arc<WorkerInfo>;
    /// Whether it can answer requests now.
    fn is_ready(&self) -> bool;
    /// The rows a request may carry (what a request is validated against).
    fn batch_size(&self) -> usize;
    /// Its Triton-style statistics.
    fn stats(&self) -> &ModelStats;
    /// Its Prometheus metrics.
    fn metrics(&self) -> &ModelMetrics;

    /// Counts a request for this model refused before validation (undecodable).
    fn record_invalid(&self) {
        self.metrics().invalid.inc();
    }

    /// Requests pending (accepted, not answered) and answered or refused so far,
    /// for housekeeping: a few atomic loads.
    fn activity(&self) -> (i64, u64) {
        let m = self.metrics();
        let ended = [
            &m.success,
            &m.failure,
            &m.rejected,
            &m.invalid,
            &m.unavailable,
            &m.timeout,
            &m.cancelled,
        ]
        .iter()
        .map(|c| c.get())
        .sum();
        (m.pending.get(), ended)
    }
}

impl Model for WorkerGroup {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }
    fn version(&self) -> &str {
        &self.version
    }
    fn info(&self) -> &Arc<WorkerInfo> {
        &self.info
    }
    fn is_ready(&self) -> bool {
        WorkerGroup::is_ready(self)
    }
    fn batch_size(&self) -> usize {
        self.settings.batch_size
    }
    fn stats(&self) -> &ModelStats {
        self.counters().0
    }
    fn metrics(&self) -> &ModelMetrics {
        self.counters().1
    }
}

impl Model for Ensemble {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }
    fn version(&self) -> &str {
        &self.version
    }
    fn info(&self) -> &Arc<WorkerInfo> {
        &self.info
    }
    fn is_ready(&self) -> bool {
        Ensemble::is_ready(self)
    }
    fn batch_size(&self) -> usize {
        Ensemble::batch_size(self)
    }
    fn stats(&self) -> &ModelStats {
        self.counters().0
    }
    fn metrics(&self) -> &ModelMetrics {
        self.counters().1
    }
}

/// What a name serves (one version of it).
#[derive(Clone)]
pub enum Served {
    /// A worker's group: its queue, batcher, pool and instances.
    Group(Arc<WorkerGroup>),
    /// An ensemble: steps run on other models' groups.
    Ensemble(Arc<Ensemble>),
}

impl Deref for Served {
    type Target = dyn Model;

    fn deref(&self) -> &(dyn Model + 'static) {
        match self {
            Served::Group(group) => group.as_ref(),
            Served::Ensemble(ensemble) => ensemble.as_ref(),
        }
    }
}

impl Served {
    /// The worker group, if it is one.
    pub fn group(&self) -> Option<&Arc<WorkerGroup>> {
        match self {
            Served::Group(group) => Some(group),
            Served::Ensemble(_) => None,
        }
    }

    /// The ensemble, if it is one.
    pub fn ensemble(&self) -> Option<&Arc<Ensemble>> {
        match self {
            Served::Group(_) => None,
            Served::Ensemble(ensemble) => Some(ensemble),
        }
    }

    /// The worker group, to scale or to ask about its instances; an ensemble is
    /// refused (400): it has no instances of its own.
    pub fn scalable(&self) -> Result<&Arc<WorkerGroup>> {
        match self {
            Served::Group(group) => Ok(group),
            Served::Ensemble(ensemble) => Err(ServerError::invalid(format!(
                "`{}` is an ensemble: its steps' models have the instances",
                ensemble.endpoint
            ))),
        }
    }

    /// Checks `request` as admission would, without queuing or starting it (the
    /// job API validates each job at submission). Counts nothing.
    pub fn check(&self, request: &InferRequest) -> Result<()> {
        match self {
            Served::Group(group) => group.check(request),
            Served::Ensemble(ensemble) => ensemble.check(request),
        }
    }

    /// The lowest priority level its requests may ask for (a group's batcher's;
    /// an ensemble's is 1, its requests' priority going to every step as it is).
    pub fn lowest_priority(&self) -> u32 {
        self.group().map_or(1, |group| group.lowest_priority())
    }

    /// Whether both are the same loaded model (not merely alike).
    pub fn is(&self, other: &Served) -> bool {
        match (self, other) {
            (Served::Group(a), Served::Group(b)) => Arc::ptr_eq(a, b),
            (Served::Ensemble(a), Served::Ensemble(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// A reference that does not keep it loaded.
    pub fn downgrade(&self) -> WeakServed {
        match self {
            Served::Group(group) => WeakServed::Group(Arc::downgrade(group)),
            Served::Ensemble(ensemble) => WeakServed::Ensemble(Arc::downgrade(ensemble)),
        }
    }
}

/// A [`Served`] that does not keep it loaded ([`Served::downgrade`]).
#[derive(Clone)]
pub enum WeakServed {
    Group(Weak<WorkerGroup>),
    Ensemble(Weak<Ensemble>),
}

impl WeakServed {
    /// Whether it is `served`, still loaded.
    pub fn is(&self, served: &Served) -> bool {
        match (self, served) {
            (WeakServed::Group(weak), Served::Group(group)) => {
                weak.upgrade().is_some_and(|g| Arc::ptr_eq(&g, group))
            }
            (WeakServed::Ensemble(weak), Served::Ensemble(ensemble)) => {
                weak.upgrade().is_some_and(|e| Arc::ptr_eq(&e, ensemble))
            }
            _ => false,
        }
    }
}

impl Served {
    /// Names `next` as what took this one's place (before this one drains): a
    /// group's requests that reach it after it stopped taking them go there, when
    /// `next` is a group too (an ensemble takes nothing that way).
    pub fn replaced_by(&self, next: &Served) {
        if let (Served::Group(old), Served::Group(next)) = (self, next) {
            old.replaced_by(next);
        }
    }

    /// Refuses new requests and answers every accepted one ([`WorkerGroup::drain`]).
    /// An ensemble holds nothing of its own: its requests in flight are their
    /// callers' futures, its steps in its step models' groups.
    pub fn drain(&self) {
        if let Served::Group(group) = self {
            group.drain();
        }
    }
}
