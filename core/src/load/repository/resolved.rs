//! What loading a repository model needs ([`Resolved`]), built from a folder's
//! `config.toml` (`repository.rs`) or `config.pbtxt` (`triton_config::folder`):
//! a leaf both use, so neither imports the other.

use std::path::Path;

use kiln_worker_sdk::{Param, ParamValue};

use crate::ensemble::config::EnsembleConfig;
use crate::error::{Result, ServerError};
use crate::load::triton_config::map::Declared;

/// What a repository model is served by.
#[derive(Debug, Clone, PartialEq)]
pub enum Serving {
    /// A worker (its name in [`Resolved::worker`], its parameters in
    /// [`Resolved::params`]).
    Worker,
    /// An ensemble of loaded models.
    Ensemble(EnsembleConfig),
}

/// What loading a model needs.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The worker (`ensemble` for an ensemble).
    pub worker: String,
    /// The highest version served, and its parameters.
    pub version: u64,
    pub params: Vec<Param>,
    /// Every version served, ascending, each with its parameters (its own
    /// `model_dir`); an ensemble's is its one version.
    pub versions: Vec<(u64, Vec<Param>)>,
    pub serving: Serving,
    /// The tensors a `config.pbtxt` declares, checked once the model is loaded.
    pub declared: Option<Declared>,
    /// The `config.pbtxt` read, for answering `/config` as Triton does.
    pub triton: Option<std::sync::Arc<crate::load::triton_config::proto::ModelConfig>>,
    /// A `config.pbtxt`'s `model_warmup`: run on each group built, before it serves.
    pub warmup: Vec<crate::load::triton_config::warmup::Sample>,
}

/// A worker's model served in `chosen` versions (ascending): each gets `params`
/// with `overrides` and its own `model_dir`; `pbtxt`: the tensors a config.pbtxt
/// declares and the file's parsed config.
pub(crate) fn worker_versions(
    name: &str,
    worker: String,
    params: &[Param],
    overrides: Vec<Param>,
    folder: &Path,
    chosen: &[u64],
    pbtxt: Option<(
        Declared,
        std::sync::Arc<crate::load::triton_config::proto::ModelConfig>,
    )>,
) -> Result<Resolved> {
    let (declared, triton) = pbtxt.map_or((None, None), |(d, t)| (Some(d), Some(t)));
    let versions: Vec<(u64, Vec<Param>)> = chosen
        .iter()
        .map(|&v| {
            let mut params = params.to_vec();
            with_overrides(&mut params, overrides.clone(), folder, v);
            (v, params)
        })
        .collect();
    let Some((version, params)) = versions.last().cloned() else {
        return Err(ServerError::invalid(format!(
            "at least one version must be available under the version policy of model '{name}'"
        )));
    };
    Ok(Resolved {
        worker,
        version,
        params,
        versions,
        serving: Serving::Worker,
        declared,
        triton,
        warmup: Vec::new(),
    })
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
