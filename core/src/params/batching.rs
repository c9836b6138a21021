//! The batchers' settings among the load parameters: the dynamic batcher's
//! (Triton's `dynamic_batching`, queue policies by priority level) and the
//! sequence batcher's (Triton's `sequence_batching`, controls and implicit state),
//! checked into the configurations the batchers take.

use std::num::NonZeroUsize;
use std::time::Duration;

use kiln_batchers::dynamic::{DynamicConfig, QueuePolicy, TimeoutAction};
use kiln_batchers::sequence::{Control, Strategy};

use super::error::SettingError;
use super::load::{LoadParams, PolicyParams, StateOutput, StrategyName, TimeoutActionName};
use super::shapes::Spelled;
use crate::group::sequence::{SequenceParams, StateParam};

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
    /// The dynamic batcher's settings; `max_batch_size` and `allow_ragged` are the
    /// group's, set by `group::resolve`.
    pub(super) fn dynamic(&self) -> Result<DynamicConfig, SettingError> {
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
                match self.priority_queue_policy.0.get(&level.to_string()) {
                    Some(policy) => policy.value.validate(&prefix, &base),
                    None => Ok(base.clone()),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A policy for a level that does not exist would be ignored: refuse it
        // (the one given first).
        let missing = self
            .priority_queue_policy
            .0
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
    pub(super) fn sequence(&self) -> Result<SequenceParams, SettingError> {
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
