//! The dispatcher's metrics (docs/metrics.md): the budget's figures, jobs in
//! flight, jobs by state, and what was dispatched, completed, failed, released.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::budget::Figures;
use crate::queue::{JobState, StateCounts};

/// A gauge of a fraction.
type Fraction = Gauge<f64, AtomicU64>;

/// The `state` label of `kiln_jobs`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

/// The `reason` label of `kiln_jobs_released_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// Every metric of the dispatcher; cheap to clone (the families are shared).
#[derive(Clone, Default)]
pub struct DispatchMetrics {
    pub budget: Gauge,
    pub f_sys: Fraction,
    pub f_q: Fraction,
    pub d: Fraction,
    pub max_sys: Gauge,
    pub in_flight: Gauge,
    pub jobs: Family<StateLabel, Gauge>,
    pub dispatched: Counter,
    pub completed: Counter,
    pub failed: Counter,
    pub released: Family<ReasonLabel, Counter>,
    pub overloads: Counter,
}

impl DispatchMetrics {
    /// Registers every family in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kiln_dispatch_budget",
            "Jobs the dispatcher may have in flight now: floor(max_sys × min(D, u)), 0 when D ≤ 0, the target unreadable or overloaded",
            self.budget.clone(),
        );
        registry.register(
            "kiln_dispatch_f_sys",
            "F_sys: realtime requests in the target's batches over max_sys",
            self.f_sys.clone(),
        );
        registry.register(
            "kiln_dispatch_f_q",
            "F_q: realtime requests waiting in the target's queues over max_sys",
            self.f_q.clone(),
        );
        registry.register(
            "kiln_dispatch_headroom",
            "D, the headroom: 1 - (F_sys + F_q + B)",
            self.d.clone(),
        );
        registry.register(
            "kiln_dispatch_max_sys",
            "max_sys: what the target can have in flight",
            self.max_sys.clone(),
        );
        registry.register(
            "kiln_dispatch_in_flight",
            "Jobs dispatched to the target and not yet answered",
            self.in_flight.clone(),
        );
        registry.register("kiln_jobs", "Jobs in the store by state", self.jobs.clone());
        registry.register(
            "kiln_jobs_dispatched",
            "Jobs sent to the target",
            self.dispatched.clone(),
        );
        registry.register(
            "kiln_jobs_completed",
            "Jobs that ran to a response",
            self.completed.clone(),
        );
        registry.register(
            "kiln_jobs_failed",
            "Jobs that ran to an error",
            self.failed.clone(),
        );
        registry.register(
            "kiln_jobs_released",
            "Jobs sent back to the queue without running, by reason (overloaded, unavailable, stale, stopped)",
            self.released.clone(),
        );
        registry.register(
            "kiln_dispatch_overloads",
            "Overload answers from the target (each drops the budget to 0 until a fresh reading)",
            self.overloads.clone(),
        );
    }

    /// Sets the budget's gauges.
    pub fn set_figures(&self, f: &Figures, in_flight: usize) {
        self.budget.set(f.budget as i64);
        self.f_sys.set(f.f_sys);
        self.f_q.set(f.f_q);
        self.d.set(f.d);
        self.max_sys.set(f.max_sys as i64);
        self.in_flight.set(in_flight as i64);
    }

    /// Sets `kiln_jobs{state}`.
    pub fn set_counts(&self, counts: &StateCounts) {
        for state in JobState::ALL {
            self.jobs
                .get_or_create(&StateLabel {
                    state: state.as_str(),
                })
                .set(counts.get(state) as i64);
        }
    }
}
