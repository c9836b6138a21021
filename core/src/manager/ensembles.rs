//! The Manager's side of ensembles ([`crate::ensemble`]): loading one (its graph
//! checked, its steps bound to the loaded models), and binding every ensemble's
//! steps again whenever the loaded models change. An ensemble has no worker,
//! instance or thread: what it serves is its steps' models' groups.

use std::sync::Arc;

use super::State;
use crate::ensemble::bind::bind;
use crate::ensemble::config::EnsembleConfig;
use crate::ensemble::plan::Plan;
use crate::ensemble::Ensemble;
use crate::error::{Result, ServerError};
use crate::load::plugin::check_name;
use crate::models::Served;

impl State {
    /// Loads ensemble `name`: its graph checked ([`Plan::new`]) and its steps bound
    /// to the loaded models ([`bind`]), else refused (400) naming the step and
    /// tensor. The same graph and version already loaded is kept.
    pub(super) fn load_ensemble(
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
        if let Some(Served::Ensemble(loaded)) = self.groups.get(&name) {
            if *loaded.plan == plan && loaded.version == version {
                return Ok(name);
            }
        }
        let metrics = self.metrics.model(&name, &version);
        let ensemble = Ensemble::new(&version, plan, Ok(steps), metrics);
        // An ensemble serves one version: the one loaded last.
        let replaced = self.groups.remove(&name);
        self.groups
            .insert(&name, number, Served::Ensemble(Arc::new(ensemble)));
        self.publish();
        for old in replaced {
            old.drain();
            if old.version() != version {
                self.metrics.remove(&name, old.version());
            }
        }
        spdlog::info!("loaded ensemble `{name}` (version {version})");
        Ok(name)
    }

    /// Binds every ensemble's steps to the models loaded now, before they are
    /// published (a step's model unloaded or no longer fitting leaves its
    /// ensemble unavailable, with the reason, until a fitting one is loaded).
    pub(super) fn bind_ensembles(&self) {
        for ensemble in self.groups.ensembles() {
            let steps = bind(&ensemble.plan, &self.groups);
            let name = &ensemble.endpoint;
            match (&steps, ensemble.steps().as_ref()) {
                (Err(reason), Ok(_)) => spdlog::warn!("ensemble `{name}` is unavailable: {reason}"),
                (Ok(_), Err(_)) => spdlog::info!("ensemble `{name}` is available"),
                _ => {}
            }
            ensemble.rebind(steps);
        }
    }
}
