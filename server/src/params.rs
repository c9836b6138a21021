//! Load-time parameters of a worker group. The group-level ones are read here; all
//! parameters (these included) are also handed to the worker's `init`.

use std::time::Duration;

use kiln_batchers::dynamic::{DynamicConfig, QueuePolicy, TimeoutAction};
use kiln_worker_sdk::{BatcherKind, Param, ParamValue, Params};

use crate::error::{Result, ServerError};

/// Group settings read from load-time parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupParams {
    /// Rows per batch; defaults to the worker's max batch size.
    pub batch_size: Option<usize>,
    /// Soft batcher timeout after the first request (`timeout`, ms).
    pub timeout: Duration,
    /// Batcher threads sharing the group's queues.
    pub batchers: usize,
    /// Worker instances (one thread each).
    pub instances: usize,
    /// Buffer sets in the pool: the bound on batches in flight.
    pub max_buffers: Option<usize>,
    /// `false`: load another instance into an existing group with these parameters.
    pub share: bool,
    /// Overrides the worker's preferred batcher.
    pub batcher: Option<BatcherKind>,
    /// Requests the group queues before refusing with 429.
    pub queue_size: usize,
    /// The dynamic batcher's settings (`batcher=dynamic`), with Triton's names.
    pub dynamic: DynamicParams,
    /// The sequence batcher's settings (`batcher=sequence`).
    pub sequence: crate::sequence::SequenceParams,
}

/// `dynamic_batching` settings as load-time parameters (Triton's names).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DynamicParams {
    /// `preferred_batch_size`: one size or a comma-separated list.
    pub preferred_batch_sizes: Vec<usize>,
    /// `max_queue_delay_microseconds` (default 0).
    pub max_queue_delay: Duration,
    /// `max_batch_bytes`: input bytes per batch (kiln's cost limit).
    pub max_batch_bytes: Option<usize>,
    /// `priority_levels` (default 1).
    pub priority_levels: usize,
    /// `default_priority_level` (default: the lowest, `priority_levels`).
    pub default_priority_level: usize,
    /// `default_queue_policy.*` for every level, then `priority_queue_policy.<level>.*`.
    pub policies: Vec<QueuePolicy>,
    /// `preserve_ordering`: answers leave in the order their batches were formed.
    pub preserve_ordering: bool,
}

impl DynamicParams {
    /// The batcher's config for batches of up to `max_batch_size` rows.
    pub fn config(&self, max_batch_size: usize, allow_ragged: bool) -> DynamicConfig {
        DynamicConfig {
            max_batch_size,
            preferred_batch_sizes: self.preferred_batch_sizes.clone(),
            max_queue_delay: self.max_queue_delay,
            max_batch_bytes: self.max_batch_bytes,
            priority_levels: self.priority_levels,
            default_priority_level: self.default_priority_level,
            policies: self.policies.clone(),
            allow_ragged,
        }
    }

    fn parse(params: &[Param]) -> Result<DynamicParams> {
        let p = Params(params);
        let bad = ServerError::InvalidRequest;
        let preferred_batch_sizes = match p.string("preferred_batch_size") {
            None => Vec::new(),
            Some(list) => {
                let mut sizes = list
                    .split(',')
                    .map(|v| match v.trim().parse::<usize>() {
                        Ok(n) if n > 0 => Ok(n),
                        _ => Err(ServerError::invalid(format!(
                            "parameter `preferred_batch_size` must be positive sizes, got `{list}`"
                        ))),
                    })
                    .collect::<Result<Vec<_>>>()?;
                sizes.sort_unstable();
                sizes.dedup();
                sizes
            }
        };
        let micros = |key: &str| -> Result<Option<Duration>> {
            match p.int(key).map_err(bad)? {
                None | Some(0) => Ok(None),
                Some(v) if v > 0 => Ok(Some(Duration::from_micros(v as u64))),
                Some(v) => Err(ServerError::invalid(format!(
                    "parameter `{key}` must be ≥ 0, got {v}"
                ))),
            }
        };
        let levels = match p.int("priority_levels").map_err(bad)? {
            None | Some(0) => 1,
            Some(v) if (1..=64).contains(&v) => v as usize,
            Some(v) => {
                return Err(ServerError::invalid(format!(
                    "parameter `priority_levels` must be in 0..=64, got {v}"
                )))
            }
        };
        let default_level = match p.int("default_priority_level").map_err(bad)? {
            None | Some(0) => levels,
            Some(v) if v >= 1 && v as usize <= levels => v as usize,
            Some(v) => {
                return Err(ServerError::invalid(format!(
                    "parameter `default_priority_level` must be in 1..={levels}, got {v}"
                )))
            }
        };
        let policy = |prefix: &str, base: &QueuePolicy| -> Result<QueuePolicy> {
            let key = |field: &str| format!("{prefix}{field}");
            Ok(QueuePolicy {
                max_queue_size: match p.int(&key("max_queue_size")).map_err(bad)? {
                    None => base.max_queue_size,
                    Some(v) if v >= 0 => v as usize,
                    Some(v) => {
                        return Err(ServerError::invalid(format!(
                            "parameter `{}` must be ≥ 0, got {v}",
                            key("max_queue_size")
                        )))
                    }
                },
                default_timeout: match p.get(&key("default_timeout_microseconds")) {
                    None => base.default_timeout,
                    Some(_) => micros(&key("default_timeout_microseconds"))?,
                },
                allow_timeout_override: p
                    .bool(&key("allow_timeout_override"))
                    .map_err(bad)?
                    .unwrap_or(base.allow_timeout_override),
                timeout_action: match p
                    .string(&key("timeout_action"))
                    .map(|s| s.to_ascii_uppercase())
                    .as_deref()
                {
                    None => base.timeout_action,
                    Some("REJECT") => TimeoutAction::Reject,
                    Some("DELAY") => TimeoutAction::Delay,
                    Some(other) => {
                        return Err(ServerError::invalid(format!(
                            "parameter `{}` must be REJECT or DELAY, got `{other}`",
                            key("timeout_action")
                        )))
                    }
                },
            })
        };
        let base = policy(
            "default_queue_policy.",
            &QueuePolicy {
                allow_timeout_override: false,
                ..QueuePolicy::default()
            },
        )?;
        let policies = (1..=levels)
            .map(|level| policy(&format!("priority_queue_policy.{level}."), &base))
            .collect::<Result<Vec<_>>>()?;
        Ok(DynamicParams {
            preferred_batch_sizes,
            max_queue_delay: micros("max_queue_delay_microseconds")?.unwrap_or(Duration::ZERO),
            max_batch_bytes: match p.int("max_batch_bytes").map_err(bad)? {
                None | Some(0) => None,
                Some(v) if v > 0 => Some(v as usize),
                Some(v) => {
                    return Err(ServerError::invalid(format!(
                        "parameter `max_batch_bytes` must be ≥ 0, got {v}"
                    )))
                }
            },
            priority_levels: levels,
            default_priority_level: default_level,
            policies,
            preserve_ordering: p.bool("preserve_ordering").map_err(bad)?.unwrap_or(false),
        })
    }
}

/// Parameter keys the server reads (the rest are the worker's own).
pub const GROUP_KEYS: [&str; 8] = [
    "batch_size",
    "timeout",
    "batchers",
    "instances",
    "max_buffers",
    "share",
    "batcher",
    "queue_size",
];

impl GroupParams {
    /// Reads and checks the group parameters.
    pub fn parse(params: &[Param]) -> Result<GroupParams> {
        let p = Params(params);
        let bad = ServerError::InvalidRequest;
        let count = |key: &str, default: usize, max: usize| -> Result<usize> {
            match p.int(key).map_err(bad)? {
                None => Ok(default),
                Some(v) if v >= 1 && v as u64 <= max as u64 => Ok(v as usize),
                Some(v) => Err(ServerError::invalid(format!(
                    "parameter `{key}` must be in 1..={max}, got {v}"
                ))),
            }
        };
        let batch_size = match p.get("batch_size") {
            None => None,
            Some(_) => Some(count("batch_size", 1, 1 << 16)?),
        };
        let max_buffers = match p.get("max_buffers") {
            None => None,
            Some(_) => Some(count("max_buffers", 1, 4096)?),
        };
        let timeout_ms = match p.int("timeout").map_err(bad)? {
            None => 0,
            Some(v) if (0..=60_000).contains(&v) => v as u64,
            Some(v) => {
                return Err(ServerError::invalid(format!(
                    "parameter `timeout` (ms) must be in 0..=60000, got {v}"
                )))
            }
        };
        let batcher = match p.string("batcher").map(|s| s.to_ascii_lowercase()) {
            None => None,
            Some(s) if s == "hard" => Some(BatcherKind::Hard),
            Some(s) if s == "soft" => Some(BatcherKind::Soft),
            Some(s) if s == "dynamic" => Some(BatcherKind::Dynamic),
            Some(s) if s == "sequence" => Some(BatcherKind::Sequence),
            Some(s) => {
                return Err(ServerError::invalid(format!(
                    "parameter `batcher` must be `hard`, `soft`, `dynamic` or `sequence`, got `{s}`"
                )))
            }
        };
        Ok(GroupParams {
            batch_size,
            timeout: Duration::from_millis(timeout_ms),
            batchers: count("batchers", 1, 64)?,
            instances: count("instances", 1, 256)?,
            max_buffers,
            share: p.bool("share").map_err(bad)?.unwrap_or(true),
            batcher,
            queue_size: count("queue_size", 4096, 1 << 20)?,
            dynamic: DynamicParams::parse(params)?,
            sequence: crate::sequence::SequenceParams::parse(params)?,
        })
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
    use kiln_worker_sdk::{params_from_pairs, Param};

    #[test]
    fn defaults_and_ranges() {
        let g = GroupParams::parse(&[]).unwrap();
        assert_eq!(g.batchers, 1);
        assert_eq!(g.instances, 1);
        assert!(g.share);
        assert_eq!(g.batch_size, None);
        let g = GroupParams::parse(&params_from_pairs(&[
            ("batch_size", "8"),
            ("timeout", "5"),
            ("batcher", "HARD"),
            ("share", "false"),
        ]))
        .unwrap();
        assert_eq!(g.batch_size, Some(8));
        assert_eq!(g.timeout, Duration::from_millis(5));
        assert_eq!(g.batcher, Some(BatcherKind::Hard));
        assert!(!g.share);
        for bad in [
            ("batch_size", "0"),
            ("timeout", "-1"),
            ("batcher", "x"),
            ("instances", "y"),
        ] {
            assert!(
                GroupParams::parse(&params_from_pairs(&[bad])).is_err(),
                "{bad:?}"
            );
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
