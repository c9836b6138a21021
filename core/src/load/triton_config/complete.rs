//! A loaded model's `config.pbtxt` as Triton answers it (`/v2/models/{m}/config`,
//! gRPC `ModelConfig`): the file's config with what Triton fills in when it
//! loads a model, so that `tritonclient`'s `get_model_config` reads the same from
//! both servers. Checked against Triton 2.51's answers (docs/models.md,
//! "`/config`"):
//!
//! | left out in the file                | Triton answers (and so does kiln)          |
//! |-------------------------------------|--------------------------------------------|
//! | `name`                              | the model's folder                         |
//! | `version_policy`                    | `latest { num_versions: 1 }`               |
//! | `backend` of `onnxruntime_onnx`     | `onnxruntime`                              |
//! | `input`/`output` (auto-completed)   | the model's tensors, as the worker read them |
//! | `max_batch_size` of a model that batches (auto-completed, [`super::autocomplete`]) | the group's batch size (4) |
//! | a scheduler, when kiln's auto-completion chose the dynamic batcher | `dynamic_batching {}` |
//! | `instance_group` (a worker's model) | one group `<model>_0`, count 2 for `onnxruntime` (1 for others), `KIND_CPU` |
//! | an instance group's name, count, kind | `<model>_<i>`, 2 for `onnxruntime` on the CPU (else 1), `KIND_CPU` |
//! | `dynamic_batching.preferred_batch_size` | `[max_batch_size]`                     |
//! | `optimization` (a worker's model)   | default priority, pinned input and output memory |
//! | `model_transaction_policy` (an ensemble) | `decoupled: false`                    |

use kiln_worker_sdk::TensorSpec;

use super::proto::{
    self, model_config::SchedulingChoice, model_instance_group::Kind,
    model_optimization_policy::PinnedMemoryBuffer, model_version_policy, ModelConfig, ModelInput,
    ModelInstanceGroup, ModelOptimizationPolicy, ModelOutput, ModelVersionPolicy,
};
use crate::models::Served;

/// `config` (model `name`'s file) completed as Triton answers it, for the loaded
/// `served`.
pub fn complete(config: &ModelConfig, name: &str, served: &Served) -> ModelConfig {
    let mut c = config.clone();
    c.name = name.to_owned();
    if c.version_policy.is_none() {
        c.version_policy = Some(ModelVersionPolicy {
            policy_choice: Some(model_version_policy::PolicyChoice::Latest(
                model_version_policy::Latest { num_versions: 1 },
            )),
        });
    }
    let group = match served {
        Served::Group(group) => group,
        Served::Ensemble(_) => {
            c.model_transaction_policy
                .get_or_insert_with(Default::default);
            return c;
        }
    };
    if c.backend.is_empty() && c.platform == "onnxruntime_onnx" {
        c.backend = "onnxruntime".into();
    }
    if c.input.is_empty() {
        c.input = group.info.inputs.iter().map(input).collect();
    }
    if c.output.is_empty() {
        c.output = group.info.outputs.iter().map(output).collect();
    }
    // Auto-completed: the file said no batch size, the model batches; and
    // Triton's `dynamic_batching {}`, which kiln's mapping gives a model with no
    // scheduler (map.rs), so only then the dynamic batcher runs without one.
    if c.max_batch_size == 0 && group.info.max_batch_size > 0 {
        c.max_batch_size = i32::try_from(group.settings.batch_size).unwrap_or(i32::MAX);
    }
    if c.scheduling_choice.is_none()
        && c.max_batch_size > 1
        && group.settings.batcher == kiln_worker_sdk::BatcherKind::Dynamic
    {
        c.scheduling_choice = Some(SchedulingChoice::DynamicBatching(Default::default()));
    }
    if c.instance_group.is_empty() {
        c.instance_group.push(ModelInstanceGroup::default());
    }
    let worker = super::map::worker_of(&c.platform, &c.backend).unwrap_or_default();
    for (i, g) in c.instance_group.iter_mut().enumerate() {
        if g.name.is_empty() {
            g.name = format!("{name}_{i}");
        }
        if g.count < 1 {
            g.count = super::map::default_instance_count(worker, g.kind(), &g.gpus);
        }
        if g.kind() == Kind::Auto {
            g.set_kind(Kind::Cpu);
        }
    }
    if let Some(SchedulingChoice::DynamicBatching(d)) = &mut c.scheduling_choice {
        if d.preferred_batch_size.is_empty() && c.max_batch_size > 0 {
            d.preferred_batch_size.push(c.max_batch_size);
        }
    }
    let pinned = || Some(PinnedMemoryBuffer { enable: true });
    let o = c
        .optimization
        .get_or_insert_with(ModelOptimizationPolicy::default);
    o.input_pinned_memory = o.input_pinned_memory.take().or_else(pinned);
    o.output_pinned_memory = o.output_pinned_memory.take().or_else(pinned);
    c
}

fn data_type(t: &TensorSpec) -> i32 {
    proto::DataType::from_str_name(super::data_type::triton_type(t.dtype))
        .unwrap_or(proto::DataType::TypeInvalid) as i32
}

fn input(t: &TensorSpec) -> ModelInput {
    ModelInput {
        name: t.name.to_string(),
        data_type: data_type(t),
        dims: t.dims.to_vec(),
        ..Default::default()
    }
}

fn output(t: &TensorSpec) -> ModelOutput {
    ModelOutput {
        name: t.name.to_string(),
        data_type: data_type(t),
        dims: t.dims.to_vec(),
        ..Default::default()
    }
}
