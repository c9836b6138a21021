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
//! - [`run`]: one request in flight (the future behind its `serve::Pending`).
//!
//! An ensemble is a [`crate::group::WorkerGroup`] with an
//! [`crate::group::EnsembleSide`] and nothing of a worker's (no queue, pool or
//! thread), so lookup, metadata, readiness and statistics treat it as any model.

pub mod bind;
pub mod config;
pub mod plan;
pub mod run;
