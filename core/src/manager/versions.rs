//! Several versions of one repository model, served side by side as Triton
//! serves them: a load names the set of versions to serve (what the model's
//! `version_policy` picks, or the one version a load asks for), and the Manager
//! makes the loaded set that set in one published change:
//!
//! - a version loaded alike (worker, parameters, library) keeps its group;
//! - a version new or loaded otherwise gets a new group, which replaces the old
//!   one of that version (it takes the requests that reach the old one late);
//! - a loaded version no longer in the set drains; requests that reach it late go
//!   to the model's new highest version, so a client of the unversioned name never
//!   sees the swap (`tests/tests/upgrade.rs`, `tests/tests/versions.rs`).
//!
//! Every new group is built before anything is published: a failed build leaves
//! the served versions as they were.

use std::sync::Arc;

use kiln_worker_sdk::Param;

use super::{version_of, State};
use crate::error::{Result, ServerError};
use crate::group::WorkerGroup;
use crate::load::limits::Demand;
use crate::load::plugin::check_name;
use crate::load::triton_config::warmup::{self, Sample};
use crate::models::{version_not_found, Served};
use crate::params::{identity, GroupParams};

impl State {
    /// Serves exactly `wanted` (version, load parameters) of model `name`, run by
    /// `worker`; returns the name.
    pub(super) fn load_versions(
        &mut self,
        name: String,
        worker: &str,
        wanted: Vec<(u64, Vec<Param>)>,
        client_keys: &[String],
        fresh: bool,
        warmup: &[Sample],
    ) -> Result<String> {
        check_name(&name)?;
        check_name(worker)?;
        let Some((_, first)) = wanted.first() else {
            return Err(ServerError::invalid(format!(
                "at least one version must be available under the version policy of model '{name}'"
            )));
        };
        let subject = format!("model `{name}` (worker `{worker}`)");
        let module = self.plugin(worker, &subject, first, client_keys)?;
        let mut built: Vec<(u64, Arc<WorkerGroup>)> = Vec::new();
        let result = self
            .build_versions(&name, worker, module, &wanted, fresh, &mut built)
            .and_then(|()| {
                // Before any group takes the name: no client reaches an unwarmed one.
                built.iter().try_for_each(|(_, g)| warmup::run(g, warmup))
            });
        self.building = Demand::default();
        if let Err(e) = result {
            for (version, group) in built {
                group.drain();
                if self.groups.version(&name, version).is_none() {
                    self.metrics.remove(&name, &group.version);
                }
            }
            if !self.groups.contains_key(&name) {
                self.metrics.remove_model(&name);
            }
            return Err(e);
        }
        let was_latest = self.groups.get(&name).map(|s| version_of(&**s));
        let dropped: Vec<u64> = self
            .groups
            .versions(&name)
            .map(|(v, _)| v)
            .filter(|v| !wanted.iter().any(|(w, _)| w == v))
            .collect();
        if built.is_empty() && dropped.is_empty() {
            return Ok(name);
        }
        let mut replaced = Vec::new();
        for (version, group) in &built {
            let group = Served::Group(Arc::clone(group));
            if let Some(old) = self.groups.insert(&name, *version, group.clone()) {
                old.replaced_by(&group);
                replaced.push(old);
            }
            self.built_from
                .insert((name.clone(), *version), super::PluginId::of(module));
        }
        let mut gone = Vec::new();
        for version in dropped {
            if let Some(old) = self.groups.remove_version(&name, version) {
                self.built_from.remove(&(name.clone(), version));
                gone.push(old);
            }
        }
        // The unversioned name's clients may hold its old highest version: what
        // reaches it late goes to the new highest. A request for a dropped version
        // by number is refused, as the version is gone.
        if let Some(latest) = self.groups.get(&name) {
            for old in gone
                .iter()
                .filter(|s| Some(version_of(&***s)) == was_latest)
            {
                old.replaced_by(latest);
            }
        }
        self.publish();
        // The versions already serve their new groups; the old ones answer what
        // they took (and hand on what reaches them late).
        for old in replaced {
            old.drain();
        }
        for old in gone {
            old.drain();
            self.metrics.remove(&name, old.version());
            spdlog::info!("unloaded `{name}` version {}", old.version());
        }
        let serving: Vec<u64> = self.groups.versions(&name).map(|(v, _)| v).collect();
        spdlog::info!("model `{name}` serves version(s) {serving:?}");
        Ok(name)
    }

    /// Builds a group for each of `wanted` that is not loaded alike, into `built`
    /// (left there on failure, for the caller to take down).
    fn build_versions(
        &mut self,
        name: &str,
        worker: &str,
        module: kiln_worker_sdk::WorkerModRef,
        wanted: &[(u64, Vec<Param>)],
        fresh: bool,
        built: &mut Vec<(u64, Arc<WorkerGroup>)>,
    ) -> Result<()> {
        for (version, params) in wanted {
            let group_params = GroupParams::parse(params)?;
            let id = identity(params);
            // `fresh`: the model's files changed, whatever its parameters say.
            let running = self.groups.version(name, *version).cloned();
            if let Some(Served::Group(group)) = running.filter(|_| !fresh) {
                let same = group.worker == worker && group.identity == id;
                if same && self.runs(&group, module) {
                    continue;
                }
                // A reload whose only change is `instances` (Triton's
                // `instance_group` count) scales the running group.
                let same_but_instances = group.worker == worker
                    && super::scale::same_but_instances(&group.params, params)
                    && self.runs(&group, module);
                if same_but_instances && group.scales_in_place().is_ok() {
                    self.scale_group(&group, group_params.instances.get())?;
                    continue;
                }
            }
            let group = self.build_group(
                module,
                name.to_owned(),
                worker,
                id,
                params,
                &group_params,
                &version.to_string(),
            )?;
            // The next version's limits count this one: both will run.
            self.building = self.building + group.demand();
            built.push((*version, group));
        }
        Ok(())
    }

    /// Unloads version `version` of `endpoint` alone: the others serve on (the
    /// unversioned name moves to the highest one left).
    pub(super) fn unload_version(&mut self, endpoint: &str, version: u64) -> Result<()> {
        if !self.groups.contains_key(endpoint) {
            return Err(ServerError::NotFound(format!(
                "no model `{endpoint}` is loaded"
            )));
        }
        let served = self
            .groups
            .remove_version(endpoint, version)
            .ok_or_else(|| version_not_found(endpoint, &version.to_string()))?;
        self.built_from.remove(&(endpoint.to_owned(), version));
        // A request that took it as the unversioned name's just before goes to the
        // highest version left; one that asked for it by number is refused.
        let was_latest = self.groups.versions(endpoint).all(|(v, _)| v < version);
        if let Some(latest) = self.groups.get(endpoint).filter(|_| was_latest) {
            served.replaced_by(latest);
        }
        self.publish();
        served.drain();
        self.metrics.remove(endpoint, served.version());
        if !self.groups.contains_key(endpoint) {
            self.metrics.remove_model(endpoint);
        }
        spdlog::info!("unloaded `{endpoint}` version {}", version_of(&*served));
        Ok(())
    }
}
