//! Load-time parameters of a worker group. The group-level ones are read here; all
//! parameters (these included) are also handed to the worker's `init`.

use std::time::Duration;

use kiln_batchers::dynamic::{DynamicConfig, QueuePolicy, TimeoutAction};
use kiln_worker_sdk::{BatcherKind, Param, ParamScope, ParamSpec, ParamValue, Params};

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
    pub dynamic: DynamicConfig,
    /// The sequence batcher's settings (`batcher=sequence`).
    pub sequence: crate::sequence::SequenceParams,
}

/// Reads the dynamic batcher's settings (`dynamic_batching`, Triton's names);
/// `max_batch_size` and `allow_ragged` are the group's, set by [`crate::group::resolve`].
fn parse_dynamic(params: &[Param]) -> Result<DynamicConfig> {
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
    // A policy for a level that does not exist would be ignored: refuse it.
    for param in params {
        let key = param.key.as_str();
        let level = crate::sequence::strip_prefix_ignore_case(key, "priority_queue_policy.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|level| level.parse::<usize>().ok());
        if let Some(level) = level.filter(|l| !(1..=levels).contains(l)) {
            return Err(ServerError::invalid(format!(
                "parameter `{key}`: level {level} is not in 1..={levels} (`priority_levels`)"
            )));
        }
    }
    Ok(DynamicConfig {
        max_batch_size: 0,
        allow_ragged: false,
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

/// The load parameters the server reads, whatever the worker: the group's, the
/// dynamic batcher's, the sequence batcher's, and the repository's `model_dir`.
/// A `<placeholder>` segment stands for a name (`<level>`: a number).
const SERVER_PARAMETERS: &[&str] = &[
    "batch_size",
    "batcher",
    "batchers",
    "instances",
    "max_buffers",
    "queue_size",
    "share",
    "timeout",
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
];

/// Whether `key` takes a list: JSON's and TOML's `[4, 8]` arrive as the text `"4,8"`.
pub use kiln_protocol::params::takes_list;

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
            dynamic: parse_dynamic(params)?,
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
    use kiln_worker_sdk::{params_from_pairs, Param, ParamKind};

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
