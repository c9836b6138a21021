//! The Manager: one thread owns every change of state (load, unload, shutdown).
//! Callers send a command and wait on a one-shot reply. After each change it
//! publishes a new snapshot of the endpoint table, which readers take without locks.

mod ensembles;
mod instances;
mod scale;
mod versions;

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use arc_swap::ArcSwap;
use crossbeam_channel::{unbounded, Receiver, Sender};
use kiln_worker_sdk::{Param, WorkerModRef};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::ensemble::config::EnsembleConfig;
use crate::error::{Result, ServerError};
use crate::group::WorkerGroup;
use crate::load::limits::{Demand, Limits};
use crate::load::plugin::Plugins;
use crate::load::triton_config::warmup::Sample;
use crate::memory::client_bytes::ClientBytes;
use crate::models::{Model, Served};
use crate::observe::metrics::Metrics;

pub use crate::models::Models;

enum Command {
    Load {
        worker: String,
        params: Vec<Param>,
        client_keys: Vec<String>,
        reply: oneshot::Sender<Result<String>>,
    },
    LoadModel {
        name: String,
        worker: String,
        versions: Vec<(u64, Vec<Param>)>,
        client_keys: Vec<String>,
        /// Build every version again, even one whose parameters are unchanged.
        fresh: bool,
        /// Run on each group built before it takes the name.
        warmup: Vec<Sample>,
        reply: oneshot::Sender<Result<String>>,
    },
    LoadEnsemble {
        name: String,
        version: u64,
        config: EnsembleConfig,
        reply: oneshot::Sender<Result<String>>,
    },
    Unload {
        endpoint: String,
        version: Option<u64>,
        reply: oneshot::Sender<Result<()>>,
    },
    Scale {
        endpoint: String,
        instances: usize,
        reply: oneshot::Sender<Result<()>>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// Handle to the Manager thread.
pub struct Manager {
    commands: Sender<Command>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Manager {
    /// Starts the Manager thread; it publishes into `models`.
    pub fn start(
        plugins: Plugins,
        models: Arc<ArcSwap<Models>>,
        metrics: Arc<Metrics>,
        limits: Limits,
        client_bytes: Arc<ClientBytes>,
    ) -> Result<Manager> {
        let (commands, rx) = unbounded();
        let state = State {
            plugins,
            models,
            metrics,
            groups: Models::new(),
            built_from: HashMap::new(),
            building: Demand::default(),
            limits,
            client_bytes,
        };
        let thread = std::thread::Builder::new()
            .name("kiln-manager".into())
            .spawn(move || state.run(rx))
            .map_err(|e| ServerError::Internal(format!("cannot start the manager: {e}")))?;
        Ok(Manager {
            commands,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Loads `worker` with `params`; returns the endpoint name. `client_keys` are
    /// the parameters a client set: one the worker reserves to the operator is
    /// refused before any instance is created.
    pub async fn load(
        &self,
        worker: &str,
        params: Vec<Param>,
        client_keys: Vec<String>,
    ) -> Result<String> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Load {
            worker: worker.to_ascii_lowercase(),
            params,
            client_keys,
            reply,
        })?;
        rx.await.map_err(|_| stopped())?
    }

    /// Serves exactly `versions` (each with its load parameters) of repository
    /// model `name`: a version loaded with other parameters is replaced (the new
    /// group starts, takes the version, then the old one drains), a loaded version
    /// not among them drains ([`versions`]). `client_keys` as for [`Manager::load`];
    /// `fresh`: a version with the same parameters is replaced too (its files
    /// changed under the same path); `warmup` runs on each group built before it takes the name (Triton's
    /// `model_warmup`), a failure failing the load.
    pub async fn load_model(
        &self,
        name: &str,
        worker: &str,
        versions: Vec<(u64, Vec<Param>)>,
        client_keys: Vec<String>,
        fresh: bool,
        warmup: Vec<Sample>,
    ) -> Result<String> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::LoadModel {
            name: name.to_ascii_lowercase(),
            worker: worker.to_ascii_lowercase(),
            versions,
            client_keys,
            fresh,
            warmup,
            reply,
        })?;
        rx.await.map_err(|_| stopped())?
    }

    /// Loads ensemble `name` (version `version`) over the loaded models its steps
    /// name ([`crate::ensemble`]); loading it again with another graph replaces it.
    pub async fn load_ensemble(
        &self,
        name: &str,
        version: u64,
        config: EnsembleConfig,
    ) -> Result<String> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::LoadEnsemble {
            name: name.to_ascii_lowercase(),
            version,
            config,
            reply,
        })?;
        rx.await.map_err(|_| stopped())?
    }

    /// Unloads `endpoint` (every version, or only `version`, the others serving
    /// on) after answering every request it accepted.
    pub async fn unload(&self, endpoint: &str, version: Option<u64>) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Unload {
            endpoint: endpoint.to_ascii_lowercase(),
            version,
            reply,
        })?;
        rx.await.map_err(|_| stopped())?
    }

    /// Raises or lowers the instances of `endpoint` to `instances` ([`scale`]):
    /// in place, with the buffer pool resized to match, or for a stateful model
    /// by a reload with the new count. No request fails either way.
    pub async fn scale(&self, endpoint: &str, instances: usize) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Scale {
            endpoint: endpoint.to_ascii_lowercase(),
            instances,
            reply,
        })?;
        rx.await.map_err(|_| stopped())?
    }

    /// Unloads everything and stops the thread.
    pub async fn shutdown(&self) {
        let (reply, rx) = oneshot::channel();
        if self.send(Command::Shutdown { reply }).is_ok() {
            let _ = rx.await;
        }
        let thread = self.thread.lock().take();
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }

    fn send(&self, command: Command) -> Result<()> {
        self.commands.send(command).map_err(|_| stopped())
    }
}

/// The published models, as a worker's calls find them (weak: the table holds
/// the groups that hold this).
struct ModelTable(std::sync::Weak<ArcSwap<Models>>, Arc<ClientBytes>);

impl crate::compute::calls::Callees for ModelTable {
    fn budget(&self) -> Option<&Arc<ClientBytes>> {
        Some(&self.1)
    }

    fn find(&self, name: &str) -> Option<Arc<dyn crate::compute::calls::Callee>> {
        let models = self.0.upgrade()?;
        let models = models.load();
        Some(match models.find(name, None).ok()? {
            Served::Group(group) => Arc::clone(group) as Arc<dyn crate::compute::calls::Callee>,
            Served::Ensemble(ensemble) => {
                Arc::clone(ensemble) as Arc<dyn crate::compute::calls::Callee>
            }
        })
    }
}

fn stopped() -> ServerError {
    ServerError::Unavailable("the server is shutting down".into())
}

struct State {
    plugins: Plugins,
    models: Arc<ArcSwap<Models>>,
    metrics: Arc<Metrics>,
    groups: Models,
    /// The plugin library each group's instances run (by its root module), by
    /// endpoint and version: a load of a rebuilt library replaces the group that
    /// runs the old one.
    built_from: HashMap<(String, u64), PluginId>,
    /// What the groups built for a load but not yet published take (a load of
    /// several versions builds them one after the other).
    building: Demand,
    limits: Limits,
    /// What model calls' copies of their inputs are reserved from.
    client_bytes: Arc<ClientBytes>,
}

/// Which loaded library a root module is (each load of a changed file maps a new
/// copy with a root module of its own; libraries are never unmapped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PluginId(usize);

impl PluginId {
    fn of(module: WorkerModRef) -> PluginId {
        PluginId(module.0.to_raw_ptr() as usize)
    }
}

impl State {
    fn run(mut self, commands: Receiver<Command>) {
        for command in commands.iter() {
            match command {
                Command::Load {
                    worker,
                    params,
                    client_keys,
                    reply,
                } => {
                    let result = self.load(&worker, params, &client_keys);
                    if let Err(e) = &result {
                        spdlog::warn!("load of `{worker}` failed: {e}");
                    }
                    let _ = reply.send(result);
                }
                Command::LoadModel {
                    name,
                    worker,
                    versions,
                    client_keys,
                    fresh,
                    warmup,
                    reply,
                } => {
                    let result =
                        self.load_versions(name, &worker, versions, &client_keys, fresh, &warmup);
                    if let Err(e) = &result {
                        spdlog::warn!("load of model `{worker}` failed: {e}");
                    }
                    let _ = reply.send(result);
                }
                Command::LoadEnsemble {
                    name,
                    version,
                    config,
                    reply,
                } => {
                    let result = self.load_ensemble(name.clone(), version, config);
                    if let Err(e) = &result {
                        spdlog::warn!("load of ensemble `{name}` failed: {e}");
                    }
                    let _ = reply.send(result);
                }
                Command::Unload {
                    endpoint,
                    version,
                    reply,
                } => {
                    let _ = reply.send(match version {
                        None => self.unload(&endpoint),
                        Some(version) => self.unload_version(&endpoint, version),
                    });
                }
                Command::Scale {
                    endpoint,
                    instances,
                    reply,
                } => {
                    let result = self.scale(&endpoint, instances);
                    if let Err(e) = &result {
                        spdlog::warn!("scaling `{endpoint}` failed: {e}");
                    }
                    let _ = reply.send(result);
                }
                Command::Shutdown { reply } => {
                    // Ensembles first: their step models are unloaded after them.
                    let mut names: Vec<(bool, String)> = self
                        .groups
                        .values()
                        .map(|s| (s.group().is_some(), s.endpoint().to_owned()))
                        .collect();
                    names.sort();
                    names.dedup();
                    names.sort();
                    let names = names.into_iter().map(|(_, name)| name);
                    for name in names {
                        let _ = self.unload(&name);
                    }
                    let _ = reply.send(());
                    return;
                }
            }
        }
    }

    /// Publishes the models, after binding every ensemble's steps to them again
    /// ([`State::bind_ensembles`]).
    fn publish(&self) {
        self.bind_ensembles();
        self.models.store(Arc::new(self.groups.clone()));
    }

    /// Whether `group` runs the library `module` is the root module of.
    fn runs(&self, group: &WorkerGroup, module: WorkerModRef) -> bool {
        let key = (group.endpoint.clone(), version_of(group));
        self.built_from.get(&key) == Some(&PluginId::of(module))
    }

    /// Publishes `group` as version `version` of `name` in place of the group
    /// there (if any), which hands late requests to it and drains.
    fn replace(&mut self, name: &str, version: u64, group: Arc<WorkerGroup>, module: WorkerModRef) {
        let group = Served::Group(group);
        let replaced = self.groups.insert(name, version, group.clone());
        self.built_from
            .insert((name.to_owned(), version), PluginId::of(module));
        if let Some(old) = &replaced {
            old.replaced_by(&group);
        }
        self.publish();
        if let Some(old) = replaced {
            // The name already serves the new group; the old one answers what it took
            // (and hands on what reaches it late).
            old.drain();
        }
    }

    /// Checks the server-wide limits for a group that would take `group` in all,
    /// `added` of it beyond what is loaded now. A group being replaced still counts:
    /// both run until the new one is published.
    fn within_limits(&self, model: &str, group: Demand, added: Demand) -> Result<()> {
        let loaded: Demand = self.groups.groups().map(|g| g.demand()).sum();
        self.limits
            .check(model, group, loaded + self.building + added)
    }

    /// `worker`, else `worker-0`, `worker-1`, … whichever is free first.
    fn free_name(&self, worker: &str) -> String {
        if !self.groups.contains_key(worker) {
            return worker.to_owned();
        }
        (0..)
            .map(|n| format!("{worker}-{n}"))
            .find(|name| !self.groups.contains_key(name))
            .unwrap_or_else(|| worker.to_owned())
    }

    /// Unloads every version of `endpoint`.
    fn unload(&mut self, endpoint: &str) -> Result<()> {
        let groups = self.groups.remove(endpoint);
        if groups.is_empty() {
            return Err(ServerError::NotFound(format!(
                "no model `{endpoint}` is loaded"
            )));
        }
        self.built_from.retain(|(name, _), _| name != endpoint);
        // New requests stop finding it; then accepted ones are answered.
        self.publish();
        for served in groups {
            served.drain();
            self.metrics.remove(endpoint, served.version());
        }
        self.metrics.remove_model(endpoint);
        spdlog::info!("unloaded `{endpoint}`");
        Ok(())
    }
}

/// The version a model serves, as a number (the Manager only makes numbered ones).
fn version_of(model: &dyn Model) -> u64 {
    version_number(model.version())
}

fn version_number(version: &str) -> u64 {
    version.parse().unwrap_or(1)
}
