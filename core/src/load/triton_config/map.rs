//! A parsed `config.pbtxt` → what kiln loads. Every field the file sets is either
//! honoured here or refused by name ([`HONOURED`]); nothing is silently ignored.
//!
//! | Triton                                   | kiln                                   |
//! |------------------------------------------|----------------------------------------|
//! | `platform: "onnxruntime_onnx"`, `backend: "onnxruntime"` | the `onnx` worker          |
//! | `platform: "ensemble"`                   | an ensemble ([`crate::ensemble`])      |
//! | `backend: "python"`                      | the `python` worker, `isolation = "process"` |
//! | `max_batch_size`                         | `max_batch_size` and `batch_size`      |
//! | `input`/`output` name, data_type, dims   | checked against the model once loaded; `dims.<tensor>` |
//! | `input`/`output` `reshape`               | `reshape.<tensor>` ([`crate::group::reshape`]) |
//! | `input.optional: true`                   | refused, saying why                    |
//! | `dynamic_batching.*`                     | the dynamic batcher's parameters       |
//! | `sequence_batching.*`                    | the sequence batcher's ([`super::sequence`]) |
//! | `instance_group` count, kind, gpus       | `instances`, `execution_provider`, `cuda_device` |
//! | `version_policy`                         | which version folders are served       |
//! | `parameters` (ONNX Runtime's threads)    | `intra_op_threads`, `inter_op_threads` |
//! | `parameters` (a python model's)          | `parameters.<key>`, for `initialize`   |
//! | `optimization.execution_accelerators`    | `cuda`: the CUDA provider ([`super::accelerators`]) |
//! | `model_warmup`                           | run before the model serves ([`super::warmup`]) |
//!
//! With auto-completion on (Triton's default, [`super::complete`]), what the file
//! leaves out comes from the model: its tensors, and for ONNX a batch dimension of
//! Triton's default size with `dynamic_batching {}` when the model can batch.

use kiln_worker_sdk::{Param, ParamValue};

pub use super::autocomplete::Declared;
use super::proto::{
    self, model_config::SchedulingChoice, model_instance_group::Kind,
    model_version_policy::PolicyChoice,
};
use super::Parsed;
use crate::ensemble::config::{parse_data_type, EnsembleConfig, StepConfig, TensorConfig};

/// The fields (dotted paths, see [`Parsed::fields`]) kiln honours, for a worker's
/// model and for an ensemble. Any other field set in the file is a load error.
const HONOURED: &[&str] = &[
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "input.name",
    "input.data_type",
    "input.dims",
    "output.name",
    "output.data_type",
    "output.dims",
    "version_policy.latest.num_versions",
    "version_policy.all",
    "version_policy.specific.versions",
];

/// Honoured for a worker's model only.
const HONOURED_WORKER: &[&str] = &[
    "dynamic_batching.preferred_batch_size",
    "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.preserve_ordering",
    "dynamic_batching.priority_levels",
    "dynamic_batching.default_priority_level",
    "dynamic_batching.default_queue_policy.max_queue_size",
    "dynamic_batching.default_queue_policy.default_timeout_microseconds",
    "dynamic_batching.default_queue_policy.allow_timeout_override",
    "dynamic_batching.default_queue_policy.timeout_action",
    "dynamic_batching.priority_queue_policy",
    "dynamic_batching",
    // A group of defaults only (`instance_group [{ kind: KIND_AUTO }]`).
    "instance_group",
    "instance_group.name",
    "instance_group.count",
    "instance_group.kind",
    "instance_group.gpus",
    "parameters",
    // Triton's `reshape` (`reshape {}`: a scalar), kiln's `reshape.<tensor>`.
    "input.reshape",
    "input.reshape.shape",
    "output.reshape",
    "output.reshape.shape",
    // Refused with the reason in `map` (`optional: true`).
    "input.optional",
];

/// Honoured for an ensemble only.
const HONOURED_ENSEMBLE: &[&str] = &[
    "ensemble_scheduling.step.model_name",
    "ensemble_scheduling.step.model_version",
    "ensemble_scheduling.step.input_map",
    "ensemble_scheduling.step.output_map",
];

/// Triton's ONNX Runtime backend parameters → the onnx worker's.
const ORT_PARAMETERS: &[(&str, &str)] = &[
    ("intra_op_thread_count", "intra_op_threads"),
    ("inter_op_thread_count", "inter_op_threads"),
];

/// Which worker serves a Triton platform or backend: the one place that names them.
pub(super) fn worker_of(platform: &str, backend: &str) -> Result<&'static str, String> {
    match (platform, backend) {
        ("onnxruntime_onnx", "" | "onnxruntime") | ("", "onnxruntime") => Ok("onnx"),
        ("", "python") => Ok("python"),
        ("", "") => Err(
            "set `platform` or `backend` (kiln serves `onnxruntime_onnx` / \
                         `onnxruntime` models, `python` models and `ensemble`s)"
                .into(),
        ),
        ("", other) => Err(format!("backend `{other}` is not available in kiln")),
        (other, _) => Err(format!("platform `{other}` is not available in kiln")),
    }
}

/// Which version folders a model's `version_policy` allows; kiln serves each of
/// them side by side (Triton's default policy: `latest { num_versions: 1 }`).
#[derive(Debug, Clone, PartialEq)]
pub enum VersionPolicy {
    Latest(u32),
    All,
    Specific(Vec<i64>),
}

impl VersionPolicy {
    /// The versions the policy serves among `available` (ascending), ascending;
    /// a `specific` version without its folder is left out, as Triton does.
    pub fn allowed(&self, available: &[u64]) -> Vec<u64> {
        match self {
            VersionPolicy::All => available.to_vec(),
            VersionPolicy::Latest(n) => {
                let n = (*n).max(1) as usize;
                available[available.len().saturating_sub(n)..].to_vec()
            }
            VersionPolicy::Specific(list) => available
                .iter()
                .copied()
                .filter(|v| list.iter().any(|s| u64::try_from(*s) == Ok(*v)))
                .collect(),
        }
    }

    /// The highest version the policy serves among `available` (ascending), or
    /// `wanted` if the policy allows it and it exists.
    pub fn pick(&self, available: &[u64], wanted: Option<u64>) -> Option<u64> {
        let allowed = self.allowed(available);
        match wanted {
            Some(v) => allowed.contains(&v).then_some(v),
            None => allowed.last().copied(),
        }
    }
}

/// What kiln loads for a `config.pbtxt`.
#[derive(Debug, Clone)]
pub enum Mapped {
    Worker {
        worker: &'static str,
        params: Vec<Param>,
        policy: VersionPolicy,
        declared: Declared,
    },
    Ensemble {
        config: EnsembleConfig,
        policy: VersionPolicy,
    },
}

/// Maps a parsed config of model `name` (its folder); `complete`: auto-complete
/// what the file leaves out from the model, as Triton does unless
/// `--disable-auto-complete-config` ([`super::complete`]).
pub fn map<'a>(name: &str, parsed: &'a Parsed, complete: bool) -> Result<Mapped, String> {
    let c = &parsed.config;
    if !c.name.is_empty() && c.name != name {
        return Err(format!(
            "`name: \"{}\"` differs from the model's folder `{name}`",
            c.name
        ));
    }
    let ensemble = c.platform == "ensemble";
    let extra: &[&str] = if ensemble {
        HONOURED_ENSEMBLE
    } else {
        HONOURED_WORKER
    };
    if let Some(field) = parsed.fields.iter().find(|f| {
        let f = f.as_str();
        !HONOURED.contains(&f)
            && !extra.contains(&f)
            && (ensemble
                || !(super::sequence::HONOURED.contains(&f)
                    || super::accelerators::HONOURED.contains(&f)
                    || super::warmup::HONOURED.contains(&f)))
    }) {
        return Err(format!("field `{field}` is not supported by kiln"));
    }
    if let Some(t) = c.input.iter().find(|t| t.optional) {
        // kiln's workers take every input of each batch (the onnx worker binds
        // each input the model declares), so a request cannot leave one out.
        return Err(format!(
            "input `{}`: `optional: true` is not supported by kiln: its workers take \
             every input the model declares in each request",
            t.name
        ));
    }
    let policy = version_policy(c.version_policy.as_ref());
    // The model's view: `reshape.shape` where the file reshapes a tensor.
    let model_dims = |dims: &'a Vec<i64>, reshape: &'a Option<proto::ModelTensorReshape>| {
        reshape.as_ref().map_or(dims, |r| &r.shape)
    };
    let inputs = tensors(
        "input",
        c.input
            .iter()
            .map(|t| (&t.name, t.data_type(), model_dims(&t.dims, &t.reshape))),
    )?;
    let outputs = tensors(
        "output",
        c.output
            .iter()
            .map(|t| (&t.name, t.data_type(), model_dims(&t.dims, &t.reshape))),
    )?;
    if ensemble {
        let steps = match &c.scheduling_choice {
            Some(SchedulingChoice::EnsembleScheduling(s)) => &s.step[..],
            _ => &[][..],
        };
        if steps.is_empty() {
            return Err("an ensemble declares its steps in `ensemble_scheduling.step`".into());
        }
        let config = EnsembleConfig {
            max_batch_size: u32::try_from(c.max_batch_size)
                .map_err(|_| "`max_batch_size` must not be negative".to_owned())?,
            inputs,
            outputs,
            steps: steps
                .iter()
                .map(|s| StepConfig {
                    model_name: s.model_name.clone(),
                    model_version: s.model_version,
                    input_map: s.input_map.clone().into_iter().collect(),
                    output_map: s.output_map.clone().into_iter().collect(),
                })
                .collect(),
        };
        return Ok(Mapped::Ensemble { config, policy });
    }
    let worker = worker_of(&c.platform, &c.backend)?;
    let mut params = Vec::new();
    let mut set = |key: &str, value: ParamValue| {
        params.push(Param {
            key: key.into(),
            value,
        })
    };
    if c.max_batch_size < 0 {
        return Err("`max_batch_size` must not be negative".into());
    }
    // ONNX with no batch size, auto-completed: the model's batch dimension, if it
    // has one, at Triton's default size (the worker knows whether it has).
    let autofill = complete && worker == "onnx" && c.max_batch_size == 0;
    if autofill {
        set(
            "default_max_batch_size",
            ParamValue::Int(super::autocomplete::DEFAULT_MAX_BATCH_SIZE),
        );
    } else {
        set("max_batch_size", ParamValue::Int(c.max_batch_size.into()));
    }
    if c.max_batch_size > 0 {
        // Triton enforces max_batch_size per request; kiln's group batch size is
        // what infer enforces (docs/models.md).
        set("batch_size", ParamValue::Int(c.max_batch_size.into()));
    }
    let mut sequence_inputs = Vec::new();
    match &c.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(d)) => {
            if c.max_batch_size == 0 && !autofill {
                return Err("`dynamic_batching` needs `max_batch_size` > 0".into());
            }
            dynamic_batching(d, &mut set);
        }
        Some(SchedulingChoice::SequenceBatching(s)) => {
            sequence_inputs = super::sequence::map(s, &mut set)?;
        }
        // Triton's ONNX auto-completion adds `dynamic_batching {}` to a model that
        // batches (more than 1); on a model that turns out not to, kiln's dynamic
        // batcher runs each request alone, as the default scheduler would.
        _ if complete && worker == "onnx" && c.max_batch_size != 1 => {
            set("batcher", ParamValue::Str("dynamic".into()));
        }
        // Triton's default scheduler runs what has arrived without waiting.
        _ => set("timeout", ParamValue::Int(0)),
    }
    let declared = c
        .input
        .iter()
        .map(|t| (&t.name, &t.dims, &t.reshape))
        .chain(c.output.iter().map(|t| (&t.name, &t.dims, &t.reshape)));
    for (name, dims, reshape) in declared {
        client_dims(name, dims, reshape.as_ref(), &mut set);
    }
    instance_group(&c.instance_group, worker, &mut set)?;
    super::accelerators::map(c, worker, &mut set)?;
    if worker == "python" {
        python(c, &inputs, &outputs, &mut set);
    } else {
        ort_parameters(c, &mut set)?;
    }
    Ok(Mapped::Worker {
        worker,
        params,
        policy,
        declared: Declared {
            inputs,
            outputs,
            sequence_inputs,
            complete,
        },
    })
}

/// A declared tensor's `dims` as clients use them (`dims.<tensor>`: Triton's
/// metadata shows and its requests take the file's dims, which may be more
/// precise than the model's), and its `reshape` (`reshape.<tensor>`).
fn client_dims(
    name: &str,
    dims: &[i64],
    reshape: Option<&proto::ModelTensorReshape>,
    set: &mut impl FnMut(&str, ParamValue),
) {
    let list = |dims: &[i64]| {
        let list: Vec<String> = dims.iter().map(i64::to_string).collect();
        ParamValue::Str(list.join(",").as_str().into())
    };
    if dims.is_empty() && reshape.is_none() {
        return;
    }
    set(&format!("dims.{name}"), list(dims));
    if let Some(r) = reshape {
        set(&format!("reshape.{name}"), list(&r.shape));
    }
}

/// Triton's ONNX Runtime backend parameters → the onnx worker's.
fn ort_parameters(
    c: &proto::ModelConfig,
    set: &mut impl FnMut(&str, ParamValue),
) -> Result<(), String> {
    for (key, value) in &c.parameters {
        let (_, ours) = ORT_PARAMETERS
            .iter()
            .find(|(theirs, _)| theirs == key)
            .ok_or_else(|| format!("parameter `{key}` is not supported by kiln"))?;
        let n: i64 = value.string_value.trim().parse().map_err(|_| {
            format!(
                "parameter `{key}`: `{}` is not a number",
                value.string_value
            )
        })?;
        set(ours, ParamValue::Int(n));
    }
    Ok(())
}

/// A python model: each instance's interpreter in its own worker host (the python
/// worker's requirement), its declared tensors and `parameters` as the worker
/// takes them (`"input.INPUT0" = "TYPE_UINT32 [-1]"`, `parameters.<key>`). A model
/// that declares none completes itself in `auto_complete_config`.
fn python(
    c: &proto::ModelConfig,
    inputs: &[TensorConfig],
    outputs: &[TensorConfig],
    set: &mut impl FnMut(&str, ParamValue),
) {
    set("isolation", ParamValue::Str("process".into()));
    for (prefix, list) in [("input", inputs), ("output", outputs)] {
        for t in list {
            let dims: Vec<String> = t.dims.iter().map(i64::to_string).collect();
            let text = format!(
                "{} [{}]",
                super::data_type::triton_type(t.data_type),
                dims.join(", ")
            );
            set(
                &format!("{prefix}.{}", t.name),
                ParamValue::Str(text.as_str().into()),
            );
        }
    }
    for (key, value) in &c.parameters {
        set(
            &format!("parameters.{key}"),
            ParamValue::Str(value.string_value.as_str().into()),
        );
    }
}

fn version_policy(policy: Option<&proto::ModelVersionPolicy>) -> VersionPolicy {
    match policy.and_then(|p| p.policy_choice.as_ref()) {
        None => VersionPolicy::Latest(1),
        Some(PolicyChoice::Latest(l)) => VersionPolicy::Latest(l.num_versions),
        Some(PolicyChoice::All(_)) => VersionPolicy::All,
        Some(PolicyChoice::Specific(s)) => VersionPolicy::Specific(s.versions.clone()),
    }
}

fn tensors<'a>(
    what: &str,
    list: impl Iterator<Item = (&'a String, proto::DataType, &'a Vec<i64>)>,
) -> Result<Vec<TensorConfig>, String> {
    list.map(|(name, dtype, dims)| {
        let data_type = parse_data_type(dtype.as_str_name()).ok_or_else(|| {
            format!(
                "{what} `{name}`: data_type {} is not supported",
                dtype.as_str_name()
            )
        })?;
        Ok(TensorConfig {
            name: name.clone(),
            data_type,
            dims: dims.clone(),
        })
    })
    .collect()
}

fn dynamic_batching(d: &proto::ModelDynamicBatching, set: &mut impl FnMut(&str, ParamValue)) {
    set("batcher", ParamValue::Str("dynamic".into()));
    if !d.preferred_batch_size.is_empty() {
        let list: Vec<String> = d.preferred_batch_size.iter().map(i32::to_string).collect();
        set(
            "preferred_batch_size",
            ParamValue::Str(list.join(",").as_str().into()),
        );
    }
    let int = |v: u64| ParamValue::Int(i64::try_from(v).unwrap_or(i64::MAX));
    set(
        "max_queue_delay_microseconds",
        int(d.max_queue_delay_microseconds),
    );
    if d.preserve_ordering {
        set("preserve_ordering", ParamValue::Bool(true));
    }
    if d.priority_levels > 0 {
        set("priority_levels", int(d.priority_levels));
        set("default_priority_level", int(d.default_priority_level));
    }
    let mut policy = |prefix: &str, p: &proto::ModelQueuePolicy| {
        set(
            &format!("{prefix}.max_queue_size"),
            int(p.max_queue_size.into()),
        );
        set(
            &format!("{prefix}.default_timeout_microseconds"),
            int(p.default_timeout_microseconds),
        );
        set(
            &format!("{prefix}.allow_timeout_override"),
            ParamValue::Bool(p.allow_timeout_override),
        );
        let action = match p.timeout_action() {
            proto::model_queue_policy::TimeoutAction::Reject => "reject",
            proto::model_queue_policy::TimeoutAction::Delay => "delay",
        };
        set(
            &format!("{prefix}.timeout_action"),
            ParamValue::Str(action.into()),
        );
    };
    if let Some(p) = &d.default_queue_policy {
        policy("default_queue_policy", p);
    }
    for (level, p) in &d.priority_queue_policy {
        policy(&format!("priority_queue_policy.{level}"), p);
    }
}

/// Triton's instance count of a group that gives none (`SetDefaultInstanceCount`):
/// 2 for ONNX Runtime on the CPU, 1 otherwise. On kiln's shared ONNX Runtime pool
/// two instances run a model's requests side by side under load and on every core
/// for one client (docs/models.md, "The onnx worker").
pub(super) fn default_instance_count(worker: &str, kind: Kind, gpus: &[i32]) -> i32 {
    let cpu = matches!(kind, Kind::Cpu) || (matches!(kind, Kind::Auto) && gpus.is_empty());
    if worker == "onnx" && cpu {
        2
    } else {
        1
    }
}

fn instance_group(
    groups: &[proto::ModelInstanceGroup],
    worker: &str,
    set: &mut impl FnMut(&str, ParamValue),
) -> Result<(), String> {
    let group = match groups {
        // Triton's group of kind AUTO, which is the CPU to kiln (below).
        [] => {
            let count = default_instance_count(worker, Kind::Auto, &[]);
            set("instances", ParamValue::Int(count.into()));
            return Ok(());
        }
        [one] => one,
        _ => return Err("`instance_group`: kiln runs one instance group per model".into()),
    };
    let count = if group.count >= 1 {
        group.count
    } else {
        default_instance_count(worker, group.kind(), &group.gpus)
    };
    set("instances", ParamValue::Int(count.into()));
    if worker == "python" {
        // The interpreter runs on the CPU; the model's own code picks its devices.
        return match (group.kind(), &group.gpus[..]) {
            (Kind::Cpu | Kind::Auto, []) => Ok(()),
            _ => Err("`instance_group`: kiln runs python models as KIND_CPU".into()),
        };
    }
    match (group.kind(), &group.gpus[..]) {
        // KIND_AUTO without gpus: the onnx worker's default provider (CPU).
        (Kind::Cpu | Kind::Auto, []) => {}
        (Kind::Cpu, _) => return Err("`instance_group`: KIND_CPU takes no `gpus`".into()),
        (Kind::Gpu | Kind::Auto, gpus) => {
            set("execution_provider", ParamValue::Str("cuda".into()));
            match gpus {
                [] => {}
                [gpu] => set("cuda_device", ParamValue::Int((*gpu).into())),
                _ => {
                    return Err(
                        "`instance_group.gpus`: kiln runs a model's instances on one GPU".into(),
                    )
                }
            }
        }
        (Kind::Model, _) => {
            return Err("`instance_group.kind`: KIND_MODEL is not supported by kiln".into())
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
