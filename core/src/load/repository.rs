//! The model repository: a directory with one folder per model, each holding a
//! `config.toml` and numbered version folders with the model files.
//!
//! ```text
//! models/
//!   ocr-cls/
//!     config.toml      worker = "onnx"
//!                      [parameters]
//!                      batch_size = 32
//!     1/model.onnx
//! ```
//!
//! Loading a model passes its `[parameters]` (plus any overrides) to the worker, and
//! `model_dir`: the version's folder. Which versions are served side by side is
//! the model's `version_policy` (Triton's: the latest one by default; `{ latest =
//! N }`, `"all"`, `{ specific = [1, 3] }`); a load naming a version serves that
//! one alone.
//!
//! A model with `platform = "ensemble"` declares, instead of a worker, its inputs,
//! outputs and steps ([`crate::ensemble::config`]); it has no files, so its version
//! folders are optional (version 1 when there are none).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_worker_sdk::{Param, ParamValue};
use serde::Deserialize;

use crate::ensemble::config::{EnsembleConfig, EnsembleScheduling, TensorConfig};
use crate::error::{Result, ServerError};
use crate::load::plugin::check_name;
use crate::load::triton_config::folder;

pub(crate) mod resolved;
use crate::load::triton_config::map::VersionPolicy;
pub(crate) use resolved::{versions, worker_versions};
pub use resolved::{Resolved, Serving};

/// A model's `config.toml`: a worker and its parameters, or an ensemble.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The worker plugin serving the model.
    pub worker: Option<String>,
    /// Load-time parameters for the worker and its group.
    #[serde(default)]
    pub parameters: BTreeMap<String, toml::Value>,
    /// `"ensemble"` for an ensemble (Triton's platform); otherwise absent.
    pub platform: Option<String>,
    /// An ensemble's batch dimension (0: none).
    pub max_batch_size: Option<u32>,
    /// An ensemble's inputs.
    #[serde(default)]
    pub input: Vec<TensorConfig>,
    /// An ensemble's outputs.
    #[serde(default)]
    pub output: Vec<TensorConfig>,
    /// An ensemble's steps.
    pub ensemble_scheduling: Option<EnsembleScheduling>,
    /// Which version folders are served (Triton's `version_policy`).
    pub version_policy: Option<PolicyToml>,
}

/// `version_policy` in a `config.toml`: `{ latest = 2 }`, `"all"` or
/// `{ specific = [1, 3] }` (Triton's `latest { num_versions: 2 }`, `all {}`,
/// `specific { versions: [1, 3] }`).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyToml {
    Latest(std::num::NonZeroU32),
    All,
    Specific(Vec<u64>),
}

impl PolicyToml {
    fn policy(&self) -> VersionPolicy {
        match self {
            PolicyToml::Latest(n) => VersionPolicy::Latest(n.get()),
            PolicyToml::All => VersionPolicy::All,
            PolicyToml::Specific(list) => VersionPolicy::Specific(
                list.iter()
                    .map(|v| i64::try_from(*v).unwrap_or(i64::MAX))
                    .collect(),
            ),
        }
    }
}

/// A model as found in the repository.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub name: String,
    pub versions: Vec<u64>,
}

/// A model repository on disk.
#[derive(Debug, Clone)]
pub struct Repository {
    root: PathBuf,
    /// Triton's auto-completion of `config.pbtxt` models (on by default).
    auto_complete: bool,
}

impl Repository {
    /// The repository at `root`.
    pub fn new(root: PathBuf) -> Repository {
        Repository {
            root,
            auto_complete: true,
        }
    }

    /// `false`: Triton's `--disable-auto-complete-config`: a Triton model is
    /// its `config.pbtxt` alone, which then declares every tensor and the batch
    /// size ([`crate::load::triton_config::autocomplete`]).
    pub fn with_auto_complete(mut self, on: bool) -> Repository {
        self.auto_complete = on;
        self
    }

    /// The repository's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every model folder with a `config.toml`, sorted by name.
    pub fn index(&self) -> Result<Vec<Entry>> {
        let dir = std::fs::read_dir(&self.root).map_err(|e| {
            ServerError::Unavailable(format!("model repository {}: {e}", self.root.display()))
        })?;
        let mut entries: Vec<Entry> = dir
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.path().join("config.toml").is_file()
                    || folder::is_model(&e.path(), self.auto_complete)
            })
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .filter(|name| check_name(name).is_ok())
            .map(|name| {
                let versions = versions(&self.root.join(&name));
                Entry { name, versions }
            })
            .collect();
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }

    /// Reads model `name`'s config and picks `version` (the latest when `None`);
    /// `overrides` replace parameters of the same name.
    pub fn resolve(
        &self,
        name: &str,
        version: Option<u64>,
        overrides: Vec<Param>,
    ) -> Result<Resolved> {
        check_model_name(name)?;
        let folder = self.root.join(name);
        let file = folder.join("config.toml");
        if !file.is_file() && folder::is_model(&folder, self.auto_complete) {
            return folder::resolve(name, &folder, version, overrides, self.auto_complete);
        }
        let text = std::fs::read_to_string(&file).map_err(|_| {
            ServerError::NotFound(format!(
                "no model `{name}` in the model repository {}",
                self.root.display()
            ))
        })?;
        let config: ModelConfig = toml::from_str(&text)
            .map_err(|e| ServerError::invalid(format!("{}: {e}", file.display())))?;
        let invalid = |m: String| ServerError::invalid(format!("{}: {m}", file.display()));
        let (worker, platform) = (config.worker.clone(), config.platform.clone());
        let policy = config.version_policy.as_ref().map(PolicyToml::policy);
        let worker = match (worker.as_deref(), platform.as_deref()) {
            (None, Some("ensemble")) => {
                let ensemble = ensemble_config(config).map_err(invalid)?;
                if !overrides.is_empty() {
                    return Err(ServerError::invalid(format!(
                        "model `{name}` is an ensemble: it takes no parameters"
                    )));
                }
                let available = versions(&folder);
                let version = match version {
                    None => available.last().copied().unwrap_or(1),
                    Some(v) if available.contains(&v) || (available.is_empty() && v == 1) => v,
                    Some(v) => {
                        return Err(ServerError::NotFound(format!(
                            "model `{name}` has no version {v}"
                        )))
                    }
                };
                return Ok(Resolved {
                    worker: "ensemble".into(),
                    version,
                    params: Vec::new(),
                    versions: vec![(version, Vec::new())],
                    serving: Serving::Ensemble(ensemble),
                    declared: None,
                    triton: None,
                    warmup: Vec::new(),
                });
            }
            (Some(worker), None) => {
                if config.max_batch_size.is_some()
                    || !config.input.is_empty()
                    || !config.output.is_empty()
                    || config.ensemble_scheduling.is_some()
                {
                    return Err(invalid(
                        "`max_batch_size`, `input`, `output` and `ensemble_scheduling` are an \
                         ensemble's (platform = \"ensemble\"); a worker declares its own tensors"
                            .into(),
                    ));
                }
                worker.to_ascii_lowercase()
            }
            (None, None) => {
                return Err(invalid(
                    "set `worker` (the plugin serving the model) or `platform = \"ensemble\"`"
                        .into(),
                ))
            }
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "`worker` and `platform` exclude each other: a model is served by a worker \
                     or is an ensemble"
                        .into(),
                ))
            }
            (None, Some(other)) => {
                return Err(invalid(format!(
                    "platform `{other}` is not known (kiln's is `ensemble`; a worker's model sets `worker`)"
                )))
            }
        };
        let mut params = Vec::with_capacity(config.parameters.len() + 1);
        for (key, value) in flatten(&config.parameters) {
            params.push(Param {
                key: key.as_str().into(),
                value: param_value(&key, value).ok_or_else(|| {
                    ServerError::invalid(format!(
                        "{}: parameters.{key} must be a boolean, integer, float or string \
                         (or, for a list parameter, a list of integers or strings)",
                        file.display()
                    ))
                })?,
            });
        }
        let available = versions(&folder);
        let chosen = match version {
            // A load naming a version serves that folder alone.
            Some(v) if available.contains(&v) => vec![v],
            Some(v) => {
                return Err(ServerError::NotFound(format!(
                    "model `{name}` has no version {v} (versions: {available:?})"
                )))
            }
            None if available.is_empty() => {
                return Err(ServerError::invalid(format!(
                    "model `{name}` has no numbered version folder in {}",
                    folder.display()
                )))
            }
            None => policy
                .unwrap_or(VersionPolicy::Latest(1))
                .allowed(&available),
        };
        worker_versions(name, worker, &params, overrides, &folder, &chosen, None)
    }
}

/// A model's name is its folder's: lower-case letters, digits, `-` and `_`
/// (nothing that can leave the repository).
pub fn check_model_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(ServerError::invalid("the request names no model"));
    }
    check_name(name).map_err(|_| {
        ServerError::invalid(format!(
            "invalid model name `{name}`: use lower-case letters, digits, `-` and `_`"
        ))
    })
}

/// An ensemble's declarations; it has no worker and no parameters.
fn ensemble_config(config: ModelConfig) -> std::result::Result<EnsembleConfig, String> {
    if !config.parameters.is_empty() {
        return Err("an ensemble takes no `[parameters]`".into());
    }
    let scheduling = config
        .ensemble_scheduling
        .ok_or("an ensemble declares its steps in `ensemble_scheduling.step`")?;
    Ok(EnsembleConfig {
        max_batch_size: config.max_batch_size.unwrap_or(0),
        inputs: config.input,
        outputs: config.output,
        steps: scheduling.step,
    })
}

/// The parameters with nested tables flattened to dotted keys: TOML's
/// `control.start = "START"` (or a `[parameters.control]` table) is the parameter
/// `control.start`.
fn flatten<'a>(
    table: impl IntoIterator<Item = (&'a String, &'a toml::Value)>,
) -> Vec<(String, &'a toml::Value)> {
    let mut out = Vec::new();
    for (key, value) in table {
        match value {
            toml::Value::Table(inner) => {
                for (k, v) in flatten(inner) {
                    out.push((format!("{key}.{k}"), v));
                }
            }
            other => out.push((key.clone(), other)),
        }
    }
    out
}

fn param_value(key: &str, value: &toml::Value) -> Option<ParamValue> {
    Some(match value {
        toml::Value::Boolean(b) => ParamValue::Bool(*b),
        toml::Value::Integer(i) => ParamValue::Int(*i),
        toml::Value::Float(f) => ParamValue::Float(*f),
        toml::Value::String(s) => ParamValue::Str(s.as_str().into()),
        // A list parameter's `[4, 8]` is its comma-separated text.
        toml::Value::Array(items) if crate::params::takes_list(key) => ParamValue::Str(
            items
                .iter()
                .map(|item| match item {
                    toml::Value::Integer(i) => Some(i.to_string()),
                    toml::Value::String(s) => Some(s.clone()),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?
                .join(",")
                .into(),
        ),
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
