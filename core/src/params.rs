//! Load-time parameters of a worker group. The group-level ones are read here; all
//! parameters (these included) are also handed to the worker's `init`.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::time::Duration;

use kiln_batchers::dynamic::{DynamicConfig, QueuePolicy, TimeoutAction};
use kiln_batchers::sequence::{Control, Strategy};
use kiln_worker_sdk::{BatcherKind, Param, ParamScope, ParamSpec, ParamValue};
use serde::Deserialize;

use crate::error::{Result, ServerError};
use crate::isolation::Isolation;
use crate::param_de::{from_params, Names, Spelled, ValueError};
use crate::sequence::{SequenceParams, StateParam};

/// Group settings read from load-time parameters, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupParams {
    /// Rows per batch; defaults to the worker's max batch size.
    pub batch_size: Option<NonZeroUsize>,
    /// Soft batcher timeout after the first request (`timeout`, ms).
    pub timeout: Duration,
    /// Soft batcher with no timeout: whether batches gather while the callers fall
    /// behind (`gather`, default true; `kiln_batchers::gather_target`).
    pub gather: bool,
    /// Batcher threads sharing the group's queues.
    pub batchers: NonZeroUsize,
    /// Worker instances (one thread each).
    pub instances: NonZeroUsize,
    /// Buffer sets in the pool: the bound on batches in flight.
    pub max_buffers: Option<NonZeroUsize>,
    /// Batches an asynchronous worker instance may have submitted at once.
    pub max_outstanding: Option<NonZeroUsize>,
    /// `false`: load another instance into an existing group with these parameters.
    pub share: bool,
    /// Overrides the worker's preferred batcher.
    pub batcher: Option<BatcherKind>,
    /// Requests the group queues before refusing with 429.
    pub queue_size: NonZeroUsize,
    /// The dynamic batcher's settings (`batcher=dynamic`), with Triton's names.
    pub dynamic: DynamicConfig,
    /// The sequence batcher's settings (`batcher=sequence`).
    pub sequence: SequenceParams,
    /// Where the plugin runs: in the server, or each instance in its own
    /// `kiln worker-host` process (`isolation = "process"`).
    pub isolation: Isolation,
    /// The most private memory each worker host may map (`max_host_memory`,
    /// bytes; its `RLIMIT_DATA`).
    pub max_host_memory: Option<NonZeroUsize>,
}

/// The load-time parameters the server reads, as they arrive: one field per
/// parameter (a struct or map per `.`-separated prefix), any value form a protocol
/// gives (see [`crate::param_de`]). [`LoadParams::validate`] checks them and makes
/// the [`GroupParams`]; the worker's own parameters are not here.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct LoadParams {
    batch_size: Option<i64>,
    batcher: Option<BatcherName>,
    batchers: Option<i64>,
    instances: Option<i64>,
    max_buffers: Option<i64>,
    max_outstanding: Option<i64>,
    queue_size: Option<i64>,
    share: Option<bool>,
    isolation: Option<IsolationName>,
    max_host_memory: Option<i64>,
    /// Milliseconds.
    timeout: Option<i64>,
    gather: Option<bool>,
    // The dynamic batcher's (Triton's `dynamic_batching`).
    preferred_batch_size: Option<Vec<i64>>,
    max_queue_delay_microseconds: Option<i64>,
    max_batch_bytes: Option<i64>,
    priority_levels: Option<i64>,
    default_priority_level: Option<i64>,
    preserve_ordering: Option<bool>,
    default_queue_policy: PolicyParams,
    /// By level (`priority_queue_policy.<level>.…`).
    priority_queue_policy: BTreeMap<String, Spelled<PolicyParams>>,
    // The sequence batcher's (Triton's `sequence_batching`).
    sequence_strategy: Option<StrategyName>,
    max_sequence_idle_microseconds: Option<i64>,
    max_sequences: Option<i64>,
    max_candidate_sequences: Option<i64>,
    max_sequence_backlog: Option<i64>,
    control: ControlParams,
    /// `state.<input> = "<output>"`.
    state: Names<Spelled<StateOutput>>,
    /// `state_initial.<input> = value`.
    state_initial: Names<Spelled<f64>>,
    /// `state_dims.<input> = [2, 1, 128]`: the state's shape where the model's
    /// has dynamic dims (Triton's `state.dims`).
    state_dims: Names<Spelled<Vec<i64>>>,
}

/// A queue policy's parameters (`default_queue_policy.…`, `priority_queue_policy.<level>.…`).
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(default)]
struct PolicyParams {
    max_queue_size: Option<i64>,
    default_timeout_microseconds: Option<i64>,
    allow_timeout_override: Option<bool>,
    timeout_action: Option<TimeoutActionName>,
}

/// The sequence batcher's control inputs (`control.start = "START"`, …).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ControlParams {
    start: Option<String>,
    end: Option<String>,
    ready: Option<String>,
    corrid: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum BatcherName {
    Hard,
    Soft,
    Dynamic,
    Sequence,
}

impl From<BatcherName> for BatcherKind {
    fn from(name: BatcherName) -> BatcherKind {
        match name {
            BatcherName::Hard => BatcherKind::Hard,
            BatcherName::Soft => BatcherKind::Soft,
            BatcherName::Dynamic => BatcherKind::Dynamic,
            BatcherName::Sequence => BatcherKind::Sequence,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum IsolationName {
    None,
    Process,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StrategyName {
    Direct,
    Oldest,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
enum TimeoutActionName {
    Reject,
    Delay,
}

/// A state's output: the name of a worker output, so text only.
#[derive(Debug)]
enum StateOutput {
    Name(String),
    /// Any other value, as text (refused by [`LoadParams::validate`]).
    NotAName(String),
}

impl<'de> Deserialize<'de> for StateOutput {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = StateOutput;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("the name of an output")
            }
            fn visit_str<E>(self, v: &str) -> std::result::Result<StateOutput, E> {
                Ok(StateOutput::Name(v.to_owned()))
            }
            fn visit_bool<E>(self, v: bool) -> std::result::Result<StateOutput, E> {
                Ok(StateOutput::NotAName(v.to_string()))
            }
            fn visit_i64<E>(self, v: i64) -> std::result::Result<StateOutput, E> {
                Ok(StateOutput::NotAName(v.to_string()))
            }
            fn visit_u64<E>(self, v: u64) -> std::result::Result<StateOutput, E> {
                Ok(StateOutput::NotAName(v.to_string()))
            }
            fn visit_f64<E>(self, v: f64) -> std::result::Result<StateOutput, E> {
                Ok(StateOutput::NotAName(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A load-time parameter the server reads whose value is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingError {
    /// The value does not have the parameter's type.
    #[error(transparent)]
    Value(#[from] ValueError),
    /// A number outside its range.
    #[error("parameter `{key}` must be in {range}, got {got}")]
    OutOfRange {
        key: String,
        range: String,
        got: i64,
    },
    /// The soft batcher's `timeout` outside 0..=60000 ms.
    #[error("parameter `timeout` (ms) must be in 0..=60000, got {got}")]
    Timeout { got: i64 },
    /// A size or duration below zero.
    #[error("parameter `{key}` must be ≥ 0, got {got}")]
    Negative { key: String, got: i64 },
    /// A duration that must be positive.
    #[error("parameter `{key}` must be > 0, got {got}")]
    NotPositive { key: String, got: i64 },
    /// A preferred batch size of 0 or less.
    #[error("parameter `preferred_batch_size` must be positive sizes, got `{got}`")]
    Sizes { got: String },
    /// A queue policy for a priority level that does not exist.
    #[error("parameter `{key}`: level {level} is not in 1..={levels} (`priority_levels`)")]
    NoSuchLevel {
        key: String,
        level: usize,
        levels: usize,
    },
    /// `max_sequences` (or `max_candidate_sequences`) 0.
    #[error("parameter `max_sequences` must be at least 1")]
    NoSequences,
    /// A `state.<input>` whose value is not an output's name.
    #[error("parameter `{key}` must name the output that updates the state, got {got}")]
    StateOutput { key: String, got: String },
    /// A `state_initial.<input>` without its `state.<input>`.
    #[error("parameter `{key}`: `{input}` is not a state (declare `state.{input}`)")]
    NotAState { key: String, input: String },
}

impl From<SettingError> for ServerError {
    fn from(e: SettingError) -> ServerError {
        ServerError::InvalidRequest(e.to_string())
    }
}

/// `value` in `1..=max`, as a non-zero count.
fn count(key: &str, value: i64, max: usize) -> Result<NonZeroUsize, SettingError> {
    usize::try_from(value)
        .ok()
        .filter(|&v| v <= max)
        .and_then(NonZeroUsize::new)
        .ok_or_else(|| SettingError::OutOfRange {
            key: key.to_owned(),
            range: format!("1..={max}"),
            got: value,
        })
}

/// Microseconds, 0 meaning none.
fn micros(key: &str, value: Option<i64>) -> Result<Option<Duration>, SettingError> {
    match value {
        None | Some(0) => Ok(None),
        Some(v) if v > 0 => Ok(Some(Duration::from_micros(v.unsigned_abs()))),
        Some(got) => Err(SettingError::Negative {
            key: key.to_owned(),
            got,
        }),
    }
}

/// `NonZeroUsize::new(n)` for a constant `n` > 0.
const fn nonzero(n: usize) -> NonZeroUsize {
    match NonZeroUsize::new(n) {
        Some(n) => n,
        None => NonZeroUsize::MIN,
    }
}

impl PolicyParams {
    /// The policy these parameters make of `base`; `prefix` names them in errors.
    fn validate(&self, prefix: &str, base: &QueuePolicy) -> Result<QueuePolicy, SettingError> {
        let key = |field: &str| format!("{prefix}{field}");
        Ok(QueuePolicy {
            max_queue_size: match self.max_queue_size {
                None => base.max_queue_size,
                Some(v) => usize::try_from(v).map_err(|_| SettingError::Negative {
                    key: key("max_queue_size"),
                    got: v,
                })?,
            },
            default_timeout: match self.default_timeout_microseconds {
                None => base.default_timeout,
                Some(v) => micros(&key("default_timeout_microseconds"), Some(v))?,
            },
            allow_timeout_override: self
                .allow_timeout_override
                .unwrap_or(base.allow_timeout_override),
            timeout_action: match self.timeout_action {
                None => base.timeout_action,
                Some(TimeoutActionName::Reject) => TimeoutAction::Reject,
                Some(TimeoutActionName::Delay) => TimeoutAction::Delay,
            },
        })
    }
}

impl LoadParams {
    /// The parameters the server reads in `params` (the others are the worker's).
    pub fn from_params(params: &[Param]) -> Result<LoadParams, SettingError> {
        Ok(from_params(params)?.0)
    }

    /// Checks every setting and makes the group's.
    pub fn validate(&self) -> Result<GroupParams, SettingError> {
        let counted = |key: &str, value: Option<i64>, max: usize| {
            value.map(|v| count(key, v, max)).transpose()
        };
        let timeout_ms = match self.timeout {
            None => 0,
            Some(v) if (0..=60_000).contains(&v) => v.unsigned_abs(),
            Some(got) => return Err(SettingError::Timeout { got }),
        };
        Ok(GroupParams {
            batch_size: counted("batch_size", self.batch_size, 1 << 16)?,
            timeout: Duration::from_millis(timeout_ms),
            gather: self.gather.unwrap_or(true),
            batchers: counted("batchers", self.batchers, 64)?.unwrap_or(NonZeroUsize::MIN),
            instances: counted("instances", self.instances, 256)?.unwrap_or(NonZeroUsize::MIN),
            max_buffers: counted("max_buffers", self.max_buffers, 4096)?,
            max_outstanding: counted("max_outstanding", self.max_outstanding, 1024)?,
            share: self.share.unwrap_or(true),
            batcher: self.batcher.map(BatcherKind::from),
            queue_size: counted("queue_size", self.queue_size, 1 << 20)?.unwrap_or(nonzero(4096)),
            dynamic: self.dynamic()?,
            sequence: self.sequence()?,
            isolation: match self.isolation {
                None | Some(IsolationName::None) => Isolation::None,
                Some(IsolationName::Process) => Isolation::Process,
            },
            max_host_memory: counted("max_host_memory", self.max_host_memory, usize::MAX)?,
        })
    }

    /// The dynamic batcher's settings; `max_batch_size` and `allow_ragged` are the
    /// group's, set by `group::resolve`.
    fn dynamic(&self) -> Result<DynamicConfig, SettingError> {
        let mut preferred_batch_sizes = match &self.preferred_batch_size {
            None => Vec::new(),
            Some(sizes) => sizes
                .iter()
                .map(|&v| usize::try_from(v).ok().filter(|&n| n > 0))
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| SettingError::Sizes {
                    got: sizes
                        .iter()
                        .map(i64::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                })?,
        };
        preferred_batch_sizes.sort_unstable();
        preferred_batch_sizes.dedup();
        let levels = match self.priority_levels {
            None | Some(0) => 1,
            Some(v) => usize::try_from(v)
                .ok()
                .filter(|l| (1..=64).contains(l))
                .ok_or_else(|| SettingError::OutOfRange {
                    key: "priority_levels".into(),
                    range: "0..=64".into(),
                    got: v,
                })?,
        };
        let default_priority_level = match self.default_priority_level {
            None | Some(0) => levels,
            Some(v) => usize::try_from(v)
                .ok()
                .filter(|l| (1..=levels).contains(l))
                .ok_or_else(|| SettingError::OutOfRange {
                    key: "default_priority_level".into(),
                    range: format!("1..={levels}"),
                    got: v,
                })?,
        };
        let base = self.default_queue_policy.validate(
            "default_queue_policy.",
            &QueuePolicy {
                allow_timeout_override: false,
                ..QueuePolicy::default()
            },
        )?;
        let policies = (1..=levels)
            .map(|level| {
                let prefix = format!("priority_queue_policy.{level}.");
                match self.priority_queue_policy.get(&level.to_string()) {
                    Some(policy) => policy.value.validate(&prefix, &base),
                    None => Ok(base.clone()),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A policy for a level that does not exist would be ignored: refuse it
        // (the one given first).
        let missing = self
            .priority_queue_policy
            .iter()
            .filter_map(|(level, policy)| Some((level.parse::<usize>().ok()?, policy)))
            .filter(|(level, _)| !(1..=levels).contains(level))
            .min_by_key(|(_, policy)| policy.index);
        if let Some((level, policy)) = missing {
            return Err(SettingError::NoSuchLevel {
                key: policy.key.clone(),
                level,
                levels,
            });
        }
        Ok(DynamicConfig {
            max_batch_size: 0,
            allow_ragged: false,
            preferred_batch_sizes,
            max_queue_delay: micros(
                "max_queue_delay_microseconds",
                self.max_queue_delay_microseconds,
            )?
            .unwrap_or(Duration::ZERO),
            max_batch_bytes: match self.max_batch_bytes {
                None | Some(0) => None,
                Some(v) => Some(usize::try_from(v).map_err(|_| SettingError::Negative {
                    key: "max_batch_bytes".into(),
                    got: v,
                })?),
            },
            priority_levels: levels,
            default_priority_level,
            policies,
            preserve_ordering: self.preserve_ordering.unwrap_or(false),
        })
    }

    /// The sequence batcher's settings.
    fn sequence(&self) -> Result<SequenceParams, SettingError> {
        let max_idle = match self.max_sequence_idle_microseconds {
            None => Duration::from_secs(1),
            Some(v) if v > 0 => Duration::from_micros(v.unsigned_abs()),
            Some(got) => {
                return Err(SettingError::NotPositive {
                    key: "max_sequence_idle_microseconds".into(),
                    got,
                })
            }
        };
        let count = |key: &str, value: Option<i64>| {
            value
                .map(|v| {
                    usize::try_from(v)
                        .ok()
                        .filter(|&n| n <= 1 << 20)
                        .ok_or_else(|| SettingError::OutOfRange {
                            key: key.to_owned(),
                            range: format!("0..={}", 1 << 20),
                            got: v,
                        })
                })
                .transpose()
        };
        let max_sequences = match count("max_sequences", self.max_sequences)? {
            Some(n) => Some(n),
            None => count("max_candidate_sequences", self.max_candidate_sequences)?,
        };
        let max_sequences = match max_sequences {
            None => None,
            Some(n) => Some(NonZeroUsize::new(n).ok_or(SettingError::NoSequences)?),
        };
        let c = &self.control;
        let controls = [
            (Control::Start, &c.start),
            (Control::End, &c.end),
            (Control::Ready, &c.ready),
            (Control::CorrId, &c.corrid),
        ]
        .into_iter()
        .filter_map(|(kind, name)| Some((kind, name.clone()?)))
        .collect();
        // In the order they were given.
        let mut given: Vec<(&String, &Spelled<StateOutput>)> = self.state.0.iter().collect();
        given.sort_by_key(|(_, s)| s.index);
        let states = given
            .into_iter()
            .map(|(input, output)| match &output.value {
                StateOutput::Name(name) => Ok(StateParam {
                    input: input.clone(),
                    output: name.clone(),
                    initial: self.state_initial.0.get(input).map(|v| v.value),
                    dims: self.state_dims.0.get(input).map(|v| v.value.clone()),
                }),
                StateOutput::NotAName(got) => Err(SettingError::StateOutput {
                    key: output.key.clone(),
                    got: got.clone(),
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let stray = self
            .state_initial
            .0
            .iter()
            .map(|(input, v)| (input, &v.key, v.index))
            .chain(
                self.state_dims
                    .0
                    .iter()
                    .map(|(input, v)| (input, &v.key, v.index)),
            )
            .filter(|(input, _, _)| !self.state.0.contains_key(*input))
            .min_by_key(|(_, _, index)| *index);
        if let Some((input, key, _)) = stray {
            return Err(SettingError::NotAState {
                key: key.clone(),
                input: input.clone(),
            });
        }
        Ok(SequenceParams {
            strategy: match self.sequence_strategy {
                None | Some(StrategyName::Direct) => Strategy::Direct,
                Some(StrategyName::Oldest) => Strategy::Oldest,
            },
            max_idle,
            max_sequences,
            max_backlog: count("max_sequence_backlog", self.max_sequence_backlog)?.unwrap_or(0),
            controls,
            states,
        })
    }
}

/// The load parameters the server reads, whatever the worker: the group's, the
/// dynamic batcher's, the sequence batcher's, and the repository's `model_dir`.
/// A `<placeholder>` segment stands for a name (`<level>`: a number).
const SERVER_PARAMETERS: &[&str] = &[
    "batch_size",
    "batcher",
    "batchers",
    "instances",
    "max_buffers",
    "max_outstanding",
    "queue_size",
    "share",
    "timeout",
    "gather",
    "isolation",
    "max_host_memory",
    "model_dir",
    "preferred_batch_size",
    "max_queue_delay_microseconds",
    "max_batch_bytes",
    "priority_levels",
    "default_priority_level",
    "preserve_ordering",
    "default_queue_policy.max_queue_size",
    "default_queue_policy.default_timeout_microseconds",
    "default_queue_policy.allow_timeout_override",
    "default_queue_policy.timeout_action",
    "priority_queue_policy.<level>.max_queue_size",
    "priority_queue_policy.<level>.default_timeout_microseconds",
    "priority_queue_policy.<level>.allow_timeout_override",
    "priority_queue_policy.<level>.timeout_action",
    "sequence_strategy",
    "max_sequence_idle_microseconds",
    "max_sequences",
    "max_candidate_sequences",
    "max_sequence_backlog",
    "control.start",
    "control.end",
    "control.ready",
    "control.corrid",
    "state.<input>",
    "state_initial.<input>",
    "state_dims.<input>",
];

/// Whether `key` takes a list: JSON's and TOML's `[4, 8]` arrive as the text `"4,8"`.
pub fn takes_list(key: &str) -> bool {
    key.eq_ignore_ascii_case("preferred_batch_size")
        || key
            .get(..11)
            .is_some_and(|head| head.eq_ignore_ascii_case("state_dims."))
}

/// A `--load` spec that does not parse (see [`parse_load_spec`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadSpecError {
    /// Nothing before the `:`.
    #[error("--load `{spec}`: no worker name")]
    NoWorker { spec: String },
    /// A parameter without its `=`.
    #[error("--load `{spec}`: `{pair}` is not key=value")]
    NotKeyValue { spec: String, pair: String },
    /// A list left open.
    #[error("--load `{spec}`: `[` without its `]`")]
    Unclosed { spec: String },
}

/// Parses `WORKER[:key=value,...]`, the form of `kiln serve --load`. A value in
/// brackets is a list: `preferred_batch_size=[4,8]` is `preferred_batch_size` with
/// the text `4,8`, the form JSON's and TOML's `[4, 8]` take (commas inside the
/// brackets do not separate parameters). Values are text; the worker name is
/// lower-cased.
pub fn parse_load_spec(spec: &str) -> Result<(String, Vec<Param>), LoadSpecError> {
    let (worker, rest) = spec.split_once(':').unwrap_or((spec, ""));
    if worker.trim().is_empty() {
        return Err(LoadSpecError::NoWorker {
            spec: spec.to_owned(),
        });
    }
    let mut pairs = Vec::new();
    let (mut start, mut depth) = (0, 0usize);
    for (i, c) in rest.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                pairs.push(&rest[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(LoadSpecError::Unclosed {
            spec: spec.to_owned(),
        });
    }
    pairs.push(&rest[start..]);
    let mut params = Vec::new();
    for pair in pairs.into_iter().filter(|p| !p.trim().is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(LoadSpecError::NotKeyValue {
                spec: spec.to_owned(),
                pair: pair.to_owned(),
            });
        };
        let value = value.trim();
        let value = match value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) {
            Some(items) => items
                .split(',')
                .map(str::trim)
                .collect::<Vec<_>>()
                .join(","),
            None => value.to_owned(),
        };
        params.push(Param {
            key: key.trim().into(),
            value: ParamValue::Str(value.as_str().into()),
        });
    }
    Ok((worker.trim().to_ascii_lowercase(), params))
}

/// A load parameter neither the server nor the worker knows.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamError {
    #[error("unknown parameter `{key}` for {subject}{hint}; known: {known}")]
    Unknown {
        key: String,
        /// `worker `echo`` or `model `m` (worker `echo`)`.
        subject: String,
        /// ` (did you mean `…`?)`, or empty.
        hint: String,
        /// The known names, sorted and comma-separated.
        known: String,
    },
    #[error(
        "parameter `{key}` of {subject} is a request parameter: set it on each \
         inference request, not at load"
    )]
    RequestOnly { key: String, subject: String },
}

impl From<ParamError> for ServerError {
    fn from(e: ParamError) -> ServerError {
        ServerError::InvalidRequest(e.to_string())
    }
}

/// Refuses the first parameter in `params` that neither the server
/// ([`SERVER_PARAMETERS`]) nor the worker's load-time declarations (`specs`)
/// know, naming it, the closest known name and every known one. Case-insensitive.
pub fn check_known(subject: &str, specs: &[ParamSpec], params: &[Param]) -> Result<(), ParamError> {
    let load = || specs.iter().filter(|s| s.scope != ParamScope::Request);
    for param in params {
        let key = param.key.as_str();
        if SERVER_PARAMETERS.iter().any(|p| server_matches(p, key))
            || load().any(|s| s.matches(key))
        {
            continue;
        }
        if specs.iter().any(|s| s.matches(key)) {
            return Err(ParamError::RequestOnly {
                key: key.to_owned(),
                subject: subject.to_owned(),
            });
        }
        let mut known: Vec<&str> = SERVER_PARAMETERS
            .iter()
            .copied()
            .chain(load().map(ParamSpec::name))
            .collect();
        known.sort_unstable();
        known.dedup();
        return Err(ParamError::Unknown {
            key: key.to_owned(),
            subject: subject.to_owned(),
            hint: closest(key, &known)
                .map(|name| format!(" (did you mean `{name}`?)"))
                .unwrap_or_default(),
            known: known.join(", "),
        });
    }
    Ok(())
}

/// Whether `key` is the server parameter `pattern` (see [`SERVER_PARAMETERS`]).
fn server_matches(pattern: &str, key: &str) -> bool {
    let (mut want, mut got) = (pattern.split('.'), key.split('.'));
    loop {
        match (want.next(), got.next()) {
            (None, None) => return true,
            (Some("<level>"), Some(seg))
                if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) => {}
            // A name (the last segment) may itself hold dots.
            (Some(w), Some(seg)) if w.starts_with('<') && w != "<level>" => return !seg.is_empty(),
            (Some(w), Some(seg)) if w.eq_ignore_ascii_case(seg) => {}
            _ => return false,
        }
    }
}

/// The known name `key` most likely meant: one that ends in `.key`, else the
/// nearest within a small edit distance.
fn closest<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    let key = key.to_ascii_lowercase();
    let suffix = format!(".{key}");
    if let Some(name) = known.iter().copied().find(|n| n.ends_with(&suffix)) {
        return Some(name);
    }
    let limit = (key.len() / 3).clamp(1, 3);
    known
        .iter()
        .map(|n| (edit_distance(&key, n), *n))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, n)| n)
}

/// Levenshtein distance (by characters).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != *cb))
                .min(above + 1)
                .min(row[j] + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

impl GroupParams {
    /// Reads and checks the group parameters ([`LoadParams`], then
    /// [`LoadParams::validate`]).
    pub fn parse(params: &[Param]) -> Result<GroupParams> {
        Ok(LoadParams::from_params(params)?.validate()?)
    }
}

/// The identity of a parameter set: sorted lower-case keys with their values,
/// without `share`. Equal identities mean "the same configuration".
pub fn identity(params: &[Param]) -> String {
    let mut pairs: Vec<(String, String)> = params
        .iter()
        .filter(|p| !p.key.as_str().eq_ignore_ascii_case("share"))
        .map(|p| (p.key.as_str().to_ascii_lowercase(), value_text(&p.value)))
        .collect();
    // Stable sort by key, then keep the first of repeated keys: the value
    // `Params::get` would read.
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    pairs.dedup_by(|later, first| later.0 == first.0);
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// A value's canonical text: `2`, `2.0` and `"2"` are one value, as are `true`
/// and `"TRUE"`, so a CLI (text) and a JSON (typed) load agree.
fn value_text(value: &ParamValue) -> String {
    match value {
        ParamValue::Str(s) => {
            let t = s.trim();
            if let Ok(i) = t.parse::<i64>() {
                i.to_string()
            } else if let Ok(u) = t.parse::<u64>() {
                u.to_string()
            } else if let Ok(f) = t.parse::<f64>() {
                canonical_float(f)
            } else if t.eq_ignore_ascii_case("true") || t.eq_ignore_ascii_case("false") {
                t.to_ascii_lowercase()
            } else {
                s.to_string()
            }
        }
        ParamValue::Float(f) => canonical_float(*f),
        other => other.to_string(),
    }
}

fn canonical_float(f: f64) -> String {
    if f.fract() == 0.0 && f.abs() < 9e15 {
        (f as i64).to_string()
    } else {
        f.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::{params_from_pairs, Param, ParamKind};

    #[test]
    fn defaults_and_ranges() {
        let g = GroupParams::parse(&[]).unwrap();
        assert_eq!(g.batchers.get(), 1);
        assert_eq!(g.instances.get(), 1);
        assert!(g.share);
        assert!(g.gather);
        assert_eq!(g.batch_size, None);
        let g = GroupParams::parse(&params_from_pairs(&[
            ("batch_size", "8"),
            ("timeout", "5"),
            ("batcher", "HARD"),
            ("share", "false"),
            ("gather", "false"),
        ]))
        .unwrap();
        assert_eq!(g.batch_size.map(NonZeroUsize::get), Some(8));
        assert_eq!(g.timeout, Duration::from_millis(5));
        assert_eq!(g.batcher, Some(BatcherKind::Hard));
        assert!(!g.share);
        assert!(!g.gather);
        for bad in [
            ("batch_size", "0"),
            ("timeout", "-1"),
            ("batcher", "x"),
            ("instances", "y"),
            ("gather", "sometimes"),
        ] {
            assert!(
                GroupParams::parse(&params_from_pairs(&[bad])).is_err(),
                "{bad:?}"
            );
        }
    }

    const ECHO: &[ParamSpec] = &[
        ParamSpec::load("max_batch_size", ParamKind::Int { min: 1, max: 256 }),
        ParamSpec::operator("runtime"),
        ParamSpec::load("batch_axis.*", ParamKind::Any),
        ParamSpec::request("increment", ParamKind::Any),
    ];

    fn unknown(pairs: &[(&str, &str)]) -> Option<String> {
        check_known("worker `echo`", ECHO, &params_from_pairs(pairs))
            .err()
            .map(|e| ServerError::from(e).to_string())
    }

    #[test]
    fn known_parameters_pass() {
        let fine = [
            ("Batch_Size", "4"),
            ("max_batch_size", "8"),
            ("runtime", "x"),
            ("batch_axis.state", "1"),
            ("default_queue_policy.allow_timeout_override", "true"),
            ("priority_queue_policy.2.timeout_action", "DELAY"),
            ("state.in.put", "out"),
            ("state_initial.in.put", "1"),
            ("control.corrid", "C"),
            ("max_candidate_sequences", "2"),
            ("model_dir", "/m"),
        ];
        assert_eq!(unknown(&fine), None);
    }

    #[test]
    fn unknown_parameters_are_named_with_the_known_ones() {
        let e = unknown(&[("batch_size", "4"), ("allow_timeout_override", "true")]).unwrap();
        assert!(
            e.starts_with(
                "unknown parameter `allow_timeout_override` for worker `echo` (did you mean \
                 `default_queue_policy.allow_timeout_override`?); known: batch_axis.*, batch_size, batcher,"
            ),
            "{e}"
        );
        assert!(
            e.contains("max_batch_size") && !e.contains("increment"),
            "{e}"
        );
        let e = unknown(&[("max_bath_size", "4")]).unwrap();
        assert!(e.contains("(did you mean `max_batch_size`?)"), "{e}");
        let e = unknown(&[("zzzzzz", "4")]).unwrap();
        assert!(e.contains("`zzzzzz`") && !e.contains("did you mean"), "{e}");
        for bad in [
            "priority_queue_policy.x.timeout_action",
            "priority_queue_policy.1.timeout",
            "state.",
            "control.begin",
            "batch_axis.",
        ] {
            assert!(unknown(&[(bad, "1")]).is_some(), "{bad}");
        }
        let e = unknown(&[("increment", "1")]).unwrap();
        assert!(
            e.contains("`increment`") && e.contains("request parameter"),
            "{e}"
        );
    }

    #[test]
    fn load_specs_take_lists_in_brackets() {
        let (w, p) =
            parse_load_spec("Echo:batcher=dynamic, preferred_batch_size=[4, 8],timeout=2").unwrap();
        assert_eq!(w, "echo");
        let text: Vec<(&str, String)> = p
            .iter()
            .map(|p| (p.key.as_str(), p.value.to_string()))
            .collect();
        assert_eq!(
            text,
            [
                ("batcher", "dynamic".to_owned()),
                ("preferred_batch_size", "4,8".to_owned()),
                ("timeout", "2".to_owned())
            ]
        );
        assert_eq!(
            parse_load_spec("echo:preferred_batch_size=[4,8").unwrap_err(),
            LoadSpecError::Unclosed {
                spec: "echo:preferred_batch_size=[4,8".into()
            }
        );
        assert!(parse_load_spec("echo:batch_size").is_err());
        assert!(parse_load_spec(":x=1").is_err());
        assert_eq!(parse_load_spec("invert-image").unwrap().1.len(), 0);
    }

    #[test]
    fn server_parameters_are_the_fields_of_load_params() {
        for name in SERVER_PARAMETERS {
            let key = name.replace("<level>", "1").replace("<input>", "in.put");
            let value = match name.rsplit('.').next() {
                Some("batcher") => "soft",
                Some("sequence_strategy") => "direct",
                Some("timeout_action") => "reject",
                Some("isolation") => "process",
                _ => "1",
            };
            let (_, left) =
                from_params::<LoadParams>(&params_from_pairs(&[(&key, value)])).unwrap();
            // `model_dir` is the repository's, handed to the worker.
            let want: &[&str] = if key == "model_dir" {
                &["model_dir"]
            } else {
                &[]
            };
            assert_eq!(left, want, "{key}");
        }
        // And every field of `LoadParams` is a name `check_known` knows (a struct
        // or map field: a prefix of some).
        let nested = params_from_pairs(&[
            ("default_queue_policy.max_queue_size", "1"),
            ("priority_levels", "1"),
            ("priority_queue_policy.1.max_queue_size", "1"),
            ("control.start", "S"),
        ]);
        let fields = crate::param_de::declared_fields::<LoadParams>(&nested).unwrap();
        assert!(fields.len() > 30, "{fields:?}");
        for field in fields {
            let field = field.replace("priority_queue_policy.1.", "priority_queue_policy.<level>.");
            let prefix = format!("{field}.");
            assert!(
                SERVER_PARAMETERS
                    .iter()
                    .any(|known| *known == field || known.starts_with(&prefix)),
                "`{field}` is not in SERVER_PARAMETERS"
            );
        }
    }

    #[test]
    fn validate_returns_typed_errors() {
        let validate = |pairs: &[(&str, &str)]| {
            LoadParams::from_params(&params_from_pairs(pairs)).and_then(|p| p.validate())
        };
        assert_eq!(
            validate(&[("batch_size", "0")]).unwrap_err(),
            SettingError::OutOfRange {
                key: "batch_size".into(),
                range: "1..=65536".into(),
                got: 0
            }
        );
        assert_eq!(
            validate(&[("preferred_batch_size", "4,0")]).unwrap_err(),
            SettingError::Sizes { got: "4,0".into() }
        );
        assert!(matches!(
            validate(&[("share", "perhaps")]).unwrap_err(),
            SettingError::Value(ValueError::NotBool { .. })
        ));
        assert_eq!(
            validate(&[("max_sequences", "0")]).unwrap_err(),
            SettingError::NoSequences
        );
        let e = validate(&[("batcher", "Firm")]).unwrap_err().to_string();
        assert_eq!(
            e,
            "parameter `batcher` must be `hard`, `soft`, `dynamic` or `sequence`, got `firm`"
        );
        let g = validate(&[
            ("batcher", "Dynamic"),
            ("preferred_batch_size", "8,4,8"),
            ("priority_levels", "2"),
            ("priority_queue_policy.1.timeout_action", "delay"),
            ("default_queue_policy.default_timeout_microseconds", "100"),
        ])
        .unwrap();
        assert_eq!(g.batcher, Some(BatcherKind::Dynamic));
        assert_eq!(g.dynamic.preferred_batch_sizes, vec![4, 8]);
        assert_eq!(g.dynamic.policies[0].timeout_action, TimeoutAction::Delay);
        assert_eq!(g.dynamic.policies[1].timeout_action, TimeoutAction::Reject);
        assert_eq!(
            g.dynamic.policies[1].default_timeout,
            Some(Duration::from_micros(100))
        );
        assert_eq!(g.queue_size.get(), 4096);
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("incremnet", "increment"), 2);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("timeout", "timeout"), 0);
    }

    #[test]
    fn policies_of_missing_levels_are_refused() {
        let two = |key| params_from_pairs(&[("priority_levels", "2"), (key, "1")]);
        assert!(GroupParams::parse(&two("priority_queue_policy.2.max_queue_size")).is_ok());
        for bad in [
            "priority_queue_policy.3.max_queue_size",
            "Priority_Queue_Policy.0.max_queue_size",
        ] {
            let e = GroupParams::parse(&two(bad)).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("1..=2"), "{e}");
        }
    }

    #[test]
    fn identity_ignores_order_case_and_share() {
        let a = params_from_pairs(&[("batch_size", "8"), ("Timeout", "5"), ("share", "false")]);
        let b = params_from_pairs(&[("timeout", "5"), ("batch_size", "8")]);
        assert_eq!(identity(&a), identity(&b));
        let c = params_from_pairs(&[("batch_size", "4")]);
        assert_ne!(identity(&a), identity(&c));
        // Text and typed values that mean the same are the same.
        let typed = vec![
            Param {
                key: "scale".into(),
                value: ParamValue::Float(2.0),
            },
            Param {
                key: "on".into(),
                value: ParamValue::Bool(true),
            },
        ];
        let text = params_from_pairs(&[("scale", "2.0"), ("on", "TRUE")]);
        assert_eq!(identity(&typed), identity(&text));
        // A repeated key counts with its first value, as `Params::get` reads it.
        let repeated = params_from_pairs(&[("x", "9"), ("x", "1")]);
        assert_eq!(identity(&repeated), "x=9");
    }
}
