//! Making a worker group's instances: each created (in the server, or in its
//! own worker host), told its parameters (`init`), then `allocate`d and
//! `acquire`d; the group built around them within the server-wide limits. Any
//! failure takes every instance made so far back down from the stage it reached,
//! so nothing remains of a failed load.

use std::sync::Arc;

use kiln_worker_sdk::{
    Param, ParamValue, TD_Opaque, WorkerBox, WorkerFfi_TO, WorkerInfo, WorkerModRef,
    INSTANCES_PARAM,
};

use super::{version_number, version_of, ModelTable, PluginId, State};
use crate::compute::isolation::process::{HostSpec, ProcessWorker};
use crate::compute::isolation::Isolation;
use crate::error::{Result, ServerError};
use crate::group::{demand, resolve, GroupName, WorkerGroup};
use crate::load::limits::Demand;
use crate::load::plugin::check_name;
use crate::models::Served;
use crate::params::{check_client_keys, check_known, identity, GroupParams, RequestRules};

impl State {
    /// Loads the plugin (the operator's library), then, before any `init`, refuses
    /// any parameter in `client_keys` the worker reserves to the operator and any in
    /// `params` neither the server nor the worker declares (`subject` names the
    /// load in that error).
    pub(super) fn plugin(
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

    pub(super) fn load(
        &mut self,
        worker: &str,
        params: Vec<Param>,
        client_keys: &[String],
    ) -> Result<String> {
        check_name(worker)?;
        let module = self.plugin(worker, &format!("worker `{worker}`"), &params, client_keys)?;
        let group_params = GroupParams::parse(&params)?;
        let id = identity(&params);
        let existing = self
            .groups
            .groups()
            .find(|g| g.worker == worker && g.identity == id)
            .cloned();
        if let Some(group) = existing {
            if !self.runs(&group, module) {
                // A rebuilt library: the endpoint's new group runs it, the old one
                // drains.
                let endpoint = group.endpoint.clone();
                let number = version_of(group.as_ref());
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
        self.groups.insert(&endpoint, 1, Served::Group(group));
        self.built_from
            .insert((endpoint.clone(), 1), PluginId::of(module));
        self.publish();
        Ok(endpoint)
    }

    /// Creates, starts and returns a group (not yet published). On failure every
    /// instance is taken back down and nothing remains.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn build_group(
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
        let request_params = RequestRules::new((module.parameters())().as_slice());
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
    pub(super) fn host_spec(
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
}

/// A demand of `n` instances only.
pub(super) fn only_instances(n: usize) -> Demand {
    Demand {
        instances: n,
        ..Demand::default()
    }
}

pub(super) fn load_failed(worker: &str, reason: impl Into<String>) -> ServerError {
    ServerError::LoadFailed {
        worker: worker.to_owned(),
        reason: reason.into(),
    }
}

/// How far an instance's lifecycle got, to take it back down from there.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Stage {
    Initialized,
    Allocated,
    Acquired,
}

/// Ends the lifecycle of instances that reached `stage`.
pub(super) fn teardown(instances: Vec<WorkerBox>, stage: Stage) {
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
pub(super) fn with_instances(params: &[Param], instances: usize) -> Vec<Param> {
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
pub(super) fn init_instances(
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
pub(super) fn start_instances(
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
