//! A parsed `config.pbtxt` → what kiln loads. Every field the file sets is either
//! honoured here or refused by name ([`HONOURED`]); nothing is silently ignored.
//!
//! | Triton                                   | kiln                                   |
//! |------------------------------------------|----------------------------------------|
//! | `platform: "onnxruntime_onnx"`, `backend: "onnxruntime"` | the `onnx` worker          |
//! | `platform: "ensemble"`                   | an ensemble ([`crate::ensemble`])      |
//! | `backend: "python"`                      | refused until the Python worker lands  |
//! | `max_batch_size`                         | `max_batch_size` and `batch_size`      |
//! | `input`/`output` name, data_type, dims   | checked against the model once loaded  |
//! | `dynamic_batching.*`                     | the dynamic batcher's parameters       |
//! | `instance_group` count, kind, gpus       | `instances`, `execution_provider`, `cuda_device` |
//! | `version_policy`                         | which version folders are served       |
//! | `parameters` (ONNX Runtime's threads)    | `intra_op_threads`, `inter_op_threads` |

use kiln_worker_sdk::{Param, ParamValue, TensorSpec};

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
    "instance_group.name",
    "instance_group.count",
    "instance_group.kind",
    "instance_group.gpus",
    "parameters",
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

/// Which worker serves a Triton platform or backend: the one place that names
/// them (the Python worker's `python` joins here when it exists).
fn worker_of(platform: &str, backend: &str) -> Result<&'static str, String> {
    match (platform, backend) {
        ("onnxruntime_onnx", "" | "onnxruntime") | ("", "onnxruntime") => Ok("onnx"),
        ("", "python") => {
            Err("backend `python`: not available (kiln has no Python worker yet)".into())
        }
        ("", "") => Err(
            "set `platform` or `backend` (kiln serves `onnxruntime_onnx` / \
                         `onnxruntime` models and `ensemble`s)"
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

/// Tensors a `config.pbtxt` declares for a worker's model: checked against what
/// the worker reads from the model once it is loaded ([`Declared::check`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Declared {
    pub inputs: Vec<TensorConfig>,
    pub outputs: Vec<TensorConfig>,
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

/// Maps a parsed config of model `name` (its folder).
pub fn map(name: &str, parsed: &Parsed) -> Result<Mapped, String> {
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
    if let Some(field) = parsed
        .fields
        .iter()
        .find(|f| !HONOURED.contains(&f.as_str()) && !extra.contains(&f.as_str()))
    {
        return Err(format!("field `{field}` is not supported by kiln"));
    }
    let policy = version_policy(c.version_policy.as_ref());
    let inputs = tensors(
        "input",
        c.input.iter().map(|t| (&t.name, t.data_type(), &t.dims)),
    )?;
    let outputs = tensors(
        "output",
        c.output.iter().map(|t| (&t.name, t.data_type(), &t.dims)),
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
    set("max_batch_size", ParamValue::Int(c.max_batch_size.into()));
    if c.max_batch_size > 0 {
        // Triton enforces max_batch_size per request; kiln's group batch size is
        // what infer enforces (docs/models.md).
        set("batch_size", ParamValue::Int(c.max_batch_size.into()));
    }
    match &c.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(d)) => {
            if c.max_batch_size == 0 {
                return Err("`dynamic_batching` needs `max_batch_size` > 0".into());
            }
            dynamic_batching(d, &mut set);
        }
        // Triton's default scheduler runs what has arrived without waiting.
        _ => set("timeout", ParamValue::Int(0)),
    }
    instance_group(&c.instance_group, &mut set)?;
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
    Ok(Mapped::Worker {
        worker,
        params,
        policy,
        declared: Declared { inputs, outputs },
    })
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

fn instance_group(
    groups: &[proto::ModelInstanceGroup],
    set: &mut impl FnMut(&str, ParamValue),
) -> Result<(), String> {
    let group = match groups {
        [] => return Ok(()),
        [one] => one,
        _ => return Err("`instance_group`: kiln runs one instance group per model".into()),
    };
    set("instances", ParamValue::Int(group.count.max(1).into()));
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

impl Declared {
    /// Checks the declared tensors against the model's, as the worker read them
    /// (`dims` without the batch dimension; the model's -1 accepts any size).
    pub fn check(&self, inputs: &[TensorSpec], outputs: &[TensorSpec]) -> Result<(), String> {
        let side = |what: &str, declared: &[TensorConfig], model: &[TensorSpec]| {
            for d in declared {
                let m = model
                    .iter()
                    .find(|m| m.name.as_str() == d.name)
                    .ok_or_else(|| format!("{what} `{}` is not the model's", d.name))?;
                let dims_match = m.dims.len() == d.dims.len()
                    && m.dims.iter().zip(&d.dims).all(|(m, d)| *m == -1 || m == d);
                if m.dtype != d.data_type || !dims_match {
                    return Err(format!(
                        "{what} `{}`: the config declares {:?} {:?}, the model has {:?} {:?}",
                        d.name,
                        d.data_type,
                        d.dims,
                        m.dtype,
                        m.dims.to_vec()
                    ));
                }
            }
            Ok(())
        };
        side("input", &self.inputs, inputs)?;
        side("output", &self.outputs, outputs)
    }

    /// Checks that every tensor of the model is declared (what Triton requires
    /// when it does not complete a config from the model).
    pub fn check_complete(
        &self,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
    ) -> Result<(), String> {
        let side = |what: &str, declared: &[TensorConfig], model: &[TensorSpec]| match model
            .iter()
            .find(|m| !declared.iter().any(|d| m.name.as_str() == d.name))
        {
            Some(m) => Err(format!(
                "the config declares no {what} `{}`, which the model has",
                m.name.as_str()
            )),
            None => Ok(()),
        };
        side("input", &self.inputs, inputs)?;
        side("output", &self.outputs, outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse;
    use super::*;

    fn mapped(text: &str) -> Result<Mapped, String> {
        map("m", &parse(text).unwrap())
    }

    fn params(text: &str) -> Vec<(String, String)> {
        match mapped(text).unwrap() {
            Mapped::Worker { params, .. } => params
                .into_iter()
                .map(|p| (p.key.to_string(), format!("{:?}", p.value)))
                .collect(),
            Mapped::Ensemble { .. } => panic!("not a worker"),
        }
    }

    #[test]
    fn issue_example_maps_to_the_onnx_worker() {
        let p = params(
            r#"platform: "onnxruntime_onnx" max_batch_size: 16
               dynamic_batching { preferred_batch_size: [4, 8] }
               instance_group [{ count: 2, kind: KIND_CPU }]
               version_policy: { all {} }"#,
        );
        let get = |k: &str| p.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
        assert_eq!(get("max_batch_size").as_deref(), Some("Int(16)"));
        assert_eq!(get("batch_size").as_deref(), Some("Int(16)"));
        assert!(get("batcher").unwrap().contains("dynamic"));
        assert!(get("preferred_batch_size").unwrap().contains("4,8"));
        assert_eq!(get("instances").as_deref(), Some("Int(2)"));
    }

    #[test]
    fn backends_are_mapped_in_one_place_or_refused_by_name() {
        assert!(matches!(
            mapped("backend: \"onnxruntime\""),
            Ok(Mapped::Worker { worker: "onnx", .. })
        ));
        let e = mapped("backend: \"python\"").unwrap_err();
        assert!(
            e.contains("python backend") || e.contains("backend `python`: not available"),
            "{e}"
        );
        let e = mapped("backend: \"tensorrt\"").unwrap_err();
        assert!(e.contains("`tensorrt`"), "{e}");
        let e = mapped("platform: \"tensorflow_savedmodel\"").unwrap_err();
        assert!(e.contains("`tensorflow_savedmodel`"), "{e}");
    }

    #[test]
    fn fields_kiln_does_not_honour_are_refused_by_name() {
        for (text, field) in [
            (
                "backend: \"onnxruntime\" model_warmup [{ name: \"w\" batch_size: 1 }]",
                "model_warmup",
            ),
            (
                "backend: \"onnxruntime\" input [{ name: \"x\" is_shape_tensor: true }]",
                "input.is_shape_tensor",
            ),
            (
                "backend: \"onnxruntime\" sequence_batching { direct {} }",
                "sequence_batching.direct",
            ),
            (
                "backend: \"onnxruntime\" response_cache { enable: true }",
                "response_cache.enable",
            ),
            (
                "backend: \"onnxruntime\" parameters { key: \"x\" value { string_value: \"1\" } }",
                "parameter `x`",
            ),
        ] {
            let e = mapped(text).unwrap_err();
            assert!(e.contains(field), "{text}: {e}");
        }
    }

    #[test]
    fn version_policies_pick_the_newest_they_allow() {
        let available = [1, 2, 3];
        assert_eq!(VersionPolicy::Latest(1).pick(&available, None), Some(3));
        assert_eq!(VersionPolicy::Latest(1).pick(&available, Some(2)), None);
        assert_eq!(VersionPolicy::Latest(2).pick(&available, Some(2)), Some(2));
        assert_eq!(VersionPolicy::All.pick(&available, Some(1)), Some(1));
        assert_eq!(
            VersionPolicy::Specific(vec![1, 2]).pick(&available, None),
            Some(2)
        );
        assert_eq!(
            VersionPolicy::Specific(vec![7]).pick(&available, None),
            None
        );
    }

    #[test]
    fn ensembles_map_to_kiln_ensembles() {
        let m = mapped(
            r#"platform: "ensemble" max_batch_size: 0
               input [{ name: "IN" data_type: TYPE_UINT32 dims: [-1] }]
               output [{ name: "OUT" data_type: TYPE_UINT32 dims: [-1] }]
               ensemble_scheduling { step [{ model_name: "echo" model_version: -1
                 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } }] }"#,
        )
        .unwrap();
        let Mapped::Ensemble { config, .. } = m else {
            panic!("not an ensemble")
        };
        assert_eq!(config.steps[0].input_map["INPUT0"], "IN");
        assert_eq!(config.inputs[0].dims, vec![-1]);
    }

    #[test]
    fn name_must_be_the_folder() {
        let e = mapped("name: \"other\" backend: \"onnxruntime\"").unwrap_err();
        assert!(e.contains("other"), "{e}");
    }
}
