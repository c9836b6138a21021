//! What kiln reports about itself and its models in Triton's terms, computed once
//! for every protocol: REST renders it as JSON (`http::routes`, `http::triton`),
//! gRPC as protobuf messages (`grpc`).

use kiln_worker_sdk::{BatcherKind, DataType, WorkerInfo};

use crate::ensemble::config::{StepConfig, TensorConfig};
use crate::ensemble::Ensemble;
use crate::error::{Result, ServerError};
use crate::group::{GroupSettings, WorkerGroup};
use crate::models::Served;
use crate::request::infer::expected_shape;
use crate::server::Server;

/// The server's name in its metadata.
pub const SERVER_NAME: &str = "kiln";

/// The server's version in its metadata.
pub const SERVER_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The protocol extensions kiln serves, as its server metadata lists them.
pub const EXTENSIONS: &[&str] = &[
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "model_repository",
    "system_shared_memory",
    "logging",
    "kiln_workers",
    "kiln_metrics",
    "trace",
];

/// An ensemble's platform, as Triton names it.
pub const ENSEMBLE_PLATFORM: &str = "ensemble";

/// A model's platform: `kiln_<worker>`.
pub fn platform(worker: &str) -> String {
    format!("kiln_{worker}")
}

pub use crate::load::triton_config::data_type::triton_type;

/// A tensor of a [`ModelConfig`]: dims as the worker declares them (without the
/// batch dim when it batches; -1 dynamic).
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigTensor {
    pub name: String,
    pub dtype: DataType,
    pub dims: Vec<i64>,
}

/// A queue policy as Triton's `ModelQueuePolicy` describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuePolicyView {
    /// `true`: DELAY; `false`: REJECT.
    pub delay: bool,
    pub default_timeout_microseconds: u64,
    pub allow_timeout_override: bool,
    pub max_queue_size: usize,
}

impl QueuePolicyView {
    fn of(policy: &kiln_batchers::dynamic::QueuePolicy) -> QueuePolicyView {
        QueuePolicyView {
            delay: policy.timeout_action == kiln_batchers::dynamic::TimeoutAction::Delay,
            default_timeout_microseconds: policy
                .default_timeout
                .map_or(0, |t| u64::try_from(t.as_micros()).unwrap_or(u64::MAX)),
            allow_timeout_override: policy.allow_timeout_override,
            max_queue_size: policy.max_queue_size,
        }
    }
}

/// How a batching group is described with Triton's `dynamic_batching`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamicBatching {
    /// The dynamic batcher's preferred sizes; `[batch_size]` for hard and soft.
    pub preferred_batch_sizes: Vec<usize>,
    /// The dynamic batcher's delay; the soft batcher's timeout (0: it sends what has
    /// already arrived); the hard batcher, which waits without limit, `u64::MAX`.
    pub max_queue_delay_microseconds: u64,
    /// Whether answers leave in batch order.
    pub preserve_ordering: bool,
    /// Priority levels (0: none).
    pub priority_levels: u64,
    pub default_priority_level: u64,
    /// The policy of requests at the default level (hard and soft: the group's queue bound).
    pub default_queue_policy: QueuePolicyView,
    /// Each level's policy, when there are several levels.
    pub priority_queue_policy: Vec<(u64, QueuePolicyView)>,
}

/// One control input of a stateful model (Triton's `ControlInput`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlView {
    pub name: String,
    pub kind: kiln_batchers::sequence::Control,
    pub dtype: kiln_worker_sdk::DataType,
}

/// One implicit state of a stateful model (Triton's `State`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateView {
    pub input_name: String,
    pub output_name: String,
    pub dtype: kiln_worker_sdk::DataType,
    pub dims: Vec<i64>,
}

/// The sequence batcher's settings in the shape of Triton's `sequence_batching`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceBatching {
    pub strategy: kiln_batchers::sequence::Strategy,
    pub max_sequence_idle_microseconds: u64,
    pub max_queue_delay_microseconds: u64,
    /// `oldest`: live sequences.
    pub max_candidate_sequences: usize,
    /// `oldest`: preferred sizes.
    pub preferred_batch_sizes: Vec<usize>,
    pub controls: Vec<ControlView>,
    pub states: Vec<StateView>,
}

impl SequenceBatching {
    /// The view of a stateful group's settings; `worker` is the worker's own info
    /// (control and state tensors included).
    pub fn of(settings: &GroupSettings, worker: &WorkerInfo, instances: usize) -> SequenceBatching {
        let q = &settings.sequence;
        let input = |name: &str| worker.inputs.iter().find(|s| s.name.as_str() == name);
        let micros = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        SequenceBatching {
            strategy: q.strategy,
            max_sequence_idle_microseconds: micros(q.max_idle),
            max_queue_delay_microseconds: micros(settings.dynamic.max_queue_delay),
            max_candidate_sequences: q
                .max_sequences
                .map_or(settings.batch_size.max(1) * instances.max(1), |n| n.get()),
            preferred_batch_sizes: settings.dynamic.preferred_batch_sizes.clone(),
            controls: q
                .controls
                .iter()
                .filter_map(|(kind, name)| {
                    input(name).map(|spec| ControlView {
                        name: name.clone(),
                        kind: *kind,
                        dtype: spec.dtype,
                    })
                })
                .collect(),
            states: q
                .states
                .iter()
                .filter_map(|state| {
                    input(&state.input).map(|spec| StateView {
                        input_name: state.input.clone(),
                        output_name: state.output.clone(),
                        dtype: spec.dtype,
                        dims: state.dims.clone().unwrap_or_else(|| spec.dims.to_vec()),
                    })
                })
                .collect(),
        }
    }
}

/// A loaded group's configuration in the shape of Triton's `ModelConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub name: String,
    pub platform: String,
    /// The worker.
    pub backend: String,
    /// The served version when it is a number (policy `specific`), else `None`
    /// (policy `latest`).
    pub version: Option<i64>,
    /// The group's batch size (0: the worker does not batch): what infer enforces.
    pub max_batch_size: u32,
    pub inputs: Vec<ConfigTensor>,
    pub outputs: Vec<ConfigTensor>,
    pub allow_ragged_batch: bool,
    /// One `KIND_CPU` instance group: its name and count (an ensemble has none).
    pub instance_group: Option<(String, usize)>,
    /// Present when the worker batches (and is not stateful).
    pub dynamic_batching: Option<DynamicBatching>,
    /// Present for a stateful model (sequence batcher).
    pub sequence_batching: Option<SequenceBatching>,
    /// kiln's settings, as Triton's string parameters.
    pub parameters: Vec<(&'static str, String)>,
    /// An ensemble's steps (Triton's `ensemble_scheduling`).
    pub ensemble_scheduling: Option<Vec<StepConfig>>,
}

impl ModelConfig {
    /// The configuration of a group named `name`.
    pub fn new(
        name: &str,
        worker: &str,
        version: &str,
        info: &WorkerInfo,
        settings: &GroupSettings,
        instances: usize,
    ) -> ModelConfig {
        let tensors = |specs: &[kiln_worker_sdk::TensorSpec]| -> Vec<ConfigTensor> {
            specs
                .iter()
                .map(|s| ConfigTensor {
                    name: s.name.as_str().to_owned(),
                    dtype: s.dtype,
                    dims: s.dims.to_vec(),
                })
                .collect()
        };
        let dynamic_batching = (info.max_batch_size > 0).then(|| match settings.batcher {
            BatcherKind::Dynamic => {
                let d = &settings.dynamic;
                let levels = d.priority_levels.max(1);
                let policy_of = |level: usize| {
                    d.policies
                        .get(level.saturating_sub(1))
                        .or(d.policies.last())
                        .map_or(
                            QueuePolicyView {
                                delay: false,
                                default_timeout_microseconds: 0,
                                allow_timeout_override: false,
                                max_queue_size: 0,
                            },
                            QueuePolicyView::of,
                        )
                };
                DynamicBatching {
                    preferred_batch_sizes: d.preferred_batch_sizes.clone(),
                    max_queue_delay_microseconds: u64::try_from(d.max_queue_delay.as_micros())
                        .unwrap_or(u64::MAX),
                    preserve_ordering: d.preserve_ordering,
                    priority_levels: if levels > 1 { levels as u64 } else { 0 },
                    default_priority_level: if levels > 1 {
                        d.default_priority_level as u64
                    } else {
                        0
                    },
                    default_queue_policy: policy_of(d.default_priority_level),
                    priority_queue_policy: if levels > 1 {
                        (1..=levels).map(|l| (l as u64, policy_of(l))).collect()
                    } else {
                        Vec::new()
                    },
                }
            }
            kind => DynamicBatching {
                preferred_batch_sizes: vec![settings.batch_size],
                max_queue_delay_microseconds: match kind {
                    BatcherKind::Soft => {
                        u64::try_from(settings.timeout.as_micros()).unwrap_or(u64::MAX)
                    }
                    _ => u64::MAX,
                },
                preserve_ordering: false,
                priority_levels: 0,
                default_priority_level: 0,
                default_queue_policy: QueuePolicyView {
                    delay: false,
                    default_timeout_microseconds: 0,
                    allow_timeout_override: false,
                    max_queue_size: settings.queue_size,
                },
                priority_queue_policy: Vec::new(),
            },
        });
        ModelConfig {
            name: name.to_owned(),
            platform: platform(worker),
            backend: worker.to_owned(),
            version: version.parse().ok(),
            // What infer enforces: the group's batch size (at most the worker's
            // max_batch_size), so clients and perf_analyzer never send more.
            max_batch_size: if info.max_batch_size > 0 {
                u32::try_from(settings.batch_size).unwrap_or(u32::MAX)
            } else {
                0
            },
            inputs: tensors(&info.inputs),
            outputs: tensors(&info.outputs),
            allow_ragged_batch: info.allow_ragged_batch,
            instance_group: Some((format!("{name}_0"), instances)),
            dynamic_batching,
            sequence_batching: None,
            parameters: vec![
                ("batcher", settings.batcher.as_str().to_owned()),
                ("batch_size", settings.batch_size.to_string()),
                ("timeout_ms", settings.timeout.as_millis().to_string()),
                ("batchers", settings.batchers.to_string()),
                ("max_buffers", settings.max_buffers.to_string()),
                ("queue_size", settings.queue_size.to_string()),
            ],
            ensemble_scheduling: None,
        }
    }

    /// An ensemble's configuration, as Triton gives it: `platform: "ensemble"`,
    /// its declared tensors and steps, no instance group and no batcher.
    fn ensemble(ensemble: &Ensemble) -> ModelConfig {
        let plan = &ensemble.plan;
        let tensors = |list: &[TensorConfig]| -> Vec<ConfigTensor> {
            list.iter()
                .map(|t| ConfigTensor {
                    name: t.name.clone(),
                    dtype: t.data_type,
                    dims: t.dims.clone(),
                })
                .collect()
        };
        ModelConfig {
            name: ensemble.endpoint.clone(),
            platform: ENSEMBLE_PLATFORM.to_owned(),
            backend: String::new(),
            version: ensemble.version.parse().ok(),
            max_batch_size: plan.config.max_batch_size,
            inputs: tensors(&plan.config.inputs),
            outputs: tensors(&plan.config.outputs),
            allow_ragged_batch: false,
            instance_group: None,
            dynamic_batching: None,
            sequence_batching: None,
            parameters: Vec::new(),
            ensemble_scheduling: Some(plan.config.steps.clone()),
        }
    }

    /// The configuration of a loaded model.
    pub fn of(served: &Served) -> ModelConfig {
        match served {
            Served::Group(group) => ModelConfig::group(group),
            Served::Ensemble(ensemble) => ModelConfig::ensemble(ensemble),
        }
    }

    /// The configuration of a loaded worker group.
    fn group(group: &WorkerGroup) -> ModelConfig {
        let instances = group.instance_count();
        let mut config = ModelConfig::new(
            &group.endpoint,
            &group.worker,
            &group.version,
            &group.info,
            &group.settings,
            instances,
        );
        // The pool's size now: a scale resizes it ([`WorkerGroup::buffer_sets`]).
        for (key, value) in &mut config.parameters {
            if *key == "max_buffers" {
                *value = group.buffer_sets().to_string();
            }
        }
        if group.settings.batcher == BatcherKind::Sequence {
            config.dynamic_batching = None;
            config.sequence_batching = Some(SequenceBatching::of(
                &group.settings,
                &group.worker_info,
                instances,
            ));
        }
        config
    }
}

/// A tensor of a [`ModelMetadata`]: its shape as clients send it (the batch
/// dimension first, -1, when the model batches; -1 for dynamic dims).
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataTensor {
    pub name: String,
    pub dtype: DataType,
    pub shape: Vec<i64>,
}

/// A model's metadata (KServe v2 model metadata) as clients see it, built once for
/// every protocol: REST renders it as JSON, gRPC as a `ModelMetadataResponse`
/// (which has no `parameters`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<MetadataTensor>,
    pub outputs: Vec<MetadataTensor>,
    /// The worker's `max_batch_size` (0: it does not batch).
    pub max_batch_size: u32,
    /// A worker group's batching and instances (REST's `parameters`); `None` for
    /// an ensemble, which has no batcher or instances of its own.
    pub group: Option<GroupMetadata>,
}

/// A worker group's part of its [`ModelMetadata`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupMetadata {
    pub batch_size: usize,
    pub batcher: BatcherKind,
    pub instances: usize,
}

impl ModelMetadata {
    /// The metadata of a loaded model (its clients' tensors: a stateful model's
    /// control and state tensors are not among them).
    pub fn of(served: &Served) -> ModelMetadata {
        let info = served.info();
        let batching = info.max_batch_size > 0;
        let tensors = |specs: &[kiln_worker_sdk::TensorSpec]| -> Vec<MetadataTensor> {
            specs
                .iter()
                .map(|s| MetadataTensor {
                    name: s.name.as_str().to_owned(),
                    dtype: s.dtype,
                    shape: expected_shape(s, batching),
                })
                .collect()
        };
        let (platform, group) = match served {
            Served::Group(g) => (
                platform(&g.worker),
                Some(GroupMetadata {
                    batch_size: g.settings.batch_size,
                    batcher: g.settings.batcher,
                    instances: g.instance_count(),
                }),
            ),
            Served::Ensemble(_) => (ENSEMBLE_PLATFORM.to_owned(), None),
        };
        ModelMetadata {
            name: served.endpoint().to_owned(),
            versions: vec![served.version().to_owned()],
            platform,
            inputs: tensors(&info.inputs),
            outputs: tensors(&info.outputs),
            max_batch_size: info.max_batch_size,
            group,
        }
    }
}

/// One model version of the repository index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub name: String,
    /// A loaded version, else the latest on disk.
    pub version: String,
    /// `READY` or `UNAVAILABLE`.
    pub state: &'static str,
    /// Why it is not ready (empty when it is): for a model not loaded, why its
    /// last load failed, else `unloaded`.
    pub reason: String,
}

/// Triton's repository index: every model of the repository with its state, one
/// row per loaded version (one row, `UNAVAILABLE`, for a model not loaded); with
/// `only_ready`, the ready ones.
pub fn repository_index(server: &Server, only_ready: bool) -> Result<Vec<IndexEntry>> {
    let loaded = server.models();
    let mut index = Vec::new();
    for entry in server.repository_index()? {
        let mut rows: Vec<IndexEntry> = loaded
            .iter()
            .filter(|s| s.endpoint() == entry.name)
            .map(|s| {
                let (state, reason) = match s {
                    s if s.is_ready() => ("READY", ""),
                    Served::Ensemble(_) => {
                        ("UNAVAILABLE", "a step's model is not loaded or not ready")
                    }
                    Served::Group(_) => ("UNAVAILABLE", "no worker instance can run"),
                };
                IndexEntry {
                    name: entry.name.clone(),
                    version: s.version().to_owned(),
                    state,
                    reason: reason.to_owned(),
                }
            })
            .collect();
        if rows.is_empty() {
            rows.push(IndexEntry {
                name: entry.name.clone(),
                version: entry
                    .versions
                    .last()
                    .map(u64::to_string)
                    .unwrap_or_default(),
                state: "UNAVAILABLE",
                reason: server
                    .load_failure(&entry.name)
                    .unwrap_or_else(|| "unloaded".to_owned()),
            });
        }
        index.extend(
            rows.into_iter()
                .filter(|r| !only_ready || r.state == "READY"),
        );
    }
    Ok(index)
}

/// The model a repository load or unload names: Triton's `model_name` (field
/// 2), else field 1, which is Triton's `repository_name` and KServe's
/// `model_name` (kiln serves one repository, so a name there is the model's).
pub fn repository_model_name<'a>(field_1: &'a str, field_2: &'a str) -> Result<&'a str> {
    match (field_1, field_2) {
        (_, model) if !model.is_empty() => Ok(model),
        (model, _) if !model.is_empty() => Ok(model),
        _ => Err(ServerError::invalid(
            "the request names no model: set `model_name`",
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_repository_call_names_its_model_in_either_field() {
        // Triton's layout, with or without a repository name.
        assert_eq!(repository_model_name("", "m").unwrap(), "m");
        assert_eq!(repository_model_name("repo", "m").unwrap(), "m");
        // KServe's: the model in field 1.
        assert_eq!(repository_model_name("m", "").unwrap(), "m");
        let e = repository_model_name("", "").unwrap_err().to_string();
        assert!(e.contains("names no model"), "{e}");
    }

    #[test]
    fn every_datatype_has_triton_name() {
        for d in DataType::ALL {
            let name = triton_type(d);
            let expected = match d {
                DataType::Bytes => "TYPE_STRING".to_owned(),
                _ => format!("TYPE_{}", d.as_str()),
            };
            assert_eq!(name, expected);
        }
    }
}
