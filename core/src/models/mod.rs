//! The table of loaded models the Manager publishes: each name with every version
//! of it that is loaded, as Triton serves them (`model/1`, `model/2` side by side).
//! The unversioned name is the highest loaded version; a request naming a version
//! gets that one or a 404 ([`Models::find`]). What a version serves, a worker
//! group or an ensemble, is a [`Served`] ([`served`]).

mod served;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::ensemble::Ensemble;
use crate::error::{Result, ServerError};
use crate::group::WorkerGroup;

pub use served::{Model, Served, WeakServed};

/// Model name → its loaded versions (never empty), ascending.
#[derive(Clone, Default)]
pub struct Models {
    by_name: HashMap<String, BTreeMap<u64, Served>>,
}

impl Models {
    /// An empty table.
    pub fn new() -> Models {
        Models::default()
    }

    /// What the unversioned `name` serves: its highest loaded version.
    pub fn get(&self, name: &str) -> Option<&Served> {
        self.by_name
            .get(name)
            .and_then(|versions| versions.values().next_back())
    }

    /// Version `version` of `name`, if it is loaded.
    pub fn version(&self, name: &str, version: u64) -> Option<&Served> {
        self.by_name.get(name)?.get(&version)
    }

    /// The loaded versions of `name`, ascending (empty when it is not loaded).
    pub fn versions(&self, name: &str) -> impl Iterator<Item = (u64, &Served)> {
        self.by_name
            .get(name)
            .into_iter()
            .flat_map(|versions| versions.iter().map(|(v, g)| (*v, g)))
    }

    /// Whether any version of `name` is loaded.
    pub fn contains_key(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Every version of every model (in no order).
    pub fn values(&self) -> impl Iterator<Item = &Served> {
        self.by_name.values().flat_map(BTreeMap::values)
    }

    /// Every loaded worker group (in no order).
    pub fn groups(&self) -> impl Iterator<Item = &Arc<WorkerGroup>> {
        self.values().filter_map(Served::group)
    }

    /// Every loaded ensemble (in no order).
    pub fn ensembles(&self) -> impl Iterator<Item = &Arc<Ensemble>> {
        self.values().filter_map(Served::ensemble)
    }

    /// The loaded model names (in no order).
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.by_name.keys()
    }

    /// Puts `served` as version `version` of `name`; returns what it replaces.
    pub fn insert(&mut self, name: &str, version: u64, served: Served) -> Option<Served> {
        self.by_name
            .entry(name.to_owned())
            .or_default()
            .insert(version, served)
    }

    /// Takes version `version` of `name` out.
    pub fn remove_version(&mut self, name: &str, version: u64) -> Option<Served> {
        let versions = self.by_name.get_mut(name)?;
        let served = versions.remove(&version);
        if versions.is_empty() {
            self.by_name.remove(name);
        }
        served
    }

    /// Takes every version of `name` out, ascending.
    pub fn remove(&mut self, name: &str) -> Vec<Served> {
        self.by_name
            .remove(name)
            .map(|versions| versions.into_values().collect())
            .unwrap_or_default()
    }

    /// What serves `name` (as the table spells it, else in lower case): with
    /// `version`, that version or a 404 in Triton's words; without, the highest.
    pub fn find(&self, name: &str, version: Option<&str>) -> Result<&Served> {
        let (name, versions) = match self.by_name.get_key_value(name) {
            Some(found) => found,
            None => self
                .by_name
                .get_key_value(&name.to_ascii_lowercase())
                .ok_or_else(|| ServerError::NotFound(format!("no model `{name}` is loaded")))?,
        };
        match version {
            // Triton's clients send "" or "-1" for the latest.
            None | Some("" | "-1") => versions
                .values()
                .next_back()
                .ok_or_else(|| no_versions(name)),
            Some(wanted) => wanted
                .parse::<u64>()
                .ok()
                .and_then(|v| versions.get(&v))
                .ok_or_else(|| version_not_found(name, wanted)),
        }
    }
}

/// Triton's answer for a version that is not loaded (`model_lifecycle.cc`, with
/// the repository manager's prefix).
pub fn version_not_found(name: &str, version: &str) -> ServerError {
    ServerError::NotFound(format!(
        "Request for unknown model: '{name}' version {version} is not found"
    ))
}

fn no_versions(name: &str) -> ServerError {
    ServerError::NotFound(format!(
        "Request for unknown model: '{name}' has no available versions"
    ))
}
