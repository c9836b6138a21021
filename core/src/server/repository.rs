//! The [`Server`]'s models from its model repository: loading a folder
//! (`config.toml` or Triton's `config.pbtxt`), reloading it in place, the load
//! failures the index reports, and the completed Triton config `/config` answers.

use kiln_worker_sdk::Param;

use super::Server;
use crate::ensemble::config::EnsembleConfig;
use crate::ensemble::plan::Plan;
use crate::error::{Result, ServerError};
use crate::load::repository::{Entry, Repository, Resolved, Serving};
use crate::load::triton_config::proto::ModelConfig as ModelConfigProto;
use crate::models::Served;
use crate::params::{client_keys, take_version, Origin};

impl Server {
    /// The model repository, auto-completing Triton models unless the model
    /// control says `--disable-auto-complete-config` (a path and a flag: the
    /// copy is nothing beside reading the folder).
    fn repository(&self) -> Result<Repository> {
        self.inner
            .repository
            .as_ref()
            .map(|r| {
                r.clone()
                    .with_auto_complete(!self.model_control().strict_config)
            })
            .ok_or_else(|| ServerError::Unavailable("no model repository is configured".into()))
    }

    /// The model repository's directory.
    pub fn repository_root(&self) -> Result<std::path::PathBuf> {
        Ok(self.repository()?.root().to_owned())
    }

    /// The models of the model repository.
    pub fn repository_index(&self) -> Result<Vec<Entry>> {
        self.repository()?.index()
    }

    /// Loads model `name` of the repository (the latest version unless `version`),
    /// with `overrides` set by the operator replacing its configured parameters;
    /// returns the endpoint.
    pub async fn load_model(
        &self,
        name: &str,
        version: Option<u64>,
        overrides: Vec<Param>,
    ) -> Result<String> {
        self.load_model_as(Origin::Operator, name, version, overrides)
            .await
    }

    /// [`Server::load_model`] with `overrides` from `origin`: the model's
    /// `config.toml` is the operator's, a client's overrides may not set a parameter
    /// the worker reserves to the operator.
    pub async fn load_model_as(
        &self,
        origin: Origin,
        name: &str,
        version: Option<u64>,
        overrides: Vec<Param>,
    ) -> Result<String> {
        let keys = client_keys(origin, &overrides);
        let loaded = match self.resolve_model(name, version, overrides) {
            Ok(resolved) => self.load_resolved(name, resolved, keys).await,
            Err(e) => Err(e),
        };
        self.note_load(name, &loaded);
        loaded
    }

    /// Remembers how the load of repository model `name` ended: a failure is its
    /// [`Server::load_failure`] until it loads or is unloaded.
    pub(crate) fn note_load(&self, name: &str, loaded: &Result<String>) {
        let name = name.to_ascii_lowercase();
        let mut failures = self.inner.load_failures.lock();
        match loaded {
            Ok(_) => failures.remove(&name),
            Err(e) => failures.insert(name, e.to_string()),
        };
    }

    /// Why the last load of repository model `name` failed, if it did and the
    /// model has not loaded since.
    pub fn load_failure(&self, name: &str) -> Option<String> {
        let failures = self.inner.load_failures.lock();
        failures.get(&name.to_ascii_lowercase()).cloned()
    }

    /// Triton's repository load as a client asks it (REST's and gRPC's
    /// `repository/models/{m}/load`): `params` override the model's configured
    /// parameters, checked as a client's, and their `version` picks the version.
    /// Reads the model's files, so an ingress runs it off its async threads, then
    /// hands what it returns to [`Server::load_resolved`].
    pub fn resolve_client_load(
        &self,
        name: &str,
        mut params: Vec<Param>,
    ) -> Result<(Resolved, Vec<String>)> {
        let version = take_version(&mut params)?;
        let keys = client_keys(Origin::Client, &params);
        Ok((self.resolve_model(name, version, params)?, keys))
    }

    /// Triton's repository unload as a client asks it: every version of `name`,
    /// or the one `params`' `version` names (kiln's), the others serving on.
    /// Other parameters (Triton's `unload_dependents`) change nothing.
    pub async fn unload_client_model(&self, name: &str, mut params: Vec<Param>) -> Result<()> {
        match take_version(&mut params)? {
            None => self.unload(name).await,
            Some(version) => self.unload_version(name, version).await,
        }
    }

    /// The first half of [`Server::load_model_as`]: reads model `name`'s
    /// configuration from the repository (files: a caller on an I/O thread runs it
    /// elsewhere).
    pub fn resolve_model(
        &self,
        name: &str,
        version: Option<u64>,
        overrides: Vec<Param>,
    ) -> Result<Resolved> {
        self.repository()?
            .resolve(&name.to_ascii_lowercase(), version, overrides)
    }

    /// The second half of [`Server::load_model_as`]: loads model `name` as
    /// `resolved`; `client_keys` are the parameters a client set
    /// ([`crate::params::client_keys`]).
    pub async fn load_resolved(
        &self,
        name: &str,
        resolved: Resolved,
        client_keys: Vec<String>,
    ) -> Result<String> {
        self.load_resolved_as(name, resolved, client_keys, false)
            .await
    }

    /// [`Server::load_resolved`] for a model whose files changed (poll mode):
    /// each version is built again even where its parameters are the same as the
    /// running group's (a `model.onnx` rewritten in place has the same
    /// `model_dir`), and replaces it without failing a request.
    pub async fn reload_resolved(&self, name: &str, resolved: Resolved) -> Result<String> {
        self.load_resolved_as(name, resolved, Vec::new(), true)
            .await
    }

    async fn load_resolved_as(
        &self,
        name: &str,
        resolved: Resolved,
        client_keys: Vec<String>,
        fresh: bool,
    ) -> Result<String> {
        let triton = resolved.triton.clone();
        let loaded = self
            .load_serving(name, resolved, client_keys, fresh)
            .await?;
        let mut configs = self.inner.triton_configs.lock();
        match (triton, self.model(&loaded)) {
            (Some(config), Ok(served)) => {
                configs.insert(loaded.clone(), (served.downgrade(), config));
            }
            _ => {
                configs.remove(&loaded);
            }
        }
        Ok(loaded)
    }

    /// The `config.pbtxt` `served` was loaded from, completed as Triton answers
    /// `/config` ([`crate::load::triton_config::complete`]); `None` for a model of
    /// another origin (a `config.toml`, a worker loaded by name).
    pub fn triton_config(&self, served: &Served) -> Option<ModelConfigProto> {
        let configs = self.inner.triton_configs.lock();
        let (loaded, config) = configs.get(served.endpoint())?;
        loaded.is(served).then(|| {
            crate::load::triton_config::complete::complete(config, served.endpoint(), served)
        })
    }

    /// [`Server::load_resolved`] without the bookkeeping of Triton's configs.
    async fn load_serving(
        &self,
        name: &str,
        resolved: Resolved,
        client_keys: Vec<String>,
        fresh: bool,
    ) -> Result<String> {
        if let Serving::Ensemble(config) = resolved.serving {
            return self.load_ensemble(name, resolved.version, config).await;
        }
        let loaded = self
            .inner
            .manager
            .load_model(
                &name.to_ascii_lowercase(),
                &resolved.worker,
                resolved.versions,
                client_keys,
                fresh,
                resolved.warmup,
            )
            .await?;
        // A config.pbtxt's declared tensors must be the model's (Triton refuses
        // such a model at load too), in every version served.
        if let Some(declared) = &resolved.declared {
            let strict = self.model_control().strict_config;
            let models = self.inner.models.load();
            let mut groups = models.versions(&loaded).filter_map(|(_, s)| s.group());
            let wrong = groups.find_map(|g| {
                // The model's tensors as the worker has them (a reshaped tensor's
                // clients see the file's `dims`; its `reshape` is the model's).
                let worker = &g.worker_info;
                let mut checked = declared.check(&worker.inputs, &worker.outputs, &worker.inputs);
                let (inputs, outputs) = (&g.info.inputs, &g.info.outputs);
                // Without auto-completion (Triton's strict model configuration) the
                // file must declare every tensor of the model.
                if checked.is_ok() && strict {
                    checked = declared.check_complete(inputs, outputs).map_err(|why| {
                        format!("{why} (--disable-auto-complete-config: nothing is completed from the model)")
                    });
                }
                checked.err()
            });
            if let Some(why) = wrong {
                self.unload(&loaded).await?;
                return Err(ServerError::invalid(format!("model `{name}`: {why}")));
            }
        }
        Ok(loaded)
    }

    /// Loads ensemble `name` ([`crate::ensemble`]). Its graph is checked first;
    /// then each step model that is not loaded is loaded from the repository (the
    /// step's version, else the latest, with its configured parameters), as
    /// Triton's explicit model control loads an ensemble's composing models; then
    /// the Manager binds the steps to the loaded models. Needs a tokio runtime (the
    /// repository's files are read on its blocking threads).
    async fn load_ensemble(
        &self,
        name: &str,
        version: u64,
        config: EnsembleConfig,
    ) -> Result<String> {
        let name = name.to_ascii_lowercase();
        let plan = Plan::new(&name, config.clone())?;
        for (s, step) in plan.steps.iter().enumerate() {
            if step.model == name || self.model(&step.model).is_ok() {
                continue;
            }
            let wanted = step.version.as_deref().and_then(|v| v.parse().ok());
            let at = |e: ServerError| {
                ServerError::invalid(format!(
                    "ensemble `{name}`: {}: cannot load model `{}` from the repository: {e}",
                    plan.step_label(s),
                    step.model
                ))
            };
            // Files: read on a blocking thread, not the caller's (an I/O thread).
            let (server, model) = (self.clone(), step.model.clone());
            let read = tokio::task::spawn_blocking(move || {
                server.resolve_model(&model, wanted, Vec::new())
            })
            .await
            .map_err(|e| ServerError::Internal(format!("a blocking task failed: {e}")))?;
            let resolved = match read {
                Ok(resolved) => resolved,
                // Not in the repository: binding names the step and its model.
                Err(ServerError::NotFound(_)) => continue,
                Err(e) => return Err(at(e)),
            };
            if let Serving::Worker = resolved.serving {
                self.inner
                    .manager
                    .load_model(
                        &step.model,
                        &resolved.worker,
                        resolved.versions,
                        Vec::new(),
                        false,
                        resolved.warmup,
                    )
                    .await
                    .map_err(at)?;
            }
        }
        self.inner
            .manager
            .load_ensemble(&name, version, config)
            .await
    }
}
