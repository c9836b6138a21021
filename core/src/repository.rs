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
//! `model_dir`: the chosen version's folder. The latest version is the default.
//!
//! A model with `platform = "ensemble"` declares, instead of a worker, its inputs,
//! outputs and steps ([`crate::ensemble::config`]); it has no files, so its version
//! folders are optional (version 1 when there are none).
//!
//! A folder without `config.toml` is read as Triton's ([`crate::triton_config::folder`]):
//! its `config.pbtxt`, or, auto-completed, none at all beside `1/model.onnx`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_worker_sdk::{Param, ParamValue};
use serde::Deserialize;

use crate::ensemble::config::{EnsembleConfig, EnsembleScheduling, TensorConfig};
use crate::error::{Result, ServerError};
use crate::plugin::check_name;
use crate::triton_config::folder;
use crate::triton_config::map::Declared;

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
}

/// What a repository model is served by.
#[derive(Debug, Clone, PartialEq)]
pub enum Serving {
    /// A worker (its name in [`Resolved::worker`], its parameters in
    /// [`Resolved::params`]).
    Worker,
    /// An ensemble of loaded models.
    Ensemble(EnsembleConfig),
}

/// A model as found in the repository.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub name: String,
    pub versions: Vec<u64>,
}

/// What loading a model needs.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The worker (`ensemble` for an ensemble).
    pub worker: String,
    pub version: u64,
    pub params: Vec<Param>,
    pub serving: Serving,
    /// The tensors a `config.pbtxt` declares, checked once the model is loaded.
    pub declared: Option<Declared>,
}

/// A model repository on disk.
#[derive(Debug, Clone)]
pub struct Repository {
    root: PathBuf,
    /// Triton's auto-completion of `config.pbtxt` models (on by default).
    auto_complete: bool,
}

impl Repository {
    /// The repository at `root`, auto-completing Triton models.
    pub fn new(root: PathBuf) -> Repository {
        Repository {
            root,
            auto_complete: true,
        }
    }

    /// `false`: Triton's `--disable-auto-complete-config`: a Triton model is
    /// its `config.pbtxt` alone, which then declares every tensor and the batch
    /// size ([`crate::triton_config::complete`]).
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
        check_name(name)?;
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
                    serving: Serving::Ensemble(ensemble),
                    declared: None,
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
        let version = match version {
            Some(v) if available.contains(&v) => v,
            Some(v) => {
                return Err(ServerError::NotFound(format!(
                    "model `{name}` has no version {v} (versions: {available:?})"
                )))
            }
            None => *available.last().ok_or_else(|| {
                ServerError::invalid(format!(
                    "model `{name}` has no numbered version folder in {}",
                    folder.display()
                ))
            })?,
        };
        with_overrides(&mut params, overrides, &folder, version);
        Ok(Resolved {
            worker,
            version,
            params,
            serving: Serving::Worker,
            declared: None,
        })
    }
}

/// `overrides` replace the parameters of the same name; `model_dir` is the
/// version's folder, whatever a file or client said.
pub(crate) fn with_overrides(
    params: &mut Vec<Param>,
    overrides: Vec<Param>,
    folder: &Path,
    version: u64,
) {
    for o in overrides {
        params.retain(|p| !p.key.as_str().eq_ignore_ascii_case(o.key.as_str()));
        params.push(o);
    }
    params.retain(|p| !p.key.as_str().eq_ignore_ascii_case("model_dir"));
    params.push(Param {
        key: "model_dir".into(),
        value: ParamValue::Str(
            folder
                .join(version.to_string())
                .to_string_lossy()
                .as_ref()
                .into(),
        ),
    });
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

/// Numbered subfolders, ascending.
pub(crate) fn versions(folder: &Path) -> Vec<u64> {
    let mut versions: Vec<u64> = std::fs::read_dir(folder)
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter(|e| e.path().is_dir())
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
                .collect()
        })
        .unwrap_or_default();
    versions.sort_unstable();
    versions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(files: &[(&str, &str)]) -> (Repository, PathBuf) {
        let root = std::env::temp_dir().join(format!(
            "kiln-repo-{}-{}",
            std::process::id(),
            files.len() + files.first().map_or(0, |f| f.1.len())
        ));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        (Repository::new(root.clone()), root)
    }

    #[test]
    fn resolves_latest_version_and_overrides() {
        let (r, root) = repo(&[
            (
                "m/config.toml",
                "worker = \"echo\"\n[parameters]\nbatch_size = 4\nscale = 1.5\n",
            ),
            ("m/1/model.onnx", ""),
            ("m/3/model.onnx", ""),
            ("other/readme", ""),
        ]);
        assert_eq!(
            r.index().unwrap(),
            vec![Entry {
                name: "m".into(),
                versions: vec![1, 3]
            }]
        );
        let m = r
            .resolve(
                "m",
                None,
                vec![Param {
                    key: "batch_size".into(),
                    value: ParamValue::Int(8),
                }],
            )
            .unwrap();
        assert_eq!((m.worker.as_str(), m.version), ("echo", 3));
        let p = kiln_worker_sdk::Params(&m.params);
        assert_eq!(p.int("batch_size").unwrap(), Some(8));
        assert_eq!(p.float("scale").unwrap(), Some(1.5));
        assert!(p.string("model_dir").unwrap().ends_with("m/3"));
        assert_eq!(r.resolve("m", Some(1), vec![]).unwrap().version, 1);
        assert!(matches!(
            r.resolve("m", Some(2), vec![]),
            Err(ServerError::NotFound(_))
        ));
        assert!(matches!(
            r.resolve("nope", None, vec![]),
            Err(ServerError::NotFound(_))
        ));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn nested_tables_and_quoted_keys_are_dotted_parameters() {
        let (r, root) = repo(&[
            (
                "s/config.toml",
                "worker = \"accumulate\"\n[parameters]\n\"input.sr\" = 16000\n\
                 control.start = \"START\"\n[parameters.state]\nSTATE = \"STATE_OUT\"\n",
            ),
            ("s/1/x", ""),
        ]);
        let m = r.resolve("s", None, vec![]).unwrap();
        let p = kiln_worker_sdk::Params(&m.params);
        assert_eq!(p.int("input.sr").unwrap(), Some(16000));
        assert_eq!(p.string("control.start").as_deref(), Some("START"));
        assert_eq!(p.string("state.STATE").as_deref(), Some("STATE_OUT"));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn lists_are_comma_separated_text() {
        let (r, root) = repo(&[
            (
                "l/config.toml",
                "worker = \"echo\"\n[parameters]\npreferred_batch_size = [4, \"8\"]\n",
            ),
            ("l/1/x", ""),
        ]);
        let m = r.resolve("l", None, vec![]).unwrap();
        let p = kiln_worker_sdk::Params(&m.params);
        assert_eq!(p.string("preferred_batch_size").as_deref(), Some("4,8"));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn invalid_config_names_file_and_field() {
        let (r, root) = repo(&[
            ("bad/config.toml", "worker = \"echo\"\nbatchsize = 4\n"),
            ("bad/1/x", ""),
            (
                "arr/config.toml",
                "worker = \"echo\"\n[parameters]\nsizes = [1, 2]\n",
            ),
            ("arr/1/x", ""),
        ]);
        let e = r.resolve("bad", None, vec![]).unwrap_err().to_string();
        assert!(
            e.contains("bad/config.toml") && e.contains("batchsize"),
            "{e}"
        );
        let e = r.resolve("arr", None, vec![]).unwrap_err().to_string();
        assert!(
            e.contains("arr/config.toml") && e.contains("parameters.sizes"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn an_ensemble_declares_steps_instead_of_a_worker() {
        let ensemble = "platform = \"ensemble\"\nmax_batch_size = 4\n\
             input = [{ name = \"IN\", data_type = \"TYPE_STRING\", dims = [-1] }]\n\
             output = [{ name = \"OUT\", data_type = \"UINT32\", dims = [2] }]\n\
             [[ensemble_scheduling.step]]\nmodel_name = \"m\"\nmodel_version = 3\n\
             input_map = { INPUT0 = \"IN\" }\noutput_map = { OUTPUT0 = \"OUT\" }\n";
        let (r, root) = repo(&[
            ("e/config.toml", ensemble),
            (
                "both/config.toml",
                "worker = \"echo\"\nplatform = \"ensemble\"\n",
            ),
            ("neither/config.toml", "[parameters]\nx = 1\n"),
            ("tensors/config.toml", "worker = \"echo\"\nmax_batch_size = 4\n"),
            ("other/config.toml", "platform = \"onnxruntime_onnx\"\n"),
            (
                "dtype/config.toml",
                "platform = \"ensemble\"\ninput = [{ name = \"A\", data_type = \"TYPE_FLOAT\", dims = [] }]\n",
            ),
        ]);
        let e = r.resolve("e", None, vec![]).unwrap();
        // No version folder: version 1.
        assert_eq!((e.worker.as_str(), e.version), ("ensemble", 1));
        let Serving::Ensemble(config) = e.serving else {
            panic!("not an ensemble");
        };
        assert_eq!(config.max_batch_size, 4);
        assert_eq!(config.inputs[0].data_type, kiln_worker_sdk::DataType::Bytes);
        assert_eq!(config.outputs[0].dims, vec![2]);
        assert_eq!(config.steps[0].model_version, 3);
        assert_eq!(config.steps[0].input_map["INPUT0"], "IN");
        let overridden = vec![Param {
            key: "batch_size".into(),
            value: ParamValue::Int(8),
        }];
        assert!(r.resolve("e", None, overridden).is_err());
        for (name, wanted) in [
            ("both", "exclude each other"),
            ("neither", "set `worker`"),
            ("tensors", "an ensemble's"),
            ("other", "platform `onnxruntime_onnx` is not known"),
            ("dtype", "unknown data_type `TYPE_FLOAT`"),
        ] {
            let e = r.resolve(name, None, vec![]).unwrap_err().to_string();
            assert!(
                e.contains(wanted) && e.contains("config.toml"),
                "{name}: {e}"
            );
        }
        let _ = std::fs::remove_dir_all(root);
    }
}
