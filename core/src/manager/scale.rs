//! The Manager's side of scaling a loaded model ([`crate::group`]'s `scale`):
//! `POST /v2/repository/models/{m}/scale`, or a reload whose only change is
//! `instances` (Triton's `instance_group` count). The new count is checked against
//! the server-wide limits like a load; new instances are made with the group's
//! own load-time parameters (told the new count), from the library the group
//! runs; a stateful model, whose sequences are pinned to instances, is reloaded
//! with the new count instead (its old group drains, as in any reload).

use kiln_worker_sdk::{Param, ParamValue, INSTANCES_PARAM};
use std::cmp::Ordering;

use std::sync::Arc;

use super::instances::{init_instances, load_failed, start_instances, teardown, Stage};
use super::{version_of, State};
use crate::error::{Result, ServerError};
use crate::group::{pool_bytes, resolve, WorkerGroup};
use crate::load::limits::Demand;
use crate::params::{identity, GroupParams};

impl State {
    /// Makes `endpoint` run `instances` instances.
    pub(super) fn scale(&mut self, endpoint: &str, instances: usize) -> Result<()> {
        if instances == 0 {
            return Err(ServerError::invalid(
                "`instances` must be at least 1 (unload a model to stop it)",
            ));
        }
        // A model served in several versions: its unversioned name's, the highest.
        let served = self
            .groups
            .get(endpoint)
            .cloned()
            .ok_or_else(|| ServerError::NotFound(format!("no model `{endpoint}` is loaded")))?;
        self.scale_group(served.scalable()?, instances)
    }

    /// Makes `group` (one version of a model) run `instances` instances.
    pub(super) fn scale_group(&mut self, group: &Arc<WorkerGroup>, instances: usize) -> Result<()> {
        let endpoint = group.endpoint.as_str();
        if group.scales_in_place().is_err() {
            return self.reload_with(group, instances);
        }
        let current = group.instance_count();
        let group_params = GroupParams::parse(&group.params)?;
        let asynchronous = group.settings.max_outstanding.is_some();
        let settings = resolve(&group.worker_info, &group_params, instances, asynchronous)?;
        match instances.cmp(&current) {
            Ordering::Equal => return Ok(()),
            Ordering::Less => group.shrink(current - instances, &settings)?,
            Ordering::Greater => {
                let added = instances - current;
                let now = group.demand();
                let wanted = Demand {
                    instances,
                    batcher_threads: now.batcher_threads,
                    buffer_bytes: pool_bytes(&group.worker_info, &settings),
                };
                let more = Demand {
                    instances: added,
                    batcher_threads: 0,
                    buffer_bytes: wanted.buffer_bytes.saturating_sub(now.buffer_bytes),
                };
                self.within_limits(endpoint, wanted, more)?;
                let worker = group.worker.as_str();
                let module = self.plugins.load(worker)?;
                if !self.runs(group, module) {
                    return Err(ServerError::invalid(format!(
                        "the library of worker `{worker}` changed since `{endpoint}` was \
                         loaded: load the model again to run the new build"
                    )));
                }
                let told = set_instances(&group.params, instances);
                let host = self.host_spec(worker, endpoint, &group_params)?;
                let (made, info) = init_instances(module, worker, host, &told, added)?;
                if info != *group.worker_info {
                    teardown(made, Stage::Initialized);
                    return Err(load_failed(
                        worker,
                        "the new instances describe themselves differently",
                    ));
                }
                let started = start_instances(worker, made, group.settings.batch_size)?;
                group.grow(started, &settings)?;
            }
        }
        spdlog::info!(
            "scaled `{endpoint}` from {current} to {instances} instance(s), {} buffer sets",
            settings.max_buffers
        );
        Ok(())
    }

    /// Scales a group that cannot scale in place: a new group with the new count
    /// takes the name and the old one drains.
    fn reload_with(&mut self, group: &WorkerGroup, instances: usize) -> Result<()> {
        if group.instance_count() == instances {
            return Ok(());
        }
        let (endpoint, worker) = (group.endpoint.clone(), group.worker.clone());
        let module = self.plugins.load(&worker)?;
        let params = set_instances(&group.params, instances);
        let group_params = GroupParams::parse(&params)?;
        let new = self.build_group(
            module,
            endpoint.clone(),
            &worker,
            identity(&params),
            &params,
            &group_params,
            &group.version,
        )?;
        self.replace(&endpoint, version_of(group), new, module);
        spdlog::info!("reloaded `{endpoint}` with {instances} instance(s)");
        Ok(())
    }
}

/// Whether two parameter sets differ at most in `instances`.
pub(super) fn same_but_instances(a: &[Param], b: &[Param]) -> bool {
    identity(&without_instances(a)) == identity(&without_instances(b))
}

fn without_instances(params: &[Param]) -> Vec<Param> {
    params
        .iter()
        .filter(|p| !p.key.as_str().eq_ignore_ascii_case(INSTANCES_PARAM))
        .cloned()
        .collect()
}

/// `params` with `instances` set to `n`.
fn set_instances(params: &[Param], n: usize) -> Vec<Param> {
    let mut params = without_instances(params);
    params.push(Param {
        key: INSTANCES_PARAM.into(),
        value: ParamValue::Int(i64::try_from(n).unwrap_or(i64::MAX)),
    });
    params
}
