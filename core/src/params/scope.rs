//! Who may set a worker's parameters, and the rules for the request parameters
//! it declares, checked at admission. Both come from the worker's static declarations
//! ([`kiln_worker_sdk::Worker::PARAMETERS`]), which the server reads from the
//! plugin's root module before any instance is created: a parameter a client may
//! not set never reaches the worker's `init`.

use kiln_worker_sdk::{Param, ParamScope, ParamSpec, Params};

use crate::error::{Result, ServerError};

/// Where a load's parameters come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The operator: `--load`, `--load-model`, a repository's `config.toml`, or
    /// the embedding program.
    Operator,
    /// A client of the load APIs (REST worker load, REST and gRPC repository load).
    Client,
}

/// Parameters only the operator sets, whatever the worker: the model repository
/// names the model's folder.
pub(super) const OPERATOR_ONLY: &[&str] = &["model_dir"];

/// Refuses the first of `client_keys` (parameters a client set) that `worker`
/// declares operator-only, naming it.
pub fn check_client_keys(worker: &str, specs: &[ParamSpec], client_keys: &[String]) -> Result<()> {
    let reserved = specs
        .iter()
        .filter(|s| s.scope == ParamScope::Operator)
        .map(ParamSpec::name)
        .chain(OPERATOR_ONLY.iter().copied());
    for name in reserved {
        if let Some(key) = client_keys.iter().find(|k| k.eq_ignore_ascii_case(name)) {
            return Err(ServerError::invalid(format!(
                "parameter `{key}` of worker `{worker}` may only be set by the operator \
                 (--load, --load-model or the model's config.toml), not by a load request"
            )));
        }
    }
    Ok(())
}

/// The parameter names of a load: every one from a client, none from the operator.
pub fn client_keys(origin: Origin, params: &[Param]) -> Vec<String> {
    match origin {
        Origin::Operator => Vec::new(),
        Origin::Client => params.iter().map(|p| p.key.to_string()).collect(),
    }
}

/// The request parameters a group checks at admission (HTTP 400, gRPC
/// INVALID_ARGUMENT for a bad value), before the request is queued with others.
#[derive(Debug, Clone, Default)]
pub struct RequestRules {
    specs: Vec<ParamSpec>,
}

impl RequestRules {
    /// The request-scoped declarations among `specs`.
    pub fn new(specs: &[ParamSpec]) -> RequestRules {
        RequestRules {
            specs: specs
                .iter()
                .filter(|s| s.scope == ParamScope::Request)
                .copied()
                .collect(),
        }
    }

    /// Checks a request's parameters against the declarations (nothing to do, and
    /// nothing allocated, when there are none or the request sets none).
    pub fn check(&self, params: &[Param]) -> Result<()> {
        if params.is_empty() {
            return Ok(());
        }
        for spec in &self.specs {
            spec.check(Params(params))
                .map_err(ServerError::InvalidRequest)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::{params_from_pairs, ParamKind};

    const SPECS: &[ParamSpec] = &[
        ParamSpec::operator("runtime"),
        ParamSpec::load("threads", ParamKind::Int { min: 1, max: 8 }),
        ParamSpec::request("increment", ParamKind::Int { min: 0, max: 9 }),
    ];

    #[test]
    fn clients_cannot_set_operator_parameters() {
        let params = params_from_pairs(&[("threads", "2"), ("RUNTIME", "/tmp/x.so")]);
        let err = check_client_keys("w", SPECS, &client_keys(Origin::Client, &params)).unwrap_err();
        // HTTP 400 (`http/error.rs`).
        assert!(matches!(err, ServerError::InvalidRequest(_)), "{err:?}");
        assert!(err.to_string().contains("`RUNTIME`"), "{err}");
        assert!(check_client_keys("w", SPECS, &client_keys(Origin::Operator, &params)).is_ok());
        let dir = params_from_pairs(&[("model_dir", "/etc")]);
        assert!(check_client_keys("w", &[], &client_keys(Origin::Client, &dir)).is_err());
        let fine = params_from_pairs(&[("threads", "2"), ("batch_size", "4")]);
        assert!(check_client_keys("w", SPECS, &client_keys(Origin::Client, &fine)).is_ok());
    }

    #[test]
    fn request_values_are_checked() {
        let rules = RequestRules::new(SPECS);
        assert!(rules
            .check(&params_from_pairs(&[("increment", "3")]))
            .is_ok());
        assert!(rules.check(&[]).is_ok());
        let err = rules
            .check(&params_from_pairs(&[("increment", "10")]))
            .unwrap_err();
        // gRPC INVALID_ARGUMENT (`grpc/status.rs`).
        assert!(matches!(err, ServerError::InvalidRequest(_)), "{err:?}");
        assert!(err.to_string().contains("`increment`"), "{err}");
        // Load-time declarations are not request rules.
        assert!(rules
            .check(&params_from_pairs(&[("threads", "99")]))
            .is_ok());
    }
}
