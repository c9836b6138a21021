//! A group's settings: resolved from its load parameters and what the worker
//! accepts, and what they take of the machine (instances, batcher threads, the
//! buffer pool's memory) for the server-wide limits.

use std::num::NonZeroUsize;
use std::time::Duration;

use kiln_batchers::dynamic::DynamicConfig;
use kiln_worker_sdk::{BatcherKind, Shape, WorkerInfo};

use crate::error::{Result, ServerError};
use crate::group::sequence::SequenceParams;
use crate::load::limits::Demand;
use crate::params::GroupParams;
use crate::request::infer::MAX_OUTPUTS;

/// Settings a group runs with, resolved from parameters and the worker's info.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSettings {
    pub batch_size: usize,
    pub batcher: BatcherKind,
    pub timeout: Duration,
    /// Soft, no timeout: whether batches gather while the callers fall behind.
    pub gather: bool,
    pub batchers: usize,
    pub max_buffers: usize,
    /// The most buffer sets a scale up may grow the pool to (the Manager sets it
    /// from `--max-instances-per-model`; [`resolve`] leaves it `max_buffers`).
    pub buffer_capacity: usize,
    /// An asynchronous worker's `max_outstanding` (`None`: a synchronous worker).
    pub max_outstanding: Option<usize>,
    pub queue_size: usize,
    /// The dynamic batcher's settings (used when `batcher` is dynamic).
    pub dynamic: DynamicConfig,
    /// The sequence batcher's settings (used when `batcher` is sequence).
    pub sequence: SequenceParams,
    /// Client dims and reshapes of tensors ([`super::reshape`]).
    pub shapes: super::reshape::TensorShapes,
}

/// Resolves the group's settings against what the worker accepts (`asynchronous`:
/// the worker takes batches through `submit`).
pub fn resolve(
    info: &WorkerInfo,
    params: &GroupParams,
    instances: usize,
    asynchronous: bool,
) -> Result<GroupSettings> {
    if info.outputs.len() > MAX_OUTPUTS {
        return Err(ServerError::invalid(format!(
            "worker declares {} outputs; at most {MAX_OUTPUTS} are supported",
            info.outputs.len()
        )));
    }
    let max = info.max_batch_size as usize;
    let batch_size = match (max, params.batch_size.map(NonZeroUsize::get)) {
        (0, None) | (0, Some(1)) => 1,
        (0, Some(n)) => {
            return Err(ServerError::invalid(format!(
                "batch_size {n}: this worker does not batch (max_batch_size 0)"
            )))
        }
        (max, Some(n)) if n > max => {
            return Err(ServerError::invalid(format!(
                "batch_size {n} exceeds the worker's max_batch_size {max}"
            )))
        }
        (_, Some(n)) => n,
        (max, None) => max.min(64),
    };
    let batcher = params.batcher.unwrap_or(info.batcher);
    let max_outstanding = match (asynchronous, params.max_outstanding.map(NonZeroUsize::get)) {
        (false, None | Some(1)) => None,
        (false, Some(n)) => {
            return Err(ServerError::invalid(format!(
                "max_outstanding {n}: this worker is synchronous (one batch at a time per \
                 instance); the parameter is for asynchronous workers"
            )))
        }
        (true, _) if batcher == BatcherKind::Sequence => {
            return Err(ServerError::invalid(
                "the sequence batcher is not supported with an asynchronous worker",
            ))
        }
        (true, n) => Some(n.unwrap_or(1)),
    };
    // Each instance holds a set per batch it has out (one for a synchronous
    // worker) and one it is forming; one more lets a batcher start the next.
    let per_instance = max_outstanding.unwrap_or(1) + 1;
    let max_buffers = params
        .max_buffers
        .map_or(per_instance * instances + 1, NonZeroUsize::get);
    Ok(GroupSettings {
        batch_size,
        batcher,
        timeout: params.timeout,
        gather: params.gather,
        batchers: params.batchers.get(),
        max_buffers,
        buffer_capacity: max_buffers,
        max_outstanding,
        queue_size: params.queue_size.get(),
        dynamic: DynamicConfig {
            max_batch_size: batch_size,
            allow_ragged: info.allow_ragged_batch,
            ..params.dynamic.clone()
        },
        sequence: params.sequence.clone(),
        shapes: params.shapes.clone(),
    })
}

/// What a group of `instances` instances with `settings` would take of the machine.
pub fn demand(info: &WorkerInfo, settings: &GroupSettings, instances: usize) -> Demand {
    Demand {
        instances,
        batcher_threads: batcher_threads(settings),
        buffer_bytes: pool_bytes(info, settings),
    }
}

/// Batcher threads a group counts against the limits: `batchers` for hard and soft
/// (its formers: the instances form the batches, no thread of its own), one for
/// dynamic (its scheduler thread, or its one former when the config is plain) and
/// one for sequence (its former).
pub(super) fn batcher_threads(settings: &GroupSettings) -> usize {
    match settings.batcher {
        BatcherKind::Dynamic | BatcherKind::Sequence => 1,
        BatcherKind::Hard | BatcherKind::Soft => settings.batchers,
    }
}

/// The pool's memory at load: `max_buffers` sets of their initial sizes (buffers of
/// dynamic shapes grow with use beyond this).
pub fn pool_bytes(info: &WorkerInfo, settings: &GroupSettings) -> u64 {
    let (inputs, outputs) = buffer_capacities(info, settings.batch_size);
    let set: u64 = inputs.iter().chain(&outputs).map(|&b| b as u64).sum();
    set.saturating_mul(settings.max_buffers as u64)
}

/// Initial buffer sizes: a full batch of each fixed-size tensor; dynamic ones grow
/// on first use and keep their memory.
pub(super) fn buffer_capacities(info: &WorkerInfo, batch_size: usize) -> (Vec<usize>, Vec<usize>) {
    let bytes = |dims: &[i64], dtype: kiln_worker_sdk::DataType| -> usize {
        match (dtype.size(), dims.iter().all(|&d| d >= 0)) {
            (Some(size), true) => {
                Shape::new(dims).map_or(0, |s| s.element_count()) * size * batch_size
            }
            _ => 4096,
        }
    };
    (
        info.inputs
            .iter()
            .map(|s| bytes(&s.dims, s.dtype))
            .collect(),
        info.outputs
            .iter()
            .map(|s| bytes(&s.dims, s.dtype))
            .collect(),
    )
}
