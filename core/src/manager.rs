//! The Manager: one thread owns every change of state (load, unload, shutdown).
//! Callers send a command and wait on a one-shot reply. After each change it
//! publishes a new snapshot of the endpoint table, which readers take without locks.

mod versions;

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use arc_swap::ArcSwap;
use crossbeam_channel::{unbounded, Receiver, Sender};
use kiln_worker_sdk::{
    Param, ParamValue, TD_Opaque, WorkerBox, WorkerFfi_TO, WorkerInfo, WorkerModRef,
    INSTANCES_PARAM,
};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::client_bytes::ClientBytes;
use crate::ensemble::bind::bind;
use crate::ensemble::config::EnsembleConfig;
use crate::ensemble::plan::Plan;
use crate::error::{Result, ServerError};
use crate::group::{demand, resolve, GroupName, WorkerGroup};
use crate::isolation::process::{HostSpec, ProcessWorker};
use crate::isolation::Isolation;
use crate::limits::{Demand, Limits};
use crate::metrics::Metrics;
use crate::params::{check_known, identity, GroupParams};
use crate::plugin::{check_name, Plugins};
use crate::triton_config::warmup::Sample;
use crate::worker_params::{check_client_keys, RequestParams};

mod scale;

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

impl crate::calls::Callees for ModelTable {
    fn budget(&self) -> Option<&Arc<ClientBytes>> {
        Some(&self.1)
    }

    fn find(&self, name: &str) -> Option<Arc<dyn crate::calls::Callee>> {
        let models = self.0.upgrade()?;
        let models = models.load();
        let group = models.find(name, None).ok()?;
        Some(Arc::clone(group) as Arc<dyn crate::calls::Callee>)
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
                        .map(|g| (g.ensemble.is_none(), g.endpoint.clone()))
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

    /// Publishes the groups, after binding every ensemble's steps to them again
    /// (a step's model unloaded or no longer fitting leaves its ensemble
    /// unavailable, with the reason, until a fitting one is loaded).
    fn publish(&self) {
        for group in self.groups.values() {
            let Some(side) = &group.ensemble else {
                continue;
            };
            let steps = bind(&side.plan, &self.groups);
            match (&steps, side.steps.load().as_ref()) {
                (Err(reason), Ok(_)) => {
                    spdlog::warn!("ensemble `{}` is unavailable: {reason}", group.endpoint)
                }
                (Ok(_), Err(_)) => spdlog::info!("ensemble `{}` is available", group.endpoint),
                _ => {}
            }
            side.steps.store(Arc::new(steps));
        }
        self.models.store(Arc::new(self.groups.clone()));
    }

    /// Loads ensemble `name`: its graph checked ([`Plan::new`]) and its steps bound
    /// to the loaded models ([`bind`]), else refused (400) naming the step and
    /// tensor. The same graph and version already loaded is kept.
    fn load_ensemble(
        &mut self,
        name: String,
        version: u64,
        config: EnsembleConfig,
    ) -> Result<String> {
        check_name(&name)?;
        let plan = Plan::new(&name, config)?;
        if let Some(s) = plan.steps.iter().position(|s| s.model == name) {
            return Err(ServerError::invalid(format!(
                "ensemble `{name}`: {} runs the ensemble itself",
                plan.step_label(s)
            )));
        }
        let steps = bind(&plan, &self.groups)
            .map_err(|e| ServerError::invalid(format!("ensemble `{name}`: {e}")))?;
        let number = version;
        let version = version.to_string();
        if let Some(group) = self.groups.get(&name) {
            let same = group
                .ensemble
                .as_ref()
                .is_some_and(|side| *side.plan == plan && group.version == version);
            if same {
                return Ok(name);
            }
        }
        let metrics = self.metrics.model(&name, &version);
        let group = WorkerGroup::ensemble(&version, plan, Ok(steps), metrics);
        // An ensemble serves one version: the one loaded last.
        let replaced = self.groups.remove(&name);
        self.groups.insert(&name, number, group);
        self.publish();
        for old in replaced {
            old.drain();
            if old.version != version {
                self.metrics.remove(&name, &old.version);
            }
        }
        spdlog::info!("loaded ensemble `{name}` (version {version})");
        Ok(name)
    }

    /// Loads the plugin (the operator's library), then, before any `init`, refuses
    /// any parameter in `client_keys` the worker reserves to the operator and any in
    /// `params` neither the server nor the worker declares (`subject` names the
    /// load in that error).
    fn plugin(
        &mut self,
        worker: &str,
        subject: &str,
        params: &[Param],
        client_keys: &[String],
    ) -> Result<WorkerModRef> {
        let module = self.plugins.load(worker)?;
        let specs = (module.parameters())();
        check_client_keys(worker, specs.as_slice(), client_keys)?;
        check_known(subject, specs.as_slice(), params)?;
        Ok(module)
    }

    fn load(&mut self, worker: &str, params: Vec<Param>, client_keys: &[String]) -> Result<String> {
        check_name(worker)?;
        let module = self.plugin(worker, &format!("worker `{worker}`"), &params, client_keys)?;
        let group_params = GroupParams::parse(&params)?;
        let id = identity(&params);
        let existing = self
            .groups
            .values()
            .find(|g| g.worker == worker && g.identity == id)
            .cloned();
        if let Some(group) = existing {
            if !self.runs(&group, module) {
                // A rebuilt library: the endpoint's new group runs it, the old one
                // drains.
                let endpoint = group.endpoint.clone();
                let number = version_of(&group);
                let new = self.build_group(
                    module,
                    endpoint.clone(),
                    worker,
                    id,
                    &params,
                    &group_params,
                    &group.version,
                )?;
                self.replace(&endpoint, number, new, module);
                spdlog::info!("replaced `{endpoint}`: its worker's library was rebuilt");
                return Ok(endpoint);
            }
            if !group_params.share {
                let grown = group.demand() + only_instances(1);
                self.within_limits(&group.endpoint, grown, only_instances(1))?;
                let told = with_instances(&params, group.instance_count() + 1);
                let host = self.host_spec(worker, &group.endpoint, &group_params)?;
                let (instances, info) = init_instances(module, worker, host, &told, 1)?;
                if info != *group.worker_info {
                    teardown(instances, Stage::Initialized);
                    return Err(load_failed(
                        worker,
                        "the new instance describes itself differently",
                    ));
                }
                for instance in start_instances(worker, instances, group.settings.batch_size)? {
                    group.add_instance(instance)?;
                }
                spdlog::info!("added an instance to `{}`", group.endpoint);
            }
            return Ok(group.endpoint.clone());
        }
        let endpoint = self.free_name(worker);
        let group = self.build_group(
            module,
            endpoint.clone(),
            worker,
            id,
            &params,
            &group_params,
            "1",
        )?;
        self.groups.insert(&endpoint, 1, group);
        self.built_from
            .insert((endpoint.clone(), 1), PluginId::of(module));
        self.publish();
        Ok(endpoint)
    }

    /// Whether `group` runs the library `module` is the root module of.
    fn runs(&self, group: &WorkerGroup, module: WorkerModRef) -> bool {
        let key = (group.endpoint.clone(), version_of(group));
        self.built_from.get(&key) == Some(&PluginId::of(module))
    }

    /// Publishes `group` as version `version` of `name` in place of the group
    /// there (if any), which hands late requests to it and drains.
    fn replace(&mut self, name: &str, version: u64, group: Arc<WorkerGroup>, module: WorkerModRef) {
        let replaced = self.groups.insert(name, version, Arc::clone(&group));
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

    /// Creates, starts and returns a group (not yet published). On failure every
    /// instance is taken back down and nothing remains.
    #[allow(clippy::too_many_arguments)]
    fn build_group(
        &mut self,
        module: WorkerModRef,
        endpoint: String,
        worker: &str,
        id: String,
        params: &[Param],
        group_params: &GroupParams,
        version: &str,
    ) -> Result<Arc<WorkerGroup>> {
        // Instances are counted before any is made; threads and memory once the
        // worker has described itself.
        let count = only_instances(group_params.instances.get());
        self.within_limits(&endpoint, count, count)?;
        let params_as_given = params.to_vec();
        let params = with_instances(params, group_params.instances.get());
        let host = self.host_spec(worker, &endpoint, group_params)?;
        let (instances, info) =
            init_instances(module, worker, host, &params, group_params.instances.get())?;
        let asynchronous = instances.iter().any(|i| i.is_async());
        let settings =
            resolve(&info, group_params, instances.len(), asynchronous).and_then(|settings| {
                let wanted = demand(&info, &settings, instances.len());
                self.within_limits(&endpoint, wanted, wanted)?;
                Ok(settings)
            });
        let settings = match settings {
            Ok(settings) => settings,
            Err(e) => {
                teardown(instances, Stage::Initialized);
                return Err(e);
            }
        };
        let mut settings = settings;
        // What a scale up may grow the pool to: the sets of the most instances the
        // limits let the model have.
        let most = self.limits.instances_per_model.max(instances.len());
        settings.buffer_capacity = resolve(&info, group_params, most, asynchronous)
            .map_or(settings.max_buffers, |s| {
                s.max_buffers.max(settings.max_buffers)
            });
        let instances = start_instances(worker, instances, settings.batch_size)?;
        let metrics = self.metrics.model(&endpoint, version);
        let fresh = self
            .groups
            .version(&endpoint, version_number(version))
            .is_none();
        let name = GroupName {
            endpoint: endpoint.clone(),
            worker: worker.to_owned(),
            identity: id,
            version: version.to_owned(),
            params: params_as_given,
        };
        let request_params = RequestParams::new((module.parameters())().as_slice());
        let group = WorkerGroup::start(name, info, settings, instances, metrics, request_params)
            .inspect_err(|_| {
                if fresh {
                    self.metrics.remove(&endpoint, version);
                }
                if !self.groups.contains_key(&endpoint) {
                    self.metrics.remove_model(&endpoint);
                }
            })?;
        group.connect_calls(Arc::new(ModelTable(
            Arc::downgrade(&self.models),
            Arc::clone(&self.client_bytes),
        )));
        spdlog::info!(
            "loaded `{endpoint}` (worker `{worker}`, version {version}, batch_size {}, {} batcher, {} instance(s), {} buffer sets)",
            group.settings.batch_size,
            group.settings.batcher.as_str(),
            group.instance_count(),
            group.settings.max_buffers
        );
        Ok(group)
    }

    /// What a group's instances need to run in worker hosts, when its
    /// parameters ask for process isolation: the plugin's file (the one the
    /// server found, never a request's) and the model's restart counter.
    fn host_spec(
        &self,
        worker: &str,
        endpoint: &str,
        params: &GroupParams,
    ) -> Result<Option<HostSpec>> {
        if params.isolation != Isolation::Process {
            return Ok(None);
        }
        if self.plugins.is_builtin(worker) {
            return Err(load_failed(
                worker,
                "a worker compiled into the server runs in its process only: \
                 isolation = \"process\" needs a plugin library",
            ));
        }
        let plugin = self
            .plugins
            .path(worker)
            .ok_or_else(|| load_failed(worker, "the plugin's file is not known"))?;
        Ok(Some(HostSpec {
            model: endpoint.to_owned(),
            plugin: plugin.to_owned(),
            restarts: self.metrics.host_restarts(endpoint),
            max_batch_bytes: usize::try_from(self.limits.buffer_bytes_per_model)
                .unwrap_or(usize::MAX),
            max_memory: params.max_host_memory.map(|m| m.get()),
        }))
    }

    /// Checks the server-wide limits for a group that would take `group` in all,
    /// `added` of it beyond what is loaded now. A group being replaced still counts:
    /// both run until the new one is published.
    fn within_limits(&self, model: &str, group: Demand, added: Demand) -> Result<()> {
        let loaded: Demand = self.groups.values().map(|g| g.demand()).sum();
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
        for group in groups {
            group.drain();
            self.metrics.remove(endpoint, &group.version);
        }
        self.metrics.remove_model(endpoint);
        spdlog::info!("unloaded `{endpoint}`");
        Ok(())
    }
}

/// The version a group serves, as a number (the Manager only makes numbered ones).
fn version_of(group: &WorkerGroup) -> u64 {
    version_number(&group.version)
}

fn version_number(version: &str) -> u64 {
    version.parse().unwrap_or(1)
}

/// A demand of `n` instances only.
fn only_instances(n: usize) -> Demand {
    Demand {
        instances: n,
        ..Demand::default()
    }
}

fn load_failed(worker: &str, reason: impl Into<String>) -> ServerError {
    ServerError::LoadFailed {
        worker: worker.to_owned(),
        reason: reason.into(),
    }
}

/// How far an instance's lifecycle got, to take it back down from there.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Initialized,
    Allocated,
    Acquired,
}

/// Ends the lifecycle of instances that reached `stage`.
fn teardown(instances: Vec<WorkerBox>, stage: Stage) {
    for mut instance in instances {
        if stage >= Stage::Acquired {
            let _ = instance.release();
        }
        if stage >= Stage::Allocated {
            let _ = instance.deallocate();
        }
        instance.destroy();
    }
}

/// `params` with [`INSTANCES_PARAM`] set to the group's instance count (once the
/// new instances are in) when the loader left it to its default: every worker's
/// `init` is told how many instances share the machine.
fn with_instances(params: &[Param], instances: usize) -> Vec<Param> {
    let mut params = params.to_vec();
    if !params
        .iter()
        .any(|p| p.key.as_str().eq_ignore_ascii_case(INSTANCES_PARAM))
    {
        params.push(Param {
            key: INSTANCES_PARAM.into(),
            value: ParamValue::Int(i64::try_from(instances).unwrap_or(i64::MAX)),
        });
    }
    params
}

/// Creates `count` instances (in the server, or each in its own worker host when
/// `host` is given) and runs `init` on each; all must describe themselves alike.
/// On failure every instance made so far is destroyed.
fn init_instances(
    module: WorkerModRef,
    worker: &str,
    host: Option<HostSpec>,
    params: &[Param],
    count: usize,
) -> Result<(Vec<WorkerBox>, WorkerInfo)> {
    let mut made: Vec<WorkerBox> = Vec::with_capacity(count);
    let mut info: Option<WorkerInfo> = None;
    for _ in 0..count {
        let mut instance = match &host {
            None => (module.new_worker())(),
            Some(spec) => WorkerFfi_TO::from_value(ProcessWorker::new(spec.clone()), TD_Opaque),
        };
        let described = match instance.init(params.into()).into_result() {
            Ok(described) => described,
            Err(e) => {
                made.push(instance);
                teardown(made, Stage::Initialized);
                return Err(load_failed(worker, format!("init: {e}")));
            }
        };
        made.push(instance);
        if info.as_ref().is_some_and(|i| *i != described) {
            teardown(made, Stage::Initialized);
            return Err(load_failed(
                worker,
                "instances describe themselves differently",
            ));
        }
        info = Some(described);
    }
    match info {
        Some(info) => Ok((made, info)),
        None => Err(load_failed(worker, "no instance requested")),
    }
}

/// Runs `allocate(batch_size)` and `acquire` on each initialized instance. On failure
/// every instance is taken back down from the stage it reached.
fn start_instances(
    worker: &str,
    instances: Vec<WorkerBox>,
    batch_size: usize,
) -> Result<Vec<WorkerBox>> {
    let mut started = Vec::with_capacity(instances.len());
    let mut pending = instances.into_iter();
    while let Some(mut instance) = pending.next() {
        let failure = match instance.allocate(batch_size).into_result() {
            Err(e) => Some((Stage::Initialized, format!("allocate: {e}"))),
            Ok(()) => match instance.acquire().into_result() {
                Err(e) => Some((Stage::Allocated, format!("acquire: {e}"))),
                Ok(()) => None,
            },
        };
        match failure {
            None => started.push(instance),
            Some((stage, reason)) => {
                teardown(vec![instance], stage);
                teardown(started, Stage::Acquired);
                teardown(pending.collect(), Stage::Initialized);
                return Err(load_failed(worker, reason));
            }
        }
    }
    Ok(started)
}
