//! Ensembles: a repository model whose `config.toml` declares steps instead of a
//! worker (Triton's `platform: "ensemble"` and `ensemble_scheduling`). Each step
//! runs a loaded model, reading ensemble tensors into its inputs and writing its
//! outputs to ensemble tensors; steps run as soon as their inputs exist (a DAG),
//! each step's request admitted by its model's group like any other, so it batches
//! with every other request to that model. See `docs/pipelines.md`.
//!
//! - [`config`]: the `config.toml` form;
//! - [`plan`]: the graph checked from the configuration alone;
//! - [`bind`]: the steps bound to loaded models, datatypes and shapes checked;
//! - [`loaded`]: a loaded ensemble ([`Ensemble`]): its plan, its bound steps, its
//!   statistics, and nothing of a worker's (no queue, pool or thread);
//! - [`run`]: one request in flight (the future behind its `serve::Admitted`).
//!
//! A name serves a worker group or an ensemble ([`crate::models::Served`]); what
//! they share (name, version, tensors, readiness, statistics) is
//! [`crate::models::Model`], so lookup, metadata and statistics treat an ensemble
//! as any model, and what only a group has cannot be asked of an ensemble.

pub mod bind;
pub mod config;
pub mod loaded;
pub mod plan;
pub mod run;

pub use loaded::{Ensemble, StepGroups};
