//! The parameters of a request the server itself reads, each read in one place:
//! an inference request's `priority`, `timeout` and sequence (`sequence_id`,
//! `sequence_start`, `sequence_end`), found in one pass at admission
//! ([`RequestParams`]); a repository load's or unload's `version`
//! ([`take_version`]). Other request parameters are the worker's (checked by its
//! [`RequestRules`](super::RequestRules)).

use std::time::Duration;

use kiln_batchers::sequence::{SequenceFlags, SequenceId};
use kiln_worker_sdk::{coerce, Param, ParamValue, Params};

use crate::error::{Result, ServerError};

/// An inference request's scheduling and sequence parameters.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestParams<'a> {
    /// `priority`: the level, 1 highest (0 or absent: the model's default).
    pub priority: Option<u32>,
    /// `timeout`: how long the request may wait in the queue (microseconds,
    /// Triton's unit).
    pub timeout: Option<Duration>,
    /// The sequence parameters, checked only for a stateful model
    /// ([`SequenceRequest::flags`]): another model ignores them.
    pub sequence: SequenceRequest<'a>,
}

/// A request's sequence parameters as given.
#[derive(Debug, Clone, Copy, Default)]
pub struct SequenceRequest<'a> {
    id: Option<&'a ParamValue>,
    start: Option<&'a ParamValue>,
    end: Option<&'a ParamValue>,
}

/// The names, matched without regard to case; the first of a repeated key counts
/// (as [`Params::get`] reads it).
const PRIORITY: &str = "priority";
const TIMEOUT: &str = "timeout";
const SEQUENCE_ID: &str = "sequence_id";
const SEQUENCE_START: &str = "sequence_start";
const SEQUENCE_END: &str = "sequence_end";

impl<'a> RequestParams<'a> {
    /// Reads `parameters` in one pass (nothing allocated unless a value is bad);
    /// a bad `priority` or `timeout` fails the request.
    pub fn parse(parameters: &'a [Param]) -> Result<RequestParams<'a>> {
        let (mut priority, mut timeout) = (None, None);
        let mut sequence = SequenceRequest::default();
        for p in parameters {
            let key = p.key.as_str();
            let slot = if key.eq_ignore_ascii_case(PRIORITY) {
                &mut priority
            } else if key.eq_ignore_ascii_case(TIMEOUT) {
                &mut timeout
            } else if key.eq_ignore_ascii_case(SEQUENCE_ID) {
                &mut sequence.id
            } else if key.eq_ignore_ascii_case(SEQUENCE_START) {
                &mut sequence.start
            } else if key.eq_ignore_ascii_case(SEQUENCE_END) {
                &mut sequence.end
            } else {
                continue;
            };
            slot.get_or_insert(&p.value);
        }
        let int = |key, value: Option<&ParamValue>| {
            value
                .map(|v| coerce::int(key, v))
                .transpose()
                .map_err(|e| ServerError::InvalidRequest(e.to_string()))
        };
        let priority = match int(PRIORITY, priority)? {
            None => None,
            Some(v) => Some(u32::try_from(v).map_err(|_| {
                ServerError::invalid(format!("parameter `priority` must be a level ≥ 0, got {v}"))
            })?),
        };
        let timeout = match int(TIMEOUT, timeout)? {
            None => None,
            Some(v) => Some(Duration::from_micros(u64::try_from(v).map_err(|_| {
                ServerError::invalid(format!("parameter `timeout` (µs) must be ≥ 0, got {v}"))
            })?)),
        };
        Ok(RequestParams {
            priority,
            timeout,
            sequence,
        })
    }
}

impl<'a> SequenceRequest<'a> {
    /// Reads the sequence parameters alone (a server that stops lets a
    /// sequence's continuation through: `Server::refuse_if_stopping`).
    pub fn read(parameters: &'a [Param]) -> SequenceRequest<'a> {
        let p = Params(parameters);
        SequenceRequest {
            id: p.get(SEQUENCE_ID),
            start: p.get(SEQUENCE_START),
            end: p.get(SEQUENCE_END),
        }
    }

    /// The flags of a request to stateful `model`: a `sequence_id` (uint64 or
    /// string) is required, `sequence_start` and `sequence_end` default to false.
    pub fn flags(&self, model: &str) -> Result<SequenceFlags> {
        let id = match self.id {
            None => None,
            Some(ParamValue::Int(v)) if *v > 0 => Some(SequenceId::Number(v.unsigned_abs())),
            Some(ParamValue::Uint(v)) => Some(SequenceId::Number(*v)),
            Some(ParamValue::Str(s)) if !s.is_empty() => Some(SequenceId::Text(s.to_string())),
            Some(other) => {
                return Err(ServerError::invalid(format!(
                    "parameter `sequence_id` must be a positive integer or a non-empty string, \
                     got {other}"
                )))
            }
        };
        let id = id.ok_or_else(|| {
            ServerError::invalid(format!(
                "model `{model}` is stateful: each request needs a `sequence_id` parameter"
            ))
        })?;
        let flag = |key, value: Option<&ParamValue>| -> Result<bool> {
            match value {
                None => Ok(false),
                Some(v) => {
                    coerce::bool(key, v).map_err(|e| ServerError::InvalidRequest(e.to_string()))
                }
            }
        };
        Ok(SequenceFlags::new(
            id,
            flag(SEQUENCE_START, self.start)?,
            flag(SEQUENCE_END, self.end)?,
        ))
    }
}

/// Takes the `version` parameter of a repository load or unload out of `params`:
/// the version to load (or unload), if given. The rest are the load's parameters.
pub fn take_version(params: &mut Vec<Param>) -> Result<Option<u64>> {
    let Some(i) = params
        .iter()
        .position(|p| p.key.as_str().eq_ignore_ascii_case("version"))
    else {
        return Ok(None);
    };
    let p = params.remove(i);
    coerce::int("version", &p.value)
        .ok()
        .and_then(|v| u64::try_from(v).ok())
        .map(Some)
        .ok_or_else(|| ServerError::invalid("`version` must be a non-negative integer"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::params_from_pairs;

    fn param(key: &str, value: ParamValue) -> Param {
        Param {
            key: key.into(),
            value,
        }
    }

    #[test]
    fn scheduling_parameters_are_read_and_checked() {
        let params =
            params_from_pairs(&[("Priority", "2"), ("timeout", "1500"), ("priority", "9")]);
        let p = RequestParams::parse(&params).unwrap();
        assert_eq!(p.priority, Some(2), "the first of a repeated key");
        assert_eq!(p.timeout, Some(Duration::from_micros(1500)));
        let none = RequestParams::parse(&[]).unwrap();
        assert_eq!((none.priority, none.timeout), (None, None));
        for (pair, want) in [
            (
                ("priority", "-1"),
                "parameter `priority` must be a level ≥ 0, got -1",
            ),
            (
                ("timeout", "-5"),
                "parameter `timeout` (µs) must be ≥ 0, got -5",
            ),
            (
                ("timeout", "soon"),
                "parameter `timeout` must be an integer, got `soon`",
            ),
        ] {
            let e = RequestParams::parse(&params_from_pairs(&[pair])).unwrap_err();
            assert!(matches!(e, ServerError::InvalidRequest(_)), "{e:?}");
            assert!(e.to_string().contains(want), "{e}");
        }
        // A model that is not stateful ignores a bad sequence parameter.
        let odd = params_from_pairs(&[("sequence_start", "maybe")]);
        assert!(RequestParams::parse(&odd).is_ok());
    }

    #[test]
    fn request_flags_read_ids_of_both_kinds() {
        let flags = |params: &[Param]| RequestParams::parse(params).unwrap().sequence.flags("m");
        let f = flags(&params_from_pairs(&[("sequence_id", "abc")])).unwrap();
        assert_eq!(f.id, SequenceId::Text("abc".into()));
        let typed = vec![
            param("sequence_id", ParamValue::Int(9)),
            param("sequence_start", ParamValue::Bool(true)),
        ];
        let f = flags(&typed).unwrap();
        assert_eq!((f.id, f.start, f.end), (SequenceId::Number(9), true, false));
        assert!(flags(&[]).is_err());
        assert!(flags(&[param("sequence_id", ParamValue::Int(0))]).is_err());
        let big = flags(&[param("sequence_id", ParamValue::Uint(u64::MAX))]).unwrap();
        assert_eq!(big.id, SequenceId::Number(u64::MAX));
        let e = flags(&params_from_pairs(&[
            ("sequence_id", "a"),
            ("sequence_end", "x"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("`sequence_end` must be a boolean"), "{e}");
        // Read alone, as while stopping: the same flags.
        let f = SequenceRequest::read(&typed).flags("m").unwrap();
        assert!(f.start);
    }

    #[test]
    fn version_parameter_is_taken_out() {
        let mut params = vec![
            param("batch_size", ParamValue::Int(4)),
            param("Version", ParamValue::Str("2".into())),
        ];
        assert_eq!(take_version(&mut params).unwrap(), Some(2));
        assert_eq!(params.len(), 1);
        assert_eq!(take_version(&mut params).unwrap(), None);
        for bad in [ParamValue::Int(-1), ParamValue::Str("x".into())] {
            let mut params = vec![param("version", bad)];
            assert!(take_version(&mut params).is_err());
        }
    }
}
