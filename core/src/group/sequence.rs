//! The server's side of the sequence batcher: its load-time parameters, the worker
//! inputs and outputs it fills and keeps (control inputs, implicit state), the view
//! of the model clients see without them, and the answers to requests the batcher refuses.

use std::sync::Arc;
use std::time::Duration;

use kiln_batchers::sequence::{
    repeat, scalar_bytes, Control, InputLayout, InputSource, SequenceConfig, SequenceHost,
    SequenceRejection, StateSpec, Strategy,
};
use kiln_batchers::Request;
use kiln_worker_sdk::{DataType, Shape, TensorSpec, WorkerInfo};

use crate::error::{Result, ServerError};
use crate::observe::metrics::ModelMetrics;
use crate::request::answer::Reply;
pub use crate::request::answer::SequenceLink;
use crate::request::infer::names;

/// One implicit state: the worker input it feeds and the output that updates it.
#[derive(Debug, Clone, PartialEq)]
pub struct StateParam {
    pub input: String,
    pub output: String,
    /// Every element's value at a sequence's start (zeros when absent).
    pub initial: Option<f64>,
    /// `state_dims.<input>`: the state's shape where the input's dims are dynamic
    /// (Triton's `state.dims`); the input's own dims when absent.
    pub dims: Option<Vec<i64>>,
}

/// `sequence_batching` settings as load-time parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceParams {
    /// `sequence_strategy`: `direct` (default) or `oldest`.
    pub strategy: Strategy,
    /// `max_sequence_idle_microseconds` (default 1 s, as Triton).
    pub max_idle: Duration,
    /// `max_sequences` (or Triton's `max_candidate_sequences`): live sequences.
    pub max_sequences: Option<std::num::NonZeroUsize>,
    /// `max_sequence_backlog`: new sequences that may wait for room (default 0).
    pub max_backlog: usize,
    /// `control.<kind>`: the worker input that receives each control.
    pub controls: Vec<(Control, String)>,
    /// `state.<input> = "<output>"` and `state_initial.<input> = value`.
    pub states: Vec<StateParam>,
}

impl Default for SequenceParams {
    fn default() -> Self {
        SequenceParams {
            strategy: Strategy::Direct,
            max_idle: Duration::from_secs(1),
            max_sequences: None,
            max_backlog: 0,
            controls: Vec::new(),
            states: Vec::new(),
        }
    }
}

/// A stateful model as the server serves it: where each worker input comes from,
/// which outputs are states, and the model clients see.
#[derive(Debug, Clone)]
pub struct SequenceModel {
    pub layout: InputLayout,
    /// The worker output of each state, in state order.
    pub state_outputs: Vec<usize>,
    /// Bytes of each state for one sequence.
    pub state_bytes: Vec<usize>,
    /// The worker's info without control and state inputs and state outputs.
    pub client_info: WorkerInfo,
    /// Worker output index of each output clients see.
    pub client_outputs: Vec<usize>,
}

impl SequenceModel {
    /// Checks `params` against the worker and works out the layout.
    pub fn new(info: &WorkerInfo, params: &SequenceParams) -> Result<SequenceModel> {
        let find_input = |name: &str, what: &str| -> Result<(usize, &TensorSpec)> {
            info.inputs
                .iter()
                .enumerate()
                .find(|(_, s)| s.name.as_str() == name)
                .ok_or_else(|| {
                    ServerError::invalid(format!(
                        "{what} `{name}` is not an input of the worker (inputs: {})",
                        names(&info.inputs)
                    ))
                })
        };
        let mut sources = vec![InputSource::Client; info.inputs.len()];
        for (kind, name) in &params.controls {
            let (i, spec) = find_input(name, kind.triton_kind())?;
            if !spec.accepts(&[1]) {
                return Err(ServerError::invalid(format!(
                    "control input `{name}` must have dims [1], not {:?}",
                    spec.dims.as_slice()
                )));
            }
            let allowed = match kind {
                Control::CorrId => matches!(
                    spec.dtype,
                    DataType::Uint64
                        | DataType::Int64
                        | DataType::Uint32
                        | DataType::Int32
                        | DataType::Bytes
                ),
                _ => matches!(
                    spec.dtype,
                    DataType::Int32 | DataType::Fp32 | DataType::Bool
                ),
            };
            let source = InputLayout::control(*kind, spec.dtype).filter(|_| allowed);
            sources[i] = source.ok_or_else(|| {
                ServerError::invalid(format!(
                    "control input `{name}` ({}) cannot be of type {} (Triton's: INT32, FP32 or \
                     BOOL; CORRID: UINT64, INT64, UINT32, INT32 or STRING)",
                    kind.triton_kind(),
                    spec.dtype
                ))
            })?;
        }
        let mut states = Vec::new();
        let mut state_outputs = Vec::new();
        let mut state_bytes = Vec::new();
        for (k, state) in params.states.iter().enumerate() {
            let (i, spec) = find_input(&state.input, "state input")?;
            if sources[i] != InputSource::Client {
                return Err(ServerError::invalid(format!(
                    "input `{}` is both a control and a state",
                    state.input
                )));
            }
            let (o, out) = info
                .outputs
                .iter()
                .enumerate()
                .find(|(_, s)| s.name.as_str() == state.output)
                .ok_or_else(|| {
                    ServerError::invalid(format!(
                        "state output `{}` is not an output of the worker (outputs: {})",
                        state.output,
                        names(&info.outputs)
                    ))
                })?;
            let size = spec.dtype.size().ok_or_else(|| {
                ServerError::invalid(format!("state `{}` cannot be BYTES", state.input))
            })?;
            let wanted = match &state.dims {
                Some(dims) if !spec.accepts(dims) => {
                    return Err(ServerError::invalid(format!(
                        "state_dims.{}: {dims:?} does not fit the input's dims {:?}",
                        state.input,
                        spec.dims.as_slice()
                    )))
                }
                Some(dims) => &dims[..],
                None => spec.dims.as_slice(),
            };
            let dims = Shape::new(wanted)
                .filter(|_| wanted.iter().all(|&d| d >= 0))
                .ok_or_else(|| {
                    ServerError::invalid(format!(
                        "state input `{}` needs fixed dims, not {wanted:?} (set them with \
                         `state_dims.{}`)",
                        state.input, state.input
                    ))
                })?;
            if out.dtype != spec.dtype || !out.accepts(wanted) {
                return Err(ServerError::invalid(format!(
                    "state output `{}` ({} {:?}) does not fit state input `{}` ({} {:?})",
                    state.output,
                    out.dtype,
                    out.dims.as_slice(),
                    state.input,
                    spec.dtype,
                    spec.dims.as_slice()
                )));
            }
            let element =
                scalar_bytes(spec.dtype, state.initial.unwrap_or(0.0)).ok_or_else(|| {
                    ServerError::invalid(format!(
                        "state_initial.{}: {} is not a {} value",
                        state.input,
                        state.initial.unwrap_or(0.0),
                        spec.dtype
                    ))
                })?;
            let bytes = dims.element_count() * size;
            states.push(StateSpec {
                dtype: spec.dtype,
                dims,
                initial: repeat(&element, dims.element_count()),
            });
            sources[i] = InputSource::State(k);
            state_outputs.push(o);
            state_bytes.push(bytes);
        }
        let client_info = WorkerInfo {
            inputs: info
                .inputs
                .iter()
                .zip(&sources)
                .filter(|(_, s)| **s == InputSource::Client)
                .map(|(spec, _)| spec.clone())
                .collect(),
            outputs: info
                .outputs
                .iter()
                .enumerate()
                .filter(|(o, _)| !state_outputs.contains(o))
                .map(|(_, spec)| spec.clone())
                .collect(),
            ..info.clone()
        };
        let client_outputs = (0..info.outputs.len())
            .filter(|o| !state_outputs.contains(o))
            .collect();
        Ok(SequenceModel {
            layout: InputLayout {
                sources,
                states,
                batched: info.max_batch_size > 0,
            },
            state_outputs,
            state_bytes,
            client_info,
            client_outputs,
        })
    }

    /// The batcher's settings.
    pub fn config(
        &self,
        params: &SequenceParams,
        dynamic: &kiln_batchers::dynamic::DynamicConfig,
        batch_size: usize,
        instances: usize,
        queue_size: usize,
    ) -> SequenceConfig {
        let slots = batch_size.max(1) * instances.max(1);
        let max_sequences = match params.strategy {
            Strategy::Direct => params
                .max_sequences
                .map_or(slots, std::num::NonZeroUsize::get)
                .min(slots),
            Strategy::Oldest => params
                .max_sequences
                .map_or(slots, std::num::NonZeroUsize::get),
        };
        SequenceConfig {
            strategy: params.strategy,
            max_batch_size: batch_size.max(1),
            preferred_batch_sizes: dynamic.preferred_batch_sizes.clone(),
            max_queue_delay: dynamic.max_queue_delay,
            max_idle: params.max_idle,
            max_sequences,
            max_backlog: params.max_backlog,
            max_queued: queue_size,
            layout: self.layout.clone(),
        }
    }

    /// A requested-output mask over the client's outputs as one over the worker's.
    pub fn worker_mask(&self, client_mask: u64) -> u64 {
        self.client_outputs
            .iter()
            .enumerate()
            .filter(|(k, _)| client_mask & (1 << k) != 0)
            .fold(0, |mask, (_, &o)| mask | (1 << o))
    }
}

/// Answers the requests the sequence batcher refuses and keeps its gauges. It holds
/// the group's metrics, not its instances' context: that context holds the batcher.
pub struct SequenceGroupHost {
    metrics: Arc<ModelMetrics>,
    endpoint: String,
    max_sequences: usize,
    max_queued: usize,
    max_idle: Duration,
}

impl SequenceGroupHost {
    /// The host of a sequence batcher with `config`, for model `endpoint`.
    pub fn new(
        config: &SequenceConfig,
        endpoint: &str,
        metrics: Arc<ModelMetrics>,
    ) -> SequenceGroupHost {
        SequenceGroupHost {
            metrics,
            endpoint: endpoint.to_owned(),
            max_sequences: config.max_sequences,
            max_queued: config.max_queued,
            max_idle: config.max_idle,
        }
    }
}

impl SequenceHost<Reply> for SequenceGroupHost {
    fn rejected(&self, request: Request<Reply>, why: SequenceRejection) {
        let m = &self.metrics;
        let model = &self.endpoint;
        m.pending.dec();
        let id = request
            .sequence
            .as_ref()
            .map_or_else(|| "?".to_owned(), |f| f.id.to_string());
        let error = match why {
            SequenceRejection::MissingId => ServerError::invalid(format!(
                "model `{model}` is stateful: each request needs a `sequence_id` parameter"
            )),
            SequenceRejection::NotActive { expired: true } => ServerError::invalid(format!(
                "model `{model}`: sequence {id} expired after {} µs without a request; \
                 start it again with `sequence_start`",
                self.max_idle.as_micros()
            )),
            SequenceRejection::NotActive { expired: false } => ServerError::invalid(format!(
                "model `{model}`: sequence {id} is not active; its first request must set `sequence_start`"
            )),
            SequenceRejection::Ended => ServerError::invalid(format!(
                "model `{model}`: sequence {id} has ended; only a new `sequence_start` may follow"
            )),
            SequenceRejection::BadCorrId => ServerError::invalid(format!(
                "model `{model}`: sequence id {id} does not fit the model's CORRID input"
            )),
            SequenceRejection::TooManySequences => ServerError::Exhausted(format!(
                "model `{model}`: all {} sequence places are taken (max_sequences) and the \
                 backlog is full; retry when a sequence ends",
                self.max_sequences
            )),
            SequenceRejection::QueueFull => ServerError::QueueFull {
                model: model.clone(),
                capacity: self.max_queued,
            },
            SequenceRejection::Cancelled => {
                ServerError::Unavailable("cancelled: the client went away".into())
            }
        };
        match why {
            SequenceRejection::TooManySequences | SequenceRejection::QueueFull => {
                m.rejected.inc();
            }
            SequenceRejection::Cancelled => {
                m.cancelled.inc();
            }
            _ => {
                m.invalid.inc();
            }
        }
        crate::observe::request_log::failed(&request.reply.log, model, &error);
        let _ = request.reply.tx.send(Err(error));
    }

    fn is_cancelled(&self, reply: &Reply) -> bool {
        reply.tx.is_closed()
    }

    fn sequences(&self, live: usize, backlog: usize) {
        self.metrics.sequences.set(live as i64);
        self.metrics.sequence_backlog.set(backlog as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::{params_from_pairs, BatcherKind, Param};

    fn info() -> WorkerInfo {
        WorkerInfo {
            inputs: vec![
                TensorSpec::new("input", DataType::Fp32, &[-1]),
                TensorSpec::new("state", DataType::Fp32, &[2, 4]),
                TensorSpec::new("START", DataType::Int32, &[1]),
            ]
            .into(),
            outputs: vec![
                TensorSpec::new("output", DataType::Fp32, &[1]),
                TensorSpec::new("stateN", DataType::Fp32, &[-1, -1]),
            ]
            .into(),
            max_batch_size: 8,
            batcher: BatcherKind::Sequence,
            allow_ragged_batch: false,
        }
    }

    fn sequence_params(params: &[Param]) -> Result<SequenceParams> {
        crate::params::GroupParams::parse(params).map(|g| g.sequence)
    }

    #[test]
    fn hidden_inputs_and_outputs_leave_the_client_view() {
        let params = sequence_params(&params_from_pairs(&[
            ("state.state", "stateN"),
            ("state_initial.state", "0.5"),
            ("control.start", "START"),
            ("sequence_strategy", "OLDEST"),
        ]))
        .unwrap();
        assert_eq!(params.strategy, Strategy::Oldest);
        let model = SequenceModel::new(&info(), &params).unwrap();
        let client: Vec<&str> = model
            .client_info
            .inputs
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(client, vec!["input"]);
        assert_eq!(model.client_info.outputs.len(), 1);
        assert_eq!(model.state_outputs, vec![1]);
        assert_eq!(model.state_bytes, vec![32]);
        assert_eq!(&model.layout.states[0].initial[..4], &0.5f32.to_le_bytes());
        assert_eq!(model.worker_mask(u64::MAX), 1);
    }

    #[test]
    fn mistakes_are_named() {
        let check = |pairs: &[(&str, &str)], want: &str| {
            let e = sequence_params(&params_from_pairs(pairs))
                .and_then(|p| SequenceModel::new(&info(), &p))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        };
        check(&[("state.nope", "stateN")], "`nope` is not an input");
        check(&[("state.state", "nope")], "`nope` is not an output");
        check(&[("state.input", "output")], "needs fixed dims");
        check(&[("control.end", "missing")], "`missing` is not an input");
        check(&[("control.start", "state")], "must have dims [1]");
        check(&[("state_initial.state", "1")], "is not a state");
        check(&[("state_dims.state", "2,4")], "is not a state");
        check(
            &[("state.state", "stateN"), ("state_dims.state", "2,5")],
            "state_dims.state: [2, 5] does not fit",
        );
        check(&[("sequence_strategy", "newest")], "`direct` or `oldest`");
    }

    #[test]
    fn state_dims_fix_a_dynamic_state() {
        let mut info = info();
        info.inputs = vec![
            TensorSpec::new("input", DataType::Fp32, &[-1]),
            TensorSpec::new("state", DataType::Fp32, &[2, -1, 4]),
        ]
        .into();
        info.outputs = vec![TensorSpec::new("stateN", DataType::Fp32, &[2, -1, 4])].into();
        let state = [("state.state", "stateN")];
        let e = sequence_params(&params_from_pairs(&state))
            .and_then(|p| SequenceModel::new(&info, &p))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("needs fixed dims") && e.contains("state_dims.state"),
            "{e}"
        );
        let params = sequence_params(&params_from_pairs(&[
            state[0],
            ("state_dims.state", "2,1,4"),
        ]))
        .unwrap();
        let model = SequenceModel::new(&info, &params).unwrap();
        assert_eq!(model.state_bytes, vec![2 * 4 * 4]);
        assert_eq!(model.layout.states[0].dims.dims(), &[2, 1, 4]);
    }
}
