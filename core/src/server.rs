//! The embeddable server: start it, load workers, infer without a socket.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use kiln_worker_sdk::Param;

use crate::client_bytes::ClientBytes;
use crate::ensemble::config::EnsembleConfig;
use crate::ensemble::plan::Plan;
use crate::error::{Result, ServerError};
use crate::housekeeping::Housekeeping;
use crate::infer::{InferRequest, InferResponse};
use crate::manager::{Manager, Models};
use crate::metrics::Metrics;
use crate::model_control::ModelControl;
use crate::models::{Served, WeakServed};
use crate::params::{client_keys, Origin};
use crate::plugin::Plugins;
use crate::repository::{Entry, Repository, Resolved, Serving};
use crate::restricted::RestrictedApis;
use crate::serve::{self, Call, Pending};
use crate::shm::SharedMemory;
use crate::trace::Trace;
use crate::triton_config::proto::ModelConfig as ModelConfigProto;

/// How to start a [`Server`].
#[derive(Debug, Clone, Default)]
pub struct ServerConfig {
    /// Where plugins are found; [`Plugins::default_dirs`] when empty.
    pub plugin_dirs: Vec<PathBuf>,
    /// The model repository, if any.
    pub model_repository: Option<PathBuf>,
    /// Server-wide limits on what loads may take (defaults from the machine).
    pub limits: crate::limits::Limits,
    /// How often memory freed after a burst is handed back to the system (`None`:
    /// never); see [`crate::housekeeping`].
    pub trim_interval: Option<std::time::Duration>,
    /// The budget of bytes clients make the server hold (`--max-client-bytes`;
    /// `None`: [`crate::client_bytes::default_max`]).
    pub max_client_bytes: Option<usize>,
    /// Workers compiled into the embedding program, served like plugins (found
    /// before any library of the same name).
    pub builtin_workers: Vec<crate::plugin::BuiltinWorker>,
}

/// A `config.pbtxt` as read, with what it was loaded as.
type TritonConfig = (WeakServed, Arc<crate::triton_config::proto::ModelConfig>);

/// A running kiln server; cheap to clone.
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

struct Inner {
    manager: Manager,
    models: Arc<ArcSwap<Models>>,
    metrics: Arc<Metrics>,
    ready: AtomicBool,
    /// Set by [`Server::begin_stopping`]: new requests from clients are refused.
    stopping: AtomicBool,
    repository: Option<Repository>,
    shared_memory: SharedMemory,
    client_bytes: Arc<ClientBytes>,
    restricted: OnceLock<RestrictedApis>,
    model_control: OnceLock<ModelControl>,
    /// The `config.pbtxt` each model was loaded from, with the group it made
    /// (a group loaded since, from another file or none, is not answered by it).
    triton_configs: parking_lot::Mutex<HashMap<String, TritonConfig>>,
    /// Why the last load of each repository model failed, until it loads or is
    /// unloaded: the repository index's `reason`, as Triton's.
    load_failures: parking_lot::Mutex<HashMap<String, String>>,
    /// Stops with the server.
    _housekeeping: Option<Housekeeping>,
}

impl Server {
    /// Starts the Manager; the server is ready once [`Server::set_ready`] says so
    /// (the binary does after loading its start-up workers).
    pub fn start(config: ServerConfig) -> Result<Server> {
        let dirs = if config.plugin_dirs.is_empty() {
            Plugins::default_dirs()
        } else {
            config.plugin_dirs.clone()
        };
        let mut plugins = Plugins::new(dirs);
        for worker in config.builtin_workers {
            plugins.add_builtin(worker)?;
        }
        let models = Arc::new(ArcSwap::from_pointee(Models::new()));
        let metrics = Arc::new(Metrics::new());
        let client_bytes = ClientBytes::new(
            config
                .max_client_bytes
                .unwrap_or_else(crate::client_bytes::default_max),
        );
        metrics.register_collector(client_bytes.collector());
        let manager = Manager::start(
            plugins,
            Arc::clone(&models),
            Arc::clone(&metrics),
            config.limits,
            Arc::clone(&client_bytes),
        )?;
        let housekeeping = match config.trim_interval {
            Some(interval) => Some(Housekeeping::start(Arc::clone(&models), interval)?),
            None => None,
        };
        Ok(Server {
            inner: Arc::new(Inner {
                manager,
                models,
                metrics,
                ready: AtomicBool::new(false),
                stopping: AtomicBool::new(false),
                repository: config.model_repository.map(Repository::new),
                shared_memory: SharedMemory::with_budget(Arc::clone(&client_bytes)),
                client_bytes,
                restricted: OnceLock::new(),
                model_control: OnceLock::new(),
                triton_configs: parking_lot::Mutex::new(HashMap::new()),
                load_failures: parking_lot::Mutex::new(HashMap::new()),
                _housekeeping: housekeeping,
            }),
        })
    }

    /// Loads `worker` with load-time `params` set by the operator; returns the
    /// endpoint name.
    pub async fn load(&self, worker: &str, params: Vec<Param>) -> Result<String> {
        self.load_as(Origin::Operator, worker, params).await
    }

    /// Loads `worker` with `params` from `origin`: a parameter the worker reserves
    /// to the operator is refused (400) from a client, before any `init`.
    pub async fn load_as(
        &self,
        origin: Origin,
        worker: &str,
        params: Vec<Param>,
    ) -> Result<String> {
        let keys = client_keys(origin, &params);
        self.inner.manager.load(worker, params, keys).await
    }

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
    /// `/config` ([`crate::triton_config::complete`]); `None` for a model of
    /// another origin (a `config.toml`, a worker loaded by name).
    pub fn triton_config(&self, served: &Served) -> Option<ModelConfigProto> {
        let configs = self.inner.triton_configs.lock();
        let (loaded, config) = configs.get(served.endpoint())?;
        loaded
            .is(served)
            .then(|| crate::triton_config::complete::complete(config, served.endpoint(), served))
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

    /// Raises or lowers the worker instances of `endpoint` to `instances` while it
    /// serves: no request fails, and its buffer pool is resized to match
    /// ([`crate::group`]'s `scale`). Checked against the server-wide limits. A
    /// model served in several versions: its highest.
    pub async fn scale(&self, endpoint: &str, instances: usize) -> Result<()> {
        self.inner.manager.scale(endpoint, instances).await
    }

    /// Unloads an endpoint (every version of it), answering its accepted
    /// requests first.
    pub async fn unload(&self, endpoint: &str) -> Result<()> {
        self.inner
            .load_failures
            .lock()
            .remove(&endpoint.to_ascii_lowercase());
        self.inner.manager.unload(endpoint, None).await
    }

    /// Unloads version `version` of `endpoint` alone, answering its accepted
    /// requests first; the other versions serve on.
    pub async fn unload_version(&self, endpoint: &str, version: u64) -> Result<()> {
        self.inner.manager.unload(endpoint, Some(version)).await
    }

    /// What serves `name` (case-insensitive): its highest loaded version.
    pub fn model(&self, name: &str) -> Result<Served> {
        self.lookup(name, None)
    }

    /// Every loaded model (each version of each), sorted by name, then version.
    pub fn models(&self) -> Vec<Served> {
        let mut models: Vec<Served> = self.inner.models.load().values().cloned().collect();
        let number = |s: &Served| s.version().parse::<u64>().unwrap_or(0);
        models.sort_by(|a, b| (a.endpoint(), number(a)).cmp(&(b.endpoint(), number(b))));
        models
    }

    /// The loaded versions of model `name`, ascending (empty when it is not
    /// loaded).
    pub fn versions(&self, name: &str) -> Vec<String> {
        let models = self.inner.models.load();
        let name = if models.contains_key(name) {
            name.to_owned()
        } else {
            name.to_ascii_lowercase()
        };
        models.versions(&name).map(|(v, _)| v.to_string()).collect()
    }

    /// What serves `model` (case-insensitive), a worker group or an ensemble: with
    /// `version`, that version (a 404 in Triton's words when it is not loaded);
    /// without, the highest loaded one. The lookup step of every ingress
    /// ([`crate::serve`]).
    pub fn lookup(&self, model: &str, version: Option<&str>) -> Result<Served> {
        self.inner.models.load().find(model, version).cloned()
    }

    /// Looks up `request.model` and queues the request ([`crate::serve`]); await
    /// the [`Pending`] for its answer, or drop it to cancel the request. Not
    /// traced (see [`Server::infer`]).
    pub fn submit(&self, request: InferRequest) -> Result<Pending> {
        let group = self.lookup(&request.model, None)?;
        serve::submit(&group, Ok((request, ())), &mut Trace::default()).map(|(pending, ())| pending)
    }

    /// Runs one inference through a [`Call`]: traced as the other ingresses are
    /// (with no caller's context), nothing to encode.
    pub async fn infer(&self, request: InferRequest) -> Result<InferResponse> {
        let trace = Trace::receive(Default::default);
        let group = self.lookup(&request.model, None)?;
        let (mut call, ()) = Call::start(group, Ok((request, ())), trace)?;
        call.answer()
            .await
            .and_then(|response| call.end(Ok(response)))
    }

    /// The one budget of bytes clients make this server hold
    /// ([`crate::client_bytes`]), shared by every surface.
    pub fn client_bytes(&self) -> &Arc<ClientBytes> {
        &self.inner.client_bytes
    }

    /// The server's registry of system shared-memory regions (one per server),
    /// shared by every protocol.
    pub fn shared_memory(&self) -> &SharedMemory {
        &self.inner.shared_memory
    }

    /// Restricts the protocols' APIs (Triton's `--http-restricted-api` and
    /// `--grpc-restricted-protocol`). Call it before serving: the HTTP and gRPC
    /// servers read it once as they start. Refused once set.
    pub fn restrict(&self, apis: RestrictedApis) -> Result<()> {
        self.inner
            .restricted
            .set(apis)
            .map_err(|_| ServerError::Internal("the APIs are already restricted".into()))
    }

    /// The protocols' restricted APIs (none unless [`Server::restrict`] set them).
    pub fn restricted(&self) -> &RestrictedApis {
        self.inner.restricted.get_or_init(RestrictedApis::default)
    }

    /// Sets how the repository's models are controlled (Triton's
    /// `--model-control-mode`, `--strict-readiness`,
    /// `--disable-auto-complete-config`). Call it before serving; refused once set.
    pub fn set_model_control(&self, control: ModelControl) -> Result<()> {
        self.inner
            .model_control
            .set(control)
            .map_err(|_| ServerError::Internal("model control is already set".into()))
    }

    /// How the repository's models are controlled ([`ModelControl::default`]
    /// unless [`Server::set_model_control`] set it).
    pub fn model_control(&self) -> &ModelControl {
        self.inner.model_control.get_or_init(ModelControl::default)
    }

    /// Whether the server takes requests: marked ready and, with strict readiness,
    /// every loaded model ready (Triton's `--strict-readiness`).
    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst)
            && (!self.model_control().strict_readiness
                || self.inner.models.load().values().all(|g| g.is_ready()))
    }

    /// Marks the server ready (or not).
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::SeqCst);
    }

    /// Begins stopping, as Triton does on SIGTERM (`--exit-timeout-secs`): the
    /// server is not ready from now on (liveness is unchanged) and
    /// [`Server::refuse_if_stopping`] refuses new requests; what was accepted is
    /// still answered. The binary then waits for [`Server::is_idle`].
    pub fn begin_stopping(&self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        self.set_ready(false);
    }

    /// Whether [`Server::begin_stopping`] was called.
    pub fn is_stopping(&self) -> bool {
        self.inner.stopping.load(Ordering::Relaxed)
    }

    /// The admission check of a network ingress, before [`serve::submit`]: while
    /// the server stops, a new request (`request`: decoded, or `None`) is refused
    /// with [`ServerError::Unavailable`] ("server is stopping": 503, gRPC
    /// UNAVAILABLE), except the continuation of a sequence already started (a
    /// stateful model's request without `sequence_start`), which Triton also lets
    /// through so open sequences can end. One relaxed load while serving.
    pub fn refuse_if_stopping(
        &self,
        served: &Served,
        request: Option<&InferRequest>,
    ) -> Result<()> {
        if !self.is_stopping() {
            return Ok(());
        }
        let stateful = served
            .group()
            .is_some_and(|g| g.settings.batcher == kiln_worker_sdk::BatcherKind::Sequence);
        let continuation = stateful
            && request.is_some_and(|r| {
                crate::params::SequenceRequest::read(&r.parameters)
                    .flags(served.endpoint())
                    .is_ok_and(|flags| !flags.start)
            });
        if continuation {
            return Ok(());
        }
        Err(ServerError::Unavailable(format!(
            "server is stopping: model `{}` takes no new request",
            served.endpoint()
        )))
    }

    /// Whether every accepted request has been answered: no group holds a
    /// request queued or in a batch, nor an open sequence (whose continuations
    /// are still let in while stopping).
    pub fn is_idle(&self) -> bool {
        self.inner.models.load().groups().all(|group| {
            let load = group.load();
            load.queued == 0 && load.in_batches == 0 && group.live_sequences() == 0
        })
    }

    /// The WebSocket stream metrics of `model` (`kiln_stream_*`; kiln-server's
    /// `stream` module counts its sessions and frames there).
    pub fn stream_metrics(&self, model: &str) -> crate::stream_metrics::ModelStreamMetrics {
        self.inner.metrics.stream(model)
    }

    /// The summed load of every loaded group (see [`crate::group::WorkerGroup::load`]).
    pub fn load_figures(&self) -> crate::group::GroupLoad {
        let mut total = crate::group::GroupLoad::default();
        for group in self.inner.models.load().groups() {
            let l = group.load();
            total.in_batches += l.in_batches;
            total.queued += l.queued;
            total.capacity += l.capacity;
        }
        total
    }

    /// Registers more metrics in the server's registry (`/metrics` shows them),
    /// such as the jobs dispatcher's.
    pub fn register_metrics(
        &self,
        register: impl FnOnce(&mut prometheus_client::registry::Registry),
    ) {
        self.inner.metrics.register(register);
    }

    /// Prometheus text for `/metrics`.
    pub fn metrics_text(&self) -> String {
        for group in self.inner.models.load().groups() {
            group.refresh_gauges();
        }
        self.inner.metrics.encode()
    }

    /// Stops taking requests, unloads every model (answering what was accepted) and
    /// stops the Manager.
    pub async fn shutdown(&self) {
        self.set_ready(false);
        self.inner.manager.shutdown().await;
    }
}
