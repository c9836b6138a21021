//! The embeddable server: start it, load workers, infer without a socket.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use kiln_worker_sdk::Param;

use crate::error::{Result, ServerError};
use crate::load::model_control::ModelControl;
use crate::load::plugin::Plugins;
use crate::load::repository::Repository;
use crate::manager::{Manager, Models};
use crate::memory::client_bytes::ClientBytes;
use crate::memory::shared_memory::SharedMemory;
use crate::models::{Served, WeakServed};
use crate::observe::metrics::Metrics;
use crate::observe::trace::Trace;
use crate::params::{client_keys, Origin};
use crate::request::infer::{InferRequest, InferResponse};
use crate::request::serve::{self, Admitted, Call};
use crate::system::housekeeping::Housekeeping;

mod repository;

/// How to start a [`Server`].
#[derive(Debug, Clone, Default)]
pub struct ServerConfig {
    /// Where plugins are found; [`Plugins::default_dirs`] when empty.
    pub plugin_dirs: Vec<PathBuf>,
    /// The model repository, if any.
    pub model_repository: Option<PathBuf>,
    /// Server-wide limits on what loads may take (defaults from the machine).
    pub limits: crate::load::limits::Limits,
    /// How often memory freed after a burst is handed back to the system (`None`:
    /// never); see [`crate::system::housekeeping`].
    pub trim_interval: Option<std::time::Duration>,
    /// The budget of bytes clients make the server hold (`--max-client-bytes`;
    /// `None`: [`crate::memory::client_bytes::default_max`]).
    pub max_client_bytes: Option<usize>,
    /// Workers compiled into the embedding program, served like plugins (found
    /// before any library of the same name).
    pub builtin_workers: Vec<crate::load::plugin::BuiltinWorker>,
}

/// A `config.pbtxt` as read, with what it was loaded as.
type TritonConfig = (
    WeakServed,
    Arc<crate::load::triton_config::proto::ModelConfig>,
);

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
                .unwrap_or_else(crate::memory::client_bytes::default_max),
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
            Some(interval) => Some(Housekeeping::start(
                Arc::clone(&models),
                Arc::clone(&client_bytes),
                interval,
            )?),
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
    /// ([`crate::request::serve`]).
    pub fn lookup(&self, model: &str, version: Option<&str>) -> Result<Served> {
        self.inner.models.load().find(model, version).cloned()
    }

    /// Looks up `request.model` and queues the request ([`crate::request::serve`]); await
    /// the [`Admitted`] for its answer, or drop it to cancel the request. Not
    /// traced (see [`Server::infer`]).
    pub fn submit(&self, request: InferRequest) -> Result<Admitted> {
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
    /// ([`crate::memory::client_bytes`]), shared by every surface.
    pub fn client_bytes(&self) -> &Arc<ClientBytes> {
        &self.inner.client_bytes
    }

    /// The server's registry of system shared-memory regions (one per server),
    /// shared by every protocol.
    pub fn shared_memory(&self) -> &SharedMemory {
        &self.inner.shared_memory
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
    pub fn stream_metrics(
        &self,
        model: &str,
    ) -> crate::observe::stream_metrics::ModelStreamMetrics {
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
