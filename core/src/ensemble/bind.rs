//! Binding an ensemble's steps to the loaded models they run on, and what that
//! checks: each step's model is loaded (in the version the step names) and served
//! by a worker (not another ensemble); each of its inputs is read from exactly one
//! ensemble tensor and each mapped output is one of its outputs; and every tensor
//! has one datatype and a shape its writer and every reader agree on.
//!
//! Shapes are compared in full, with the batch dimension where a side has one:
//! an ensemble with `max_batch_size > 0` adds a leading `-1` to its declared dims,
//! as does a step model that batches. Two shapes agree when they have the same rank
//! and each dimension is equal or `-1` on either side.
//!
//! The Manager binds an ensemble when it is loaded (an error refuses the load) and
//! again whenever the loaded models change ([`crate::manager`]): a step model
//! unloaded, or replaced by one that no longer fits, leaves the ensemble loaded but
//! unavailable, with the reason, until a fitting model is loaded under that name.

use std::sync::Arc;

use kiln_worker_sdk::{DataType, TensorSpec};

use super::plan::{Plan, Producer};
use crate::group::WorkerGroup;
use crate::models::{Models, Served};

/// A tensor's datatype and full shape (batch dimension included).
type Signature = (DataType, Vec<i64>);

/// The groups `plan`'s steps run on, in step order, or why they cannot be bound.
pub fn bind(plan: &Plan, groups: &Models) -> Result<Vec<Arc<WorkerGroup>>, String> {
    let mut bound = Vec::with_capacity(plan.steps.len());
    for (s, step) in plan.steps.iter().enumerate() {
        let label = plan.step_label(s);
        let served = match &step.version {
            // A step naming a version runs that version, loaded beside others.
            Some(v) => v
                .parse()
                .ok()
                .and_then(|v| groups.version(&step.model, v))
                .or_else(|| groups.get(&step.model)),
            None => groups.get(&step.model),
        }
        .ok_or_else(|| format!("{label}: model `{}` is not loaded", step.model))?;
        let group = match served {
            Served::Group(group) => group,
            Served::Ensemble(_) => {
                return Err(format!(
                    "{label}: model `{}` is an ensemble; an ensemble's steps run models \
                     served by workers (nested ensembles are not supported)",
                    step.model
                ))
            }
        };
        if let Some(version) = &step.version {
            if *version != group.version {
                return Err(format!(
                    "{label}: model `{}` version {version} is not loaded (loaded: version {})",
                    step.model, group.version
                ));
            }
        }
        let known = |kind: &str, map: &[(String, usize)], specs: &[TensorSpec]| match map
            .iter()
            .find(|(name, _)| !specs.iter().any(|spec| spec.name.as_str() == name))
        {
            Some((name, tensor)) => Err(format!(
                "{label}: `{kind}_map` names `{name}` (for tensor `{}`), which is not an \
                     {kind} of model `{}` ({kind}s: {})",
                plan.tensors[*tensor],
                step.model,
                names(specs)
            )),
            None => Ok(()),
        };
        known("input", &step.inputs, &group.info.inputs)?;
        if let Some(spec) = group
            .info
            .inputs
            .iter()
            .find(|spec| !step.inputs.iter().any(|(i, _)| i == spec.name.as_str()))
        {
            return Err(format!(
                "{label}: input `{}` of model `{}` is not in the step's `input_map`: \
                 no tensor feeds it",
                spec.name, step.model
            ));
        }
        known("output", &step.outputs, &group.info.outputs)?;
        let ensemble_rows = plan.info.max_batch_size as usize;
        if ensemble_rows > 0
            && group.info.max_batch_size > 0
            && group.settings.batch_size < ensemble_rows
        {
            return Err(format!(
                "{label}: model `{}` takes at most {} rows a request (its batch_size), fewer \
                 than the ensemble's max_batch_size {ensemble_rows}",
                step.model, group.settings.batch_size
            ));
        }
        bound.push(Arc::clone(group));
    }
    check_signatures(plan, &bound)?;
    Ok(bound)
}

/// Every tensor's writer and readers agree on its datatype and shape; so do the
/// ensemble's declared inputs and outputs with the steps that read or write them.
fn check_signatures(plan: &Plan, bound: &[Arc<WorkerGroup>]) -> Result<(), String> {
    let ensemble_batches = plan.info.max_batch_size > 0;
    let spec_of = |s: usize, name: &str, outputs: bool| -> Option<Signature> {
        let info = &bound[s].info;
        let list = if outputs { &info.outputs } else { &info.inputs };
        list.iter()
            .find(|spec| spec.name.as_str() == name)
            .map(|spec| full(spec.dtype, &spec.dims, info.max_batch_size > 0))
    };
    // What writes each tensor, and its signature there.
    let mut written: Vec<(Signature, String)> = Vec::with_capacity(plan.tensors.len());
    for (id, producer) in plan.producers.iter().enumerate() {
        let entry = match *producer {
            Producer::Input(i) => {
                let spec = &plan.info.inputs[i];
                (
                    full(spec.dtype, &spec.dims, ensemble_batches),
                    format!("ensemble input `{}`", spec.name),
                )
            }
            Producer::Step(s) => {
                let output = plan.steps[s]
                    .outputs
                    .iter()
                    .find(|(_, t)| *t == id)
                    .map(|(o, _)| o.as_str())
                    .unwrap_or_default();
                let signature = spec_of(s, output, true)
                    .ok_or_else(|| format!("{}: no output `{output}`", plan.step_label(s)))?;
                (
                    signature,
                    format!("{} output `{output}`", plan.step_label(s)),
                )
            }
        };
        written.push(entry);
    }
    for (s, step) in plan.steps.iter().enumerate() {
        for (input, id) in &step.inputs {
            let wanted = spec_of(s, input, false)
                .ok_or_else(|| format!("{}: no input `{input}`", plan.step_label(s)))?;
            let (have, writer) = &written[*id];
            if !agree(&wanted, have) {
                return Err(format!(
                    "{} input `{input}` ({}) does not match tensor `{}` ({}), written by {writer}",
                    plan.step_label(s),
                    show(&wanted),
                    plan.tensors[*id],
                    show(have)
                ));
            }
        }
    }
    for (k, id) in plan.outputs.iter().enumerate() {
        let spec = &plan.info.outputs[k];
        let declared = full(spec.dtype, &spec.dims, ensemble_batches);
        let (have, writer) = &written[*id];
        if !agree(&declared, have) {
            return Err(format!(
                "ensemble output `{}` ({}) does not match tensor `{}` ({}), written by {writer}",
                spec.name,
                show(&declared),
                plan.tensors[*id],
                show(have)
            ));
        }
    }
    Ok(())
}

/// The full shape: a leading `-1` for the batch dimension when batching.
fn full(dtype: DataType, dims: &[i64], batching: bool) -> Signature {
    let mut shape = Vec::with_capacity(dims.len() + 1);
    if batching {
        shape.push(-1);
    }
    shape.extend_from_slice(dims);
    (dtype, shape)
}

fn agree(a: &Signature, b: &Signature) -> bool {
    a.0 == b.0
        && a.1.len() == b.1.len()
        && a.1
            .iter()
            .zip(&b.1)
            .all(|(&x, &y)| x == y || x < 0 || y < 0)
}

fn show((dtype, shape): &Signature) -> String {
    format!("{dtype} {shape:?}")
}

fn names(specs: &[TensorSpec]) -> String {
    specs
        .iter()
        .map(|s| format!("`{}`", s.name))
        .collect::<Vec<_>>()
        .join(", ")
}
