//! Parameter declarations: what a worker says about its parameters before any
//! instance exists (the server reads them before `init`), so that it can refuse a
//! parameter a client may not set, and check request parameters at admission.

use std::fmt;

use abi_stable::std_types::RStr;
use abi_stable::StableAbi;

use crate::types::Params;

/// The parameter the server always passes to `init`: the number of instances the
/// group starts with (the `instances` load parameter, 1 unless set). A worker
/// that sizes a thread pool by the machine divides it among them.
pub const INSTANCES_PARAM: &str = "instances";

/// Who may set a parameter, and when.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamScope {
    /// A load-time parameter anyone who may load the worker may set.
    Load,
    /// A load-time parameter only the operator may set (`--load`, a repository's
    /// `config.toml`): anything that names a file, folder, library or host. The
    /// server refuses it from a client (HTTP 400, gRPC INVALID_ARGUMENT) before the
    /// worker's `init` runs.
    Operator,
    /// A parameter of each inference request; the server checks its value at
    /// admission, before the request is queued.
    Request,
}

/// The values a parameter takes (the coercions of [`Params`]' getters apply: a
/// string that parses as the type is accepted, as a CLI gives strings).
#[repr(C, u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq)]
pub enum ParamKind {
    /// Any value.
    Any,
    /// A boolean ([`Params::bool`]).
    Bool,
    /// An integer in `min..=max` ([`Params::int`]).
    Int { min: i64, max: i64 },
    /// A number in `min..=max` ([`Params::float`]).
    Float { min: f64, max: f64 },
}

/// One declared parameter. Build them in a `const` with [`ParamSpec::load`],
/// [`ParamSpec::operator`] and [`ParamSpec::request`]. A name ending in `.*`
/// declares a family (`batch_axis.*`: `batch_axis.<anything>`). The server refuses
/// a load parameter that neither it nor the worker declares.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, PartialEq)]
pub struct ParamSpec {
    /// The parameter's name (matched case-insensitively, as [`Params::get`] does).
    pub name: RStr<'static>,
    pub scope: ParamScope,
    pub kind: ParamKind,
}

impl ParamSpec {
    /// A load-time parameter any loader may set.
    pub const fn load(name: &'static str, kind: ParamKind) -> ParamSpec {
        ParamSpec {
            name: RStr::from_str(name),
            scope: ParamScope::Load,
            kind,
        }
    }

    /// A load-time parameter only the operator may set.
    pub const fn operator(name: &'static str) -> ParamSpec {
        ParamSpec {
            name: RStr::from_str(name),
            scope: ParamScope::Operator,
            kind: ParamKind::Any,
        }
    }

    /// A per-request parameter whose value the server checks at admission.
    pub const fn request(name: &'static str, kind: ParamKind) -> ParamSpec {
        ParamSpec {
            name: RStr::from_str(name),
            scope: ParamScope::Request,
            kind,
        }
    }

    /// The name.
    pub fn name(&self) -> &'static str {
        self.name.as_str()
    }

    /// Whether `key` is this parameter (or one of its family), ignoring case.
    pub fn matches(&self, key: &str) -> bool {
        let name = self.name();
        match name.strip_suffix('*') {
            Some(prefix) => {
                key.len() > prefix.len()
                    && key.is_char_boundary(prefix.len())
                    && key[..prefix.len()].eq_ignore_ascii_case(prefix)
            }
            None => key.eq_ignore_ascii_case(name),
        }
    }

    /// Checks this parameter's value in `params` (absent is fine); the error names it.
    pub fn check(&self, params: Params<'_>) -> Result<(), String> {
        if self.name().ends_with('*') {
            return params
                .0
                .iter()
                .filter(|p| self.matches(p.key.as_str()))
                .try_for_each(|p| self.check_one(p.key.as_str(), Params(std::slice::from_ref(p))));
        }
        self.check_one(self.name(), params)
    }

    fn check_one(&self, name: &str, params: Params<'_>) -> Result<(), String> {
        match self.kind {
            ParamKind::Any => Ok(()),
            ParamKind::Bool => params.bool(name).map(drop),
            ParamKind::Int { min, max } => match params.int(name)? {
                Some(v) if v < min || v > max => Err(format!(
                    "parameter `{name}` must be in {min}..={max}, got {v}"
                )),
                _ => Ok(()),
            },
            ParamKind::Float { min, max } => match params.float(name)? {
                Some(v) if !(min..=max).contains(&v) => Err(format!(
                    "parameter `{name}` must be in {min}..={max}, got {v}"
                )),
                _ => Ok(()),
            },
        }
    }
}

impl fmt::Debug for ParamSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParamSpec")
            .field("name", &self.name())
            .field("scope", &self.scope)
            .field("kind", &self.kind)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{params_from_pairs, Param, ParamValue};

    #[test]
    fn checks_values_by_kind() {
        let spec = ParamSpec::request(
            "increment",
            ParamKind::Int {
                min: 0,
                max: u32::MAX as i64,
            },
        );
        let ok = params_from_pairs(&[("Increment", "7")]);
        assert!(spec.check(Params(&ok)).is_ok());
        assert!(spec.check(Params(&[])).is_ok());
        let negative = [Param {
            key: "increment".into(),
            value: ParamValue::Int(-1),
        }];
        let err = spec.check(Params(&negative)).unwrap_err();
        assert!(err.contains("`increment`") && err.contains("-1"), "{err}");
        let text = params_from_pairs(&[("increment", "x")]);
        assert!(spec
            .check(Params(&text))
            .unwrap_err()
            .contains("`increment`"));
        let flag = ParamSpec::load("fail_init", ParamKind::Bool);
        assert!(flag
            .check(Params(&params_from_pairs(&[("fail_init", "maybe")])))
            .is_err());
        let any = ParamSpec::operator("runtime");
        assert!(any
            .check(Params(&params_from_pairs(&[("runtime", "/x")])))
            .is_ok());
        let float = ParamSpec::request("scale", ParamKind::Float { min: 0.0, max: 2.0 });
        assert!(float
            .check(Params(&params_from_pairs(&[("scale", "3")])))
            .is_err());
    }

    #[test]
    fn families_match_by_prefix() {
        let family = ParamSpec::load("batch_axis.*", ParamKind::Int { min: 0, max: 8 });
        assert!(family.matches("BATCH_AXIS.state") && !family.matches("batch_axis."));
        assert!(!family.matches("batch_axi") && !family.matches("batch_axisx"));
        let fine = params_from_pairs(&[("batch_axis.a", "1")]);
        assert!(family.check(Params(&fine)).is_ok());
        let bad = params_from_pairs(&[("batch_axis.b", "9")]);
        assert!(family
            .check(Params(&bad))
            .unwrap_err()
            .contains("`batch_axis.b`"));
        assert!(ParamSpec::load("x", ParamKind::Any).matches("X"));
    }
}
