//! Conversions between the protocol's messages and the server's own types (a
//! model's configuration, its statistics); the inference messages' conversions are
//! [`kiln_protocol::grpc::convert`]'s, re-exported here, and those that reach the
//! server's shared memory or answer with a
//! [`ServerError`](kiln_core::error::ServerError) are wrapped.

use std::collections::HashMap;

use kiln_protocol::grpc::convert as protocol;
use kiln_worker_sdk::{DataType, Param};

pub use kiln_protocol::grpc::convert::{
    decode_response, encode_request, encode_response, params_from_proto, params_to_proto,
};

use super::proto::{self, ModelInferRequest, ModelInferResponse};
use kiln_core::error::Result;
use kiln_core::memory::shared_memory::{SharedMemory, ShmSlice};
use kiln_core::observe::stats::{StatDuration, StatsSnapshot};
use kiln_core::request::infer::{InferRequest, InferResponse};
use kiln_core::triton;

/// Outputs the client wants written into shared memory: each output's window.
pub type ShmOutputs = protocol::ShmOutputs<ShmSlice>;

/// Decodes a `ModelInferRequest` into an [`InferRequest`]
/// ([`kiln_protocol::grpc::convert::decode_request`]). Shared-memory tensors are
/// refused.
pub fn decode_request(request: ModelInferRequest) -> Result<InferRequest> {
    Ok(protocol::decode_request(request)?)
}

/// [`decode_request`], with inputs copied out of (now, see [`kiln_core::memory::shared_memory`]) and
/// outputs placed in `shm`'s regions where their parameters name one.
pub fn decode_request_shm(
    request: ModelInferRequest,
    shm: &SharedMemory,
) -> Result<(InferRequest, ShmOutputs)> {
    Ok(protocol::decode_request_shm(request, shm)?)
}

/// [`encode_response`], after writing the outputs `in_shm` names into their
/// windows ([`kiln_protocol::grpc::convert::encode_response_shm`]). An output
/// larger than its window is an error.
pub fn encode_response_shm(
    response: InferResponse,
    in_shm: &ShmOutputs,
) -> Result<ModelInferResponse> {
    Ok(protocol::encode_response_shm(response, in_shm)?)
}

/// Repository load parameters as kiln [`Param`]s (overrides), sorted by key.
pub fn repository_params(
    parameters: HashMap<String, proto::ModelRepositoryParameter>,
) -> Result<Vec<Param>> {
    Ok(protocol::repository_params(parameters)?)
}

/// The protocol's `DataType` enum value for `dtype`.
fn data_type(dtype: DataType) -> i32 {
    proto::DataType::from_str_name(triton::triton_type(dtype))
        .unwrap_or(proto::DataType::TypeInvalid) as i32
}

/// A group's configuration as the protocol's `ModelConfig`.
pub fn model_config(c: &triton::ModelConfig) -> proto::ModelConfig {
    use proto::model_version_policy::{Latest, PolicyChoice, Specific};
    let version_policy = match c.version {
        Some(v) => PolicyChoice::Specific(Specific { versions: vec![v] }),
        None => PolicyChoice::Latest(Latest { num_versions: 1 }),
    };
    proto::ModelConfig {
        name: c.name.clone(),
        platform: c.platform.clone(),
        backend: c.backend.clone(),
        version_policy: Some(proto::ModelVersionPolicy {
            policy_choice: Some(version_policy),
        }),
        max_batch_size: i32::try_from(c.max_batch_size).unwrap_or(i32::MAX),
        input: c
            .inputs
            .iter()
            .map(|t| proto::ModelInput {
                name: t.name.clone(),
                data_type: data_type(t.dtype),
                dims: t.dims.clone(),
                allow_ragged_batch: c.allow_ragged_batch,
                ..Default::default()
            })
            .collect(),
        output: c
            .outputs
            .iter()
            .map(|t| proto::ModelOutput {
                name: t.name.clone(),
                data_type: data_type(t.dtype),
                dims: t.dims.clone(),
                ..Default::default()
            })
            .collect(),
        instance_group: c
            .instance_group
            .iter()
            .map(|(name, count)| proto::ModelInstanceGroup {
                name: name.clone(),
                kind: proto::model_instance_group::Kind::Cpu as i32,
                count: saturate(*count),
                ..Default::default()
            })
            .collect(),
        scheduling_choice: match (&c.sequence_batching, &c.ensemble_scheduling) {
            (Some(q), _) => Some(proto::model_config::SchedulingChoice::SequenceBatching(
                sequence_batching(q),
            )),
            (None, Some(steps)) => Some(proto::model_config::SchedulingChoice::EnsembleScheduling(
                ensemble_scheduling(steps),
            )),
            (None, None) => dynamic_batching(c),
        },
        parameters: c
            .parameters
            .iter()
            .map(|(key, value)| {
                (
                    (*key).to_owned(),
                    proto::ModelParameter {
                        string_value: value.clone(),
                    },
                )
            })
            .collect(),
        ..Default::default()
    }
}

/// A model's `config.pbtxt`, completed ([`kiln_core::Server::triton_config`]), as the
/// protocol's `ModelConfig`: the same `model_config.proto` compiled twice (by
/// kiln-core, which reads the file, and by kiln-protocol, which speaks the wire),
/// so the bytes of one are the other, every field Triton answers included.
pub fn pbtxt_config(
    config: &kiln_core::load::triton_config::proto::ModelConfig,
) -> std::result::Result<proto::ModelConfig, prost::DecodeError> {
    use prost::Message;
    proto::ModelConfig::decode(config.encode_to_vec().as_slice())
}

/// An ensemble's steps as the protocol's `ModelEnsembling`.
fn ensemble_scheduling(
    steps: &[kiln_core::ensemble::config::StepConfig],
) -> proto::ModelEnsembling {
    proto::ModelEnsembling {
        step: steps
            .iter()
            .map(|s| proto::model_ensembling::Step {
                model_name: s.model_name.clone(),
                model_version: s.model_version,
                input_map: s.input_map.clone().into_iter().collect(),
                output_map: s.output_map.clone().into_iter().collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn saturate(v: usize) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

/// The dynamic batcher's settings as the protocol's scheduling choice.
fn dynamic_batching(
    c: &kiln_core::triton::ModelConfig,
) -> Option<proto::model_config::SchedulingChoice> {
    c.dynamic_batching.as_ref().map(|d| {
        let policy = |p: &kiln_core::triton::QueuePolicyView| proto::ModelQueuePolicy {
            timeout_action: if p.delay {
                proto::model_queue_policy::TimeoutAction::Delay as i32
            } else {
                proto::model_queue_policy::TimeoutAction::Reject as i32
            },
            default_timeout_microseconds: p.default_timeout_microseconds,
            allow_timeout_override: p.allow_timeout_override,
            max_queue_size: u32::try_from(p.max_queue_size).unwrap_or(u32::MAX),
        };
        proto::model_config::SchedulingChoice::DynamicBatching(proto::ModelDynamicBatching {
            preferred_batch_size: d
                .preferred_batch_sizes
                .iter()
                .map(|&n| saturate(n))
                .collect(),
            max_queue_delay_microseconds: d.max_queue_delay_microseconds,
            preserve_ordering: d.preserve_ordering,
            priority_levels: d.priority_levels,
            default_priority_level: d.default_priority_level,
            default_queue_policy: Some(policy(&d.default_queue_policy)),
            priority_queue_policy: d
                .priority_queue_policy
                .iter()
                .map(|(level, p)| (*level, policy(p)))
                .collect(),
        })
    })
}

/// The sequence batcher's settings as the protocol's `ModelSequenceBatching`.
fn sequence_batching(q: &kiln_core::triton::SequenceBatching) -> proto::ModelSequenceBatching {
    use kiln_batchers::sequence::{Control, Strategy};
    use proto::model_sequence_batching as seq;
    let micros = q.max_queue_delay_microseconds;
    proto::ModelSequenceBatching {
        max_sequence_idle_microseconds: q.max_sequence_idle_microseconds,
        control_input: q
            .controls
            .iter()
            .map(|c| {
                let kind = match c.kind {
                    Control::Start => seq::control::Kind::ControlSequenceStart,
                    Control::End => seq::control::Kind::ControlSequenceEnd,
                    Control::Ready => seq::control::Kind::ControlSequenceReady,
                    Control::CorrId => seq::control::Kind::ControlSequenceCorrid,
                };
                let mut control = seq::Control {
                    kind: kind as i32,
                    ..Default::default()
                };
                match (c.kind, c.dtype) {
                    (Control::CorrId, dtype) => control.data_type = data_type(dtype),
                    (_, kiln_worker_sdk::DataType::Fp32) => {
                        control.fp32_false_true = vec![0.0, 1.0]
                    }
                    (_, kiln_worker_sdk::DataType::Bool) => {
                        control.bool_false_true = vec![false, true]
                    }
                    _ => control.int32_false_true = vec![0, 1],
                }
                seq::ControlInput {
                    name: c.name.clone(),
                    control: vec![control],
                }
            })
            .collect(),
        state: q
            .states
            .iter()
            .map(|s| seq::State {
                input_name: s.input_name.clone(),
                output_name: s.output_name.clone(),
                data_type: data_type(s.dtype),
                dims: s.dims.clone(),
                ..Default::default()
            })
            .collect(),
        strategy_choice: Some(match q.strategy {
            Strategy::Direct => seq::StrategyChoice::Direct(seq::StrategyDirect {
                max_queue_delay_microseconds: micros,
                minimum_slot_utilization: 0.0,
            }),
            Strategy::Oldest => seq::StrategyChoice::Oldest(seq::StrategyOldest {
                max_candidate_sequences: saturate(q.max_candidate_sequences),
                preferred_batch_size: q
                    .preferred_batch_sizes
                    .iter()
                    .map(|&n| saturate(n))
                    .collect(),
                max_queue_delay_microseconds: micros,
                preserve_ordering: false,
            }),
        }),
        iterative_sequence: false,
    }
}

/// A group's statistics as the protocol's `ModelStatistics`.
pub fn model_statistics(name: &str, version: &str, s: &StatsSnapshot) -> proto::ModelStatistics {
    let d = |d: StatDuration| {
        Some(proto::StatisticDuration {
            count: d.count,
            ns: d.ns,
        })
    };
    proto::ModelStatistics {
        name: name.to_owned(),
        version: version.to_owned(),
        last_inference: s.last_inference,
        inference_count: s.inference_count,
        execution_count: s.execution_count,
        inference_stats: Some(proto::InferStatistics {
            success: d(s.success),
            fail: d(s.fail),
            queue: d(s.queue),
            compute_input: d(s.compute_input),
            compute_infer: d(s.compute_infer),
            compute_output: d(s.compute_output),
            cache_hit: d(StatDuration::default()),
            cache_miss: d(StatDuration::default()),
        }),
        batch_stats: s
            .batches
            .iter()
            .map(|b| proto::InferBatchStatistics {
                batch_size: b.batch_size,
                compute_input: d(b.compute_input),
                compute_infer: d(b.compute_infer),
                compute_output: d(b.compute_output),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_datatype_has_a_protocol_enum_value() {
        for d in DataType::ALL {
            assert_ne!(data_type(d), proto::DataType::TypeInvalid as i32, "{d}");
        }
    }
}
