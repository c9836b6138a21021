//! A loaded ensemble: what its name serves ([`crate::models::Served::Ensemble`]).
//! It has no worker, queue, pool or thread of its own: its checked graph, the
//! groups its steps run on (bound again by the Manager whenever the loaded models
//! change, [`super::bind`]), and the statistics its requests are counted in.

use std::sync::Arc;

use arc_swap::ArcSwap;
use kiln_worker_sdk::WorkerInfo;

use super::plan::Plan;
use crate::error::Result;
use crate::group::WorkerGroup;
use crate::observe::metrics::ModelMetrics;
use crate::observe::stats::ModelStats;
use crate::params::RequestParams;
use crate::request::infer::{validate, InferRequest};

/// The groups an ensemble's steps run on, in step order, or why it cannot run.
pub type StepGroups = std::result::Result<Vec<Arc<WorkerGroup>>, String>;

/// A loaded ensemble (version `version` of `endpoint`).
pub struct Ensemble {
    pub endpoint: String,
    pub version: String,
    /// Its tensors as clients see them (the plan's declared inputs and outputs).
    pub info: Arc<WorkerInfo>,
    pub plan: Arc<Plan>,
    steps: ArcSwap<StepGroups>,
    stats: Arc<ModelStats>,
    metrics: Arc<ModelMetrics>,
}

impl Ensemble {
    /// Ensemble `plan` as version `version`, its steps run on `steps`.
    pub fn new(version: &str, plan: Plan, steps: StepGroups, metrics: ModelMetrics) -> Ensemble {
        Ensemble {
            endpoint: plan.name.clone(),
            version: version.to_owned(),
            info: Arc::new(plan.info.clone()),
            plan: Arc::new(plan),
            steps: ArcSwap::from_pointee(steps),
            stats: Arc::default(),
            metrics: Arc::new(metrics),
        }
    }

    /// The rows a request may carry: the declared `max_batch_size`, at least 1
    /// (what [`crate::request::infer::validate`] checks a request against).
    pub fn batch_size(&self) -> usize {
        (self.plan.info.max_batch_size as usize).max(1)
    }

    /// The groups its steps run on now (or why it cannot run).
    pub fn steps(&self) -> Arc<StepGroups> {
        self.steps.load_full()
    }

    /// Binds the steps to `steps` (the Manager, as the loaded models change).
    pub(crate) fn rebind(&self, steps: StepGroups) {
        self.steps.store(Arc::new(steps));
    }

    /// Whether every step's model is bound and ready.
    pub fn is_ready(&self) -> bool {
        self.steps
            .load()
            .as_ref()
            .as_ref()
            .is_ok_and(|steps| steps.iter().all(|g| g.is_ready()))
    }

    /// Whether a step's model calls models (a worker calling an ensemble that
    /// holds it, or holds another caller, would wait on itself).
    pub fn is_caller(&self) -> bool {
        self.steps
            .load()
            .as_ref()
            .as_ref()
            .is_ok_and(|steps| steps.iter().any(|g| g.is_caller()))
    }

    /// Checks `request` as admission would (its scheduling parameters, names,
    /// datatypes, shapes, sizes) without starting it: the job API validates each
    /// job at submission. Counts nothing.
    pub fn check(&self, request: &InferRequest) -> Result<()> {
        RequestParams::parse(&request.parameters)?;
        let tensors = InferRequest {
            inputs: request.inputs.clone(),
            outputs: request.outputs.clone(),
            ..InferRequest::default()
        };
        validate(&self.info, self.batch_size(), tensors).map(|_| ())
    }

    /// The statistics and metrics its requests are counted in.
    pub(crate) fn counters(&self) -> (&Arc<ModelStats>, &Arc<ModelMetrics>) {
        (&self.stats, &self.metrics)
    }
}
