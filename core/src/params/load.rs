//! Load-time parameters of a worker group: [`LoadParams`] as they arrive, one
//! `#[derive(Deserialize)]` type whose fields are the server's settings and whose
//! [`Rest`] is the worker's own; [`GroupParams`] once checked. All parameters
//! (the server's included) are also handed to the worker's `init`. The batchers'
//! settings are checked in [`super::batching`].

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::time::Duration;

use kiln_batchers::dynamic::DynamicConfig;
use kiln_worker_sdk::{BatcherKind, Param};
use serde::Deserialize;

use super::de::from_params;
use super::error::SettingError;
use super::shapes::{Levels, Names, Rest, Spelled};
use crate::compute::isolation::Isolation;
use crate::error::Result;
use crate::group::reshape::TensorShapes;
use crate::group::sequence::SequenceParams;

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
    /// The dims clients use for tensors and the model's reshapes of them
    /// (`dims.<tensor>`, `reshape.<tensor>`: a `config.pbtxt`'s `dims`, `reshape`).
    pub shapes: TensorShapes,
}

/// The load-time parameters the server reads, as they arrive: one field per
/// parameter (a struct or map per `.`-separated prefix), any value form a protocol
/// gives (see [`super::de`]). [`LoadParams::validate`] checks them and makes
/// the [`GroupParams`]. Every other key is the worker's own ([`LoadParams::worker`]):
/// [`super::check_known`] has refused the ones the worker does not declare.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct LoadParams {
    pub(super) batch_size: Option<i64>,
    pub(super) batcher: Option<BatcherName>,
    pub(super) batchers: Option<i64>,
    pub(super) instances: Option<i64>,
    pub(super) max_buffers: Option<i64>,
    pub(super) max_outstanding: Option<i64>,
    pub(super) queue_size: Option<i64>,
    pub(super) share: Option<bool>,
    pub(super) isolation: Option<IsolationName>,
    pub(super) max_host_memory: Option<i64>,
    /// Milliseconds.
    pub(super) timeout: Option<i64>,
    pub(super) gather: Option<bool>,
    // The dynamic batcher's (Triton's `dynamic_batching`).
    pub(super) preferred_batch_size: Option<Vec<i64>>,
    pub(super) max_queue_delay_microseconds: Option<i64>,
    pub(super) max_batch_bytes: Option<i64>,
    pub(super) priority_levels: Option<i64>,
    pub(super) default_priority_level: Option<i64>,
    pub(super) preserve_ordering: Option<bool>,
    pub(super) default_queue_policy: PolicyParams,
    /// By level (`priority_queue_policy.<level>.…`).
    pub(super) priority_queue_policy: Levels<Spelled<PolicyParams>>,
    // The sequence batcher's (Triton's `sequence_batching`).
    pub(super) sequence_strategy: Option<StrategyName>,
    pub(super) max_sequence_idle_microseconds: Option<i64>,
    pub(super) max_sequences: Option<i64>,
    pub(super) max_candidate_sequences: Option<i64>,
    pub(super) max_sequence_backlog: Option<i64>,
    pub(super) control: ControlParams,
    /// `state.<input> = "<output>"`.
    pub(super) state: Names<Spelled<StateOutput>>,
    /// `state_initial.<input> = value`.
    pub(super) state_initial: Names<Spelled<f64>>,
    /// `state_dims.<input> = [2, 1, 128]`: the state's shape where the model's
    /// has dynamic dims (Triton's `state.dims`).
    pub(super) state_dims: Names<Spelled<Vec<i64>>>,
    /// `dims.<tensor> = [2, 2]`: the dims clients see and send for a tensor,
    /// without the batch dimension (Triton's `dims`, [`TensorShapes`]).
    pub(super) dims: Names<Spelled<Vec<i64>>>,
    /// `reshape.<tensor> = [4]`: the model's shape of a tensor whose `dims`
    /// clients use (Triton's `reshape`).
    pub(super) reshape: Names<Spelled<Vec<i64>>>,
    /// The keys no field takes: the worker's own parameters.
    #[serde(rename = "*")]
    worker: Rest,
}

/// A queue policy's parameters (`default_queue_policy.…`, `priority_queue_policy.<level>.…`).
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(default)]
pub(super) struct PolicyParams {
    pub(super) max_queue_size: Option<i64>,
    pub(super) default_timeout_microseconds: Option<i64>,
    pub(super) allow_timeout_override: Option<bool>,
    pub(super) timeout_action: Option<TimeoutActionName>,
}

/// The sequence batcher's control inputs (`control.start = "START"`, …).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct ControlParams {
    pub(super) start: Option<String>,
    pub(super) end: Option<String>,
    pub(super) ready: Option<String>,
    pub(super) corrid: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum BatcherName {
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
pub(super) enum IsolationName {
    None,
    Process,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum StrategyName {
    Direct,
    Oldest,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub(super) enum TimeoutActionName {
    Reject,
    Delay,
}

/// A state's output: the name of a worker output, so text only.
#[derive(Debug)]
pub(super) enum StateOutput {
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

/// `value` in `1..=max`, as a non-zero count.
pub(super) fn count(key: &str, value: i64, max: usize) -> Result<NonZeroUsize, SettingError> {
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

/// A [`Names`] map's values.
fn values(names: &Names<Spelled<Vec<i64>>>) -> BTreeMap<String, Vec<i64>> {
    names
        .0
        .iter()
        .map(|(name, v)| (name.clone(), v.value.clone()))
        .collect()
}

/// `NonZeroUsize::new(n)` for a constant `n` > 0.
const fn nonzero(n: usize) -> NonZeroUsize {
    match NonZeroUsize::new(n) {
        Some(n) => n,
        None => NonZeroUsize::MIN,
    }
}

impl LoadParams {
    /// The parameters the server reads in `params`; the others are the worker's.
    pub fn from_params(params: &[Param]) -> Result<LoadParams, SettingError> {
        Ok(from_params(params)?)
    }

    /// The keys of the worker's own parameters: those no setting of the server took.
    pub fn worker(&self) -> &[String] {
        &self.worker.0
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
            shapes: TensorShapes {
                dims: values(&self.dims),
                reshape: values(&self.reshape),
            },
        })
    }
}

impl GroupParams {
    /// Reads and checks the group parameters ([`LoadParams`], then
    /// [`LoadParams::validate`]); the worker's own are left to it (a load
    /// checks them first: [`super::check_known`]).
    pub fn parse(params: &[Param]) -> Result<GroupParams> {
        Ok(LoadParams::from_params(params)?.validate()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::error::ValueError;
    use kiln_batchers::dynamic::TimeoutAction;
    use kiln_worker_sdk::coerce::CoerceError;
    use kiln_worker_sdk::params_from_pairs;

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
            SettingError::Value(ValueError::Coerce(CoerceError::NotBool { .. }))
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
    fn keys_no_setting_takes_are_the_workers() {
        let p = LoadParams::from_params(&params_from_pairs(&[
            ("batch_size", "4"),
            ("increment", "1"),
            ("model_dir", "/m"),
            ("control.begin", "B"),
            ("priority_queue_policy.x.timeout_action", "DELAY"),
        ]))
        .unwrap();
        assert_eq!(
            p.worker(),
            [
                "increment",
                "model_dir",
                "control.begin",
                "priority_queue_policy.x.timeout_action"
            ]
        );
        assert_eq!(p.batch_size, Some(4));
    }
}
