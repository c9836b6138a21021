//! One ensemble request in flight: a future that submits each step as soon as
//! every tensor it reads exists, and answers once every step has.
//!
//! Each step's request is admitted by its model's group ([`crate::group::WorkerGroup::submit`],
//! the admission of [`crate::request::serve::submit`]), so it is validated, queued and
//! batched with every other request to that model. Nothing waits on a thread: the
//! steps in flight are the future's, polled by whoever awaits the ensemble's
//! [`crate::request::serve::Admitted`]; a step answered during a poll submits the steps it
//! completes, in that poll. Steps whose inputs exist at admission are submitted
//! there, on the caller's thread.
//!
//! - An error in a step ends the request with that error, prefixed with the
//!   ensemble and the step (its kind, so its status code, kept; a step's 404 is a
//!   503: the ensemble exists, a step's model went away). Steps still in flight are
//!   dropped, which cancels them; no further step is submitted.
//! - Dropping the future (a client gone, a gRPC deadline passed) drops the steps in
//!   flight (cancelling them: the dynamic batcher takes a cancelled request out of
//!   its queue) and submits nothing more; counted `cancelled`.
//! - The request's parameters go to every step. Its `timeout` (Triton's, in µs) is a
//!   deadline on the whole ensemble: each step is given what remains of it, and a
//!   step due after it has passed is not submitted (503).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kiln_worker_sdk::{DataType, Param, ParamValue, Params};
use tokio::sync::oneshot;

use super::loaded::{Ensemble, StepGroups};
use super::plan::Plan;
use crate::error::{Result, ServerError};
use crate::observe::metrics::ModelMetrics;
use crate::observe::request_log::RequestLog;
use crate::observe::stats::{nanos, ModelStats};
use crate::request::answer::{Answer, Delivery};
use crate::request::infer::{validate, InferRequest, InferResponse, InputTensor, OutputTensor};

/// A tensor of the ensemble, once written.
struct Value {
    dtype: DataType,
    shape: Vec<i64>,
    data: Bytes,
}

/// An ensemble request in flight (see the module's documentation).
pub struct Run {
    plan: Arc<Plan>,
    version: String,
    steps: Arc<StepGroups>,
    stats: Arc<ModelStats>,
    metrics: Arc<ModelMetrics>,
    /// By tensor id.
    tensors: Vec<Option<Value>>,
    /// Per step: tensors it still waits for.
    needs: Vec<usize>,
    in_flight: Vec<(usize, oneshot::Receiver<Answer>)>,
    /// Steps not yet answered.
    left: usize,
    parameters: Vec<Param>,
    deadline: Option<Instant>,
    id: Option<String>,
    output_mask: u64,
    rows: usize,
    arrived: Instant,
    /// Answered (or failed): not a cancellation when dropped.
    ended: bool,
}

impl Run {
    /// Admits `request` to `ensemble`: validates it against the ensemble's inputs
    /// and submits the steps that need only them. A refusal is logged by the
    /// caller ([`crate::request::serve::submit`]).
    pub fn start(ensemble: &Ensemble, request: InferRequest) -> Result<Run> {
        let (stats, metrics) = ensemble.counters();
        let steps = ensemble.steps();
        if let Err(reason) = steps.as_ref() {
            metrics.unavailable.inc();
            return Err(ServerError::Unavailable(format!(
                "ensemble `{}` is unavailable: {reason}",
                ensemble.endpoint
            )));
        }
        let InferRequest {
            id,
            inputs,
            outputs,
            parameters,
            ..
        } = request;
        let arrived = Instant::now();
        let deadline = timeout(&parameters)
            .inspect_err(|_| {
                metrics.invalid.inc();
            })?
            .map(|t| arrived + t);
        let tensors = InferRequest {
            inputs,
            outputs,
            ..InferRequest::default()
        };
        let valid = validate(&ensemble.info, ensemble.batch_size(), tensors).inspect_err(|_| {
            metrics.invalid.inc();
        })?;
        let plan = Arc::clone(&ensemble.plan);
        let mut run = Run {
            tensors: (0..plan.tensors.len()).map(|_| None).collect(),
            needs: plan.steps.iter().map(|s| s.needs).collect(),
            in_flight: Vec::with_capacity(plan.steps.len()),
            left: plan.steps.len(),
            version: ensemble.version.clone(),
            steps,
            stats: Arc::clone(stats),
            metrics: Arc::clone(metrics),
            parameters,
            deadline,
            id,
            output_mask: valid.output_mask,
            rows: valid.rows,
            arrived,
            ended: false,
            plan,
        };
        // Ensemble inputs are tensors 0.. in declared order, as `validate` puts them.
        for (id, tensor) in valid.inputs.into_iter().enumerate() {
            run.tensors[id] = Some(Value {
                dtype: tensor.dtype,
                shape: tensor.shape.dims().to_vec(),
                data: tensor.data,
            });
        }
        if let Err(e) = run.begin() {
            // A step refused at admission: the request is over before it began.
            run.ended = true;
            run.count_failure(&e);
            return Err(e);
        }
        Ok(run)
    }

    /// Submits the steps that read only ensemble inputs (or nothing: a model
    /// without inputs).
    fn begin(&mut self) -> Result<()> {
        let plan = Arc::clone(&self.plan);
        for (s, step) in plan.steps.iter().enumerate() {
            if step.needs == 0 {
                self.submit(s)?;
            }
        }
        for id in 0..plan.info.inputs.len() {
            self.written(id)?;
        }
        Ok(())
    }

    /// Tensor `id` exists: submits every step it completes.
    fn written(&mut self, id: usize) -> Result<()> {
        let plan = Arc::clone(&self.plan);
        for &s in &plan.consumers[id] {
            self.needs[s] -= 1;
            if self.needs[s] == 0 {
                self.submit(s)?;
            }
        }
        Ok(())
    }

    /// Submits step `s` to its model's group.
    fn submit(&mut self, s: usize) -> Result<()> {
        let label = || format!("ensemble `{}` {}", self.plan.name, self.plan.step_label(s));
        let step = &self.plan.steps[s];
        let Ok(groups) = self.steps.as_ref() else {
            return Err(ServerError::Internal("unbound ensemble".into()));
        };
        let mut parameters = self.parameters.clone();
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ServerError::Unavailable(format!(
                    "{}: the request's timeout expired before the step could start",
                    label()
                )));
            }
            parameters.retain(|p| !p.key.as_str().eq_ignore_ascii_case("timeout"));
            parameters.push(Param {
                key: "timeout".into(),
                value: ParamValue::Int(i64::try_from(left.as_micros().max(1)).unwrap_or(i64::MAX)),
            });
        }
        let mut inputs = Vec::with_capacity(step.inputs.len());
        for (name, id) in &step.inputs {
            let Some(value) = &self.tensors[*id] else {
                return Err(ServerError::Internal(format!(
                    "{}: tensor `{}` is missing",
                    label(),
                    self.plan.tensors[*id]
                )));
            };
            inputs.push(InputTensor {
                name: name.clone(),
                dtype: value.dtype,
                shape: value.shape.clone(),
                data: value.data.clone(),
            });
        }
        let request = InferRequest {
            // The group is known: the name is not looked up again.
            model: String::new(),
            id: None,
            inputs,
            outputs: Some(step.outputs.iter().map(|(o, _)| o.clone()).collect()),
            parameters,
        };
        let answer = groups[s]
            .submit(request, None)
            .map_err(|e| in_step(&label(), e))?;
        self.in_flight.push((s, answer));
        Ok(())
    }

    /// Step `s` answered: stores its outputs and submits what they complete.
    fn answered(&mut self, s: usize, answer: Answer) -> Result<()> {
        let label = || format!("ensemble `{}` {}", self.plan.name, self.plan.step_label(s));
        let response = answer.map_err(|e| in_step(&label(), e))?.into_response();
        let plan = Arc::clone(&self.plan);
        let mut written = Vec::with_capacity(plan.steps[s].outputs.len());
        for (name, id) in &plan.steps[s].outputs {
            let output = response
                .outputs
                .iter()
                .find(|o| o.name == *name)
                .ok_or_else(|| {
                    ServerError::Internal(format!("{}: output `{name}` was not returned", label()))
                })?;
            self.tensors[*id] = Some(Value {
                dtype: output.dtype,
                shape: output.shape.clone(),
                data: output.data.clone(),
            });
            written.push(*id);
        }
        self.left -= 1;
        for id in written {
            self.written(id)?;
        }
        Ok(())
    }

    /// The ensemble's response: its requested outputs.
    fn respond(&mut self) -> (InferResponse, Delivery) {
        self.ended = true;
        let outputs = self
            .plan
            .outputs
            .iter()
            .enumerate()
            .filter(|(k, _)| self.output_mask & (1 << k) != 0)
            .filter_map(|(k, id)| {
                let value = self.tensors[*id].as_ref()?;
                Some(OutputTensor {
                    name: self.plan.info.outputs[k].name.to_string(),
                    dtype: value.dtype,
                    shape: value.shape.clone(),
                    data: value.data.clone(),
                })
            })
            .collect();
        let response = InferResponse {
            model_name: self.plan.name.clone(),
            model_version: self.version.clone(),
            id: self.id.take(),
            outputs,
        };
        let delivery = Delivery::ensemble(
            Arc::clone(&self.stats),
            Arc::clone(&self.metrics),
            self.rows,
            self.arrived,
        );
        (response, delivery)
    }

    fn count_failure(&self, error: &ServerError) {
        self.stats.record_failure(1, nanos(self.arrived.elapsed()));
        match error {
            ServerError::InvalidRequest(_) => self.metrics.invalid.inc(),
            _ => self.metrics.failure.inc(),
        };
    }

    fn fail(&mut self, error: ServerError) -> ServerError {
        self.ended = true;
        // The steps still in flight are cancelled.
        self.in_flight.clear();
        self.count_failure(&error);
        let log = RequestLog {
            id: self.id.take(),
            trace_id: None,
        };
        crate::observe::request_log::failed(&log, &self.plan.name, &error);
        error
    }
}

impl Future for Run {
    type Output = Result<(InferResponse, Delivery)>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let run = self.get_mut();
        if run.ended {
            return Poll::Ready(Err(ServerError::Internal(
                "the ensemble request was already answered".into(),
            )));
        }
        loop {
            let mut progressed = false;
            let mut i = 0;
            while i < run.in_flight.len() {
                match Pin::new(&mut run.in_flight[i].1).poll(cx) {
                    Poll::Pending => i += 1,
                    Poll::Ready(received) => {
                        let (s, _) = run.in_flight.swap_remove(i);
                        let answer = received.unwrap_or_else(|_| {
                            Err(ServerError::Internal(
                                "the worker dropped the request".into(),
                            ))
                        });
                        if let Err(e) = run.answered(s, answer) {
                            return Poll::Ready(Err(run.fail(e)));
                        }
                        progressed = true;
                    }
                }
            }
            if run.left == 0 {
                return Poll::Ready(Ok(run.respond()));
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.ended {
            // Dropped unanswered: the steps in flight go with it.
            self.metrics.cancelled.inc();
        }
    }
}

/// A step's error as the ensemble's: its kind kept, its message prefixed with
/// `label` (the ensemble and the step); a step's model gone is 503, not 404.
fn in_step(label: &str, error: ServerError) -> ServerError {
    let at = |m: String| format!("{label}: {m}");
    match error {
        ServerError::InvalidRequest(m) => ServerError::InvalidRequest(at(m)),
        ServerError::AlreadyExists(m) => ServerError::AlreadyExists(at(m)),
        ServerError::TooLarge(m) => ServerError::TooLarge(at(m)),
        ServerError::NotFound(m) | ServerError::Unavailable(m) => ServerError::Unavailable(at(m)),
        ServerError::Exhausted(m) => ServerError::Exhausted(at(m)),
        ServerError::WorkerFailed(m) => ServerError::WorkerFailed(at(m)),
        ServerError::Restricted(m) => ServerError::Restricted(at(m)),
        ServerError::LimitExceeded(m) => ServerError::LimitExceeded(at(m)),
        ServerError::Internal(m) => ServerError::Internal(at(m)),
        ServerError::Conflict(m) => ServerError::Conflict(at(m)),
        other @ (ServerError::QueueFull { .. } | ServerError::LoadFailed { .. }) => other,
    }
}

/// The request's `timeout` parameter (Triton's, in microseconds).
fn timeout(parameters: &[Param]) -> Result<Option<Duration>> {
    match Params(parameters)
        .int("timeout")
        .map_err(ServerError::InvalidRequest)?
    {
        None => Ok(None),
        Some(v) => u64::try_from(v)
            .map(|v| Some(Duration::from_micros(v)))
            .map_err(|_| {
                ServerError::invalid(format!("parameter `timeout` (µs) must be ≥ 0, got {v}"))
            }),
    }
}
