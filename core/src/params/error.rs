//! The errors of reading parameters, by stage: a value of the wrong type
//! ([`ValueError`]), a setting out of its range ([`SettingError`]), a key nobody
//! knows ([`ParamError`]). Each is a client's mistake: HTTP 400, gRPC
//! INVALID_ARGUMENT ([`ServerError::InvalidRequest`]).

use std::fmt;

use kiln_worker_sdk::CoerceError;
use serde::de;

use crate::error::ServerError;

/// A parameter whose value does not have the type its setting takes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValueError {
    /// Not the integer, boolean or number the setting takes.
    #[error(transparent)]
    Coerce(#[from] CoerceError),
    /// Not one of an enum's variants.
    #[error("parameter `{key}` must be {}, got `{got}`", one_of(allowed))]
    NotOneOf {
        key: String,
        allowed: &'static [&'static str],
        got: String,
    },
    /// An element of a list (`preferred_batch_size`) is not an integer.
    #[error("parameter `{key}` must be positive sizes, got `{got}`")]
    NotSizes { key: String, got: String },
    /// A key that goes deeper than its setting (`batch_size.x`).
    #[error("parameter `{key}` takes no `.` segments after `{path}`")]
    TooDeep { key: String, path: String },
    /// A key no field takes, in a type with no [`Rest`](super::Rest) field for it.
    #[error("unknown parameter `{key}`")]
    Unknown { key: String },
    /// Anything else serde reports (a settings type that does not fit this format).
    #[error("{0}")]
    Other(String),
}

impl de::Error for ValueError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        ValueError::Other(msg.to_string())
    }
}

/// `` `a`, `b` or `c` ``.
fn one_of(allowed: &[&str]) -> String {
    let quoted: Vec<String> = allowed.iter().map(|a| format!("`{a}`")).collect();
    match quoted.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
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
