//! A model folder read as Triton reads it: its `config.pbtxt` (or, auto-completed,
//! none: [`super::complete`]) → what the repository loads ([`Resolved`]).

use std::path::Path;

use kiln_worker_sdk::Param;

use super::autocomplete::backend_of_files;
use super::map::Mapped;
use crate::error::{Result, ServerError};
use crate::load::repository::resolved::{versions, worker_versions, Resolved, Serving};

/// Triton's model configuration file.
pub const PBTXT: &str = "config.pbtxt";

/// Whether `folder` is a Triton model: it has a `config.pbtxt`, or, auto-completed
/// (`complete`), a version folder with a model file kiln knows.
pub fn is_model(folder: &Path, complete: bool) -> bool {
    folder.join(PBTXT).is_file()
        || (complete && backend_of_files(folder, &versions(folder)).is_some())
}

/// Resolves model `name` in `folder` (see [`is_model`]): `version` under its
/// version policy (none: every version it allows), `overrides` replacing its
/// parameters.
pub fn resolve(
    name: &str,
    folder: &Path,
    version: Option<u64>,
    overrides: Vec<Param>,
    complete: bool,
) -> Result<Resolved> {
    // A load naming a version serves it alone, if the policy allows it; else
    // every version the policy allows.
    let file = folder.join(PBTXT);
    let invalid = |m: String| ServerError::invalid(format!("{}: {m}", file.display()));
    let available = versions(folder);
    // No file: everything comes from the model (is_model found its file).
    let text = if file.is_file() {
        std::fs::read_to_string(&file).map_err(|e| invalid(e.to_string()))?
    } else {
        String::new()
    };
    let mut parsed = super::parse(&text).map_err(invalid)?;
    let c = &mut parsed.config;
    if complete && c.platform.is_empty() && c.backend.is_empty() {
        // Triton infers the backend from the model file's name.
        if let Some(backend) = backend_of_files(folder, &available) {
            c.backend = backend.into();
        }
    }
    let mapped = super::map::map(name, &parsed, complete).map_err(invalid)?;
    let warmup = super::warmup::samples(&parsed.config, folder).map_err(invalid)?;
    let triton = Some(std::sync::Arc::new(parsed.config));
    let policy = match &mapped {
        Mapped::Worker { policy, .. } | Mapped::Ensemble { policy, .. } => policy,
    };
    // An ensemble has no files: version 1 when it has no version folder.
    let available = match (&mapped, available.is_empty()) {
        (Mapped::Ensemble { .. }, true) => vec![1],
        _ => available,
    };
    let chosen = match version {
        Some(_) => policy.pick(&available, version).into_iter().collect(),
        None => policy.allowed(&available),
    };
    let Some(&version) = chosen.last() else {
        return Err(ServerError::NotFound(format!(
            "model `{name}`: no version {} is available under its version_policy \
             (version folders: {available:?})",
            version.map_or("at all".to_owned(), |v| v.to_string())
        )));
    };
    match mapped {
        Mapped::Ensemble { config, .. } => {
            if !overrides.is_empty() {
                return Err(ServerError::invalid(format!(
                    "model `{name}` is an ensemble: it takes no parameters"
                )));
            }
            // An ensemble serves one version: the highest allowed.
            Ok(Resolved {
                worker: "ensemble".into(),
                version,
                params: Vec::new(),
                versions: vec![(version, Vec::new())],
                serving: Serving::Ensemble(config),
                declared: None,
                triton,
                warmup: Vec::new(),
            })
        }
        Mapped::Worker {
            worker,
            params,
            declared,
            ..
        } => {
            let mut resolved = worker_versions(
                name,
                worker.to_owned(),
                &params,
                overrides,
                folder,
                &chosen,
                triton.map(|t| (declared, t)),
            )?;
            resolved.warmup = warmup;
            Ok(resolved)
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::load::repository::Repository;
    use kiln_worker_sdk::Params;

    #[test]
    fn a_bare_onnx_folder_is_a_model_unless_auto_completion_is_off() {
        let root = std::env::temp_dir().join(format!("kiln-folder-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("m/1")).unwrap();
        std::fs::write(root.join("m/1/model.onnx"), b"").unwrap();
        std::fs::create_dir_all(root.join("p/1")).unwrap();
        std::fs::write(root.join("p/config.pbtxt"), "backend: \"onnxruntime\"").unwrap();
        let on = Repository::new(root.clone());
        let names: Vec<String> = on.index().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["m", "p"]);
        let m = on.resolve("m", None, Vec::new()).unwrap();
        assert_eq!((m.worker.as_str(), m.version), ("onnx", 1));
        let p = Params(&m.params);
        assert_eq!(p.int("default_max_batch_size").unwrap(), Some(4));
        assert_eq!(p.int("max_batch_size").unwrap(), None);
        assert_eq!(p.string("batcher").as_deref(), Some("dynamic"));
        // Off: only the file counts, taken as it is.
        let off = Repository::new(root.clone()).with_auto_complete(false);
        let names: Vec<String> = off.index().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["p"]);
        assert!(off.resolve("m", None, Vec::new()).is_err());
        let p = off.resolve("p", None, Vec::new()).unwrap();
        let params = Params(&p.params);
        assert_eq!(params.int("max_batch_size").unwrap(), Some(0));
        assert_eq!(params.string("batcher"), None);
        assert!(!p.declared.unwrap().complete);
        let _ = std::fs::remove_dir_all(&root);
    }
}
