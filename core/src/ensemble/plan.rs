//! An ensemble's graph, checked from its configuration alone: every tensor named
//! once as a producer (an ensemble input or one step's output), every tensor a
//! step reads produced, every ensemble output produced by a step, every ensemble
//! input read, and no cycle among the steps. What needs the step models themselves
//! (their tensors' names, datatypes and shapes) is checked when the steps are bound
//! to loaded models ([`super::bind`]).
//!
//! Steps are numbered from 1 in the order of the configuration; every error names
//! the ensemble, the step (its number and model) and the tensor.

use std::collections::HashMap;

use kiln_worker_sdk::{BatcherKind, TensorSpec, WorkerInfo};

use super::config::{EnsembleConfig, TensorConfig};
use crate::error::{Result, ServerError};

/// Who writes an ensemble tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Producer {
    /// The request: ensemble input `i`.
    Input(usize),
    /// Step `s` (0-based).
    Step(usize),
}

/// One step, its tensors resolved to the plan's tensor ids.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPlan {
    pub model: String,
    /// `None`: whichever version is loaded.
    pub version: Option<String>,
    /// (the step model's input, the tensor it reads).
    pub inputs: Vec<(String, usize)>,
    /// (the step model's output, the tensor it writes).
    pub outputs: Vec<(String, usize)>,
    /// Distinct tensors the step reads: it starts once all of them exist.
    pub needs: usize,
}

/// A checked ensemble graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub name: String,
    pub config: EnsembleConfig,
    /// The ensemble as clients see it: its declared inputs and outputs.
    pub info: WorkerInfo,
    /// Tensor id → name.
    pub tensors: Vec<String>,
    /// Tensor id → who writes it.
    pub producers: Vec<Producer>,
    /// Tensor id → the steps that read it (each once).
    pub consumers: Vec<Vec<usize>>,
    /// Ensemble output `k` → its tensor id.
    pub outputs: Vec<usize>,
    pub steps: Vec<StepPlan>,
}

impl Plan {
    /// "step 2 (model `b`)".
    pub fn step_label(&self, step: usize) -> String {
        let model = self.steps.get(step).map_or("?", |s| s.model.as_str());
        format!("step {} (model `{model}`)", step + 1)
    }

    /// Checks `config` as ensemble `name`'s graph.
    pub fn new(name: &str, config: EnsembleConfig) -> Result<Plan> {
        let fail = |message: String| ServerError::invalid(format!("ensemble `{name}`: {message}"));
        if config.steps.is_empty() {
            return Err(fail("`ensemble_scheduling.step` lists no step".into()));
        }
        if config.inputs.is_empty() || config.outputs.is_empty() {
            return Err(fail(
                "an ensemble declares at least one `input` and one `output`".into(),
            ));
        }
        check_declared(&config.inputs, &config.outputs).map_err(fail)?;
        let label = |s: usize| format!("step {} (model `{}`)", s + 1, config.steps[s].model_name);
        let mut ids: HashMap<&str, usize> = HashMap::new();
        let mut tensors = Vec::new();
        let mut producers = Vec::new();
        for (i, t) in config.inputs.iter().enumerate() {
            ids.insert(t.name.as_str(), tensors.len());
            tensors.push(t.name.clone());
            producers.push(Producer::Input(i));
        }
        let mut steps = Vec::with_capacity(config.steps.len());
        for (s, step) in config.steps.iter().enumerate() {
            crate::load::plugin::check_name(&step.model_name)
                .map_err(|e| fail(format!("{}: {e}", label(s))))?;
            if step.model_version < -1 {
                return Err(fail(format!(
                    "{}: model_version {} is neither -1 (latest) nor a version",
                    label(s),
                    step.model_version
                )));
            }
            if step.output_map.is_empty() {
                return Err(fail(format!("{}: `output_map` maps no output", label(s))));
            }
            let mut outputs = Vec::with_capacity(step.output_map.len());
            for (output, tensor) in &step.output_map {
                if let Some(&id) = ids.get(tensor.as_str()) {
                    let first = match producers[id] {
                        Producer::Input(_) => "the request (it is an ensemble input)".to_owned(),
                        Producer::Step(p) => label(p),
                    };
                    return Err(fail(format!(
                        "tensor `{tensor}` is produced twice: by {first} and by {} output `{output}`",
                        label(s)
                    )));
                }
                ids.insert(tensor.as_str(), tensors.len());
                outputs.push((output.clone(), tensors.len()));
                tensors.push(tensor.clone());
                producers.push(Producer::Step(s));
            }
            steps.push(StepPlan {
                model: step.model_name.clone(),
                version: (step.model_version >= 0).then(|| step.model_version.to_string()),
                inputs: Vec::new(),
                outputs,
                needs: 0,
            });
        }
        let mut consumers = vec![Vec::new(); tensors.len()];
        for (s, step) in config.steps.iter().enumerate() {
            for (input, tensor) in &step.input_map {
                let id = *ids.get(tensor.as_str()).ok_or_else(|| {
                    fail(format!(
                        "{} input `{input}` reads tensor `{tensor}`, which is neither an \
                         ensemble input nor any step's output",
                        label(s)
                    ))
                })?;
                steps[s].inputs.push((input.clone(), id));
                if !consumers[id].contains(&s) {
                    consumers[id].push(s);
                    steps[s].needs += 1;
                }
            }
        }
        let mut outputs = Vec::with_capacity(config.outputs.len());
        for t in &config.outputs {
            let id = *ids.get(t.name.as_str()).ok_or_else(|| {
                fail(format!(
                    "ensemble output `{}` is not produced by any step's `output_map`",
                    t.name
                ))
            })?;
            outputs.push(id);
        }
        for (i, t) in config.inputs.iter().enumerate() {
            if consumers[i].is_empty() {
                return Err(fail(format!(
                    "ensemble input `{}` is read by no step's `input_map`",
                    t.name
                )));
            }
        }
        let plan = Plan {
            name: name.to_owned(),
            info: WorkerInfo {
                inputs: specs(&config.inputs).into(),
                outputs: specs(&config.outputs).into(),
                max_batch_size: config.max_batch_size,
                batcher: BatcherKind::Hard,
                allow_ragged_batch: false,
            },
            config,
            tensors,
            producers,
            consumers,
            outputs,
            steps,
        };
        if let Some(cycle) = plan.cycle() {
            return Err(fail(format!("the steps form a cycle: {cycle}")));
        }
        Ok(plan)
    }

    /// A cycle among the steps, described, if there is one (Kahn's order leaves
    /// steps over; walking back from one of them along producers must come round).
    fn cycle(&self) -> Option<String> {
        let mut needs: Vec<usize> = self.steps.iter().map(|s| s.needs).collect();
        let mut ready: Vec<usize> = Vec::new();
        for (id, producer) in self.producers.iter().enumerate() {
            if matches!(producer, Producer::Input(_)) {
                self.release(id, &mut needs, &mut ready);
            }
        }
        let mut done = vec![false; self.steps.len()];
        while let Some(s) = ready.pop() {
            done[s] = true;
            for &(_, id) in &self.steps[s].outputs {
                self.release(id, &mut needs, &mut ready);
            }
        }
        let start = done.iter().position(|d| !d)?;
        // Each step left over reads a tensor written by another step left over.
        let mut path: Vec<(usize, usize)> = Vec::new();
        let mut at = start;
        loop {
            let (tensor, from) =
                self.steps[at]
                    .inputs
                    .iter()
                    .find_map(|&(_, id)| match self.producers[id] {
                        Producer::Step(p) if !done[p] => Some((id, p)),
                        _ => None,
                    })?;
            path.push((at, tensor));
            if let Some(i) = path.iter().position(|&(s, _)| s == from) {
                let links: Vec<String> = path[i..]
                    .iter()
                    .map(|&(s, tensor)| {
                        let writer = match self.producers[tensor] {
                            Producer::Step(p) => self.step_label(p),
                            Producer::Input(_) => "the request".to_owned(),
                        };
                        format!(
                            "{} reads `{}`, written by {writer}",
                            self.step_label(s),
                            self.tensors[tensor]
                        )
                    })
                    .collect();
                return Some(links.join("; "));
            }
            at = from;
        }
    }

    /// Tensor `id` exists: steps that now have every input become ready.
    fn release(&self, id: usize, needs: &mut [usize], ready: &mut Vec<usize>) {
        for &s in &self.consumers[id] {
            needs[s] -= 1;
            if needs[s] == 0 {
                ready.push(s);
            }
        }
    }
}

fn specs(tensors: &[TensorConfig]) -> Vec<TensorSpec> {
    tensors
        .iter()
        .map(|t| TensorSpec::new(&t.name, t.data_type, &t.dims))
        .collect()
}

/// Declared names: non-empty, each once, none both an input and an output.
fn check_declared(
    inputs: &[TensorConfig],
    outputs: &[TensorConfig],
) -> std::result::Result<(), String> {
    for (kind, list) in [("input", inputs), ("output", outputs)] {
        for (i, t) in list.iter().enumerate() {
            if t.name.is_empty() {
                return Err(format!("an ensemble {kind} has an empty name"));
            }
            if list[..i].iter().any(|o| o.name == t.name) {
                return Err(format!("ensemble {kind} `{}` is declared twice", t.name));
            }
            if kiln_worker_sdk::Shape::new(&t.dims).is_none() || t.dims.iter().any(|&d| d < -1) {
                return Err(format!(
                    "ensemble {kind} `{}`: dims {:?} are not a shape (at most {} dims, each -1 or ≥ 0)",
                    t.name,
                    t.dims,
                    kiln_worker_sdk::MAX_RANK
                ));
            }
        }
    }
    if let Some(t) = inputs
        .iter()
        .find(|t| outputs.iter().any(|o| o.name == t.name))
    {
        return Err(format!(
            "`{}` is declared both an ensemble input and an ensemble output",
            t.name
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::BTreeMap;

    use kiln_worker_sdk::DataType;

    use super::*;
    use crate::ensemble::config::StepConfig;

    fn tensor(name: &str) -> TensorConfig {
        TensorConfig {
            name: name.into(),
            data_type: DataType::Uint32,
            dims: vec![-1],
        }
    }

    fn step(model: &str, inputs: &[(&str, &str)], outputs: &[(&str, &str)]) -> StepConfig {
        let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        StepConfig {
            model_name: model.into(),
            model_version: -1,
            input_map: map(inputs),
            output_map: map(outputs),
        }
    }

    fn plan(steps: Vec<StepConfig>) -> Result<Plan> {
        Plan::new(
            "e",
            EnsembleConfig {
                max_batch_size: 0,
                inputs: vec![tensor("IN")],
                outputs: vec![tensor("OUT")],
                steps,
            },
        )
    }

    #[test]
    fn a_diamond_is_planned_with_its_readers() {
        let p = plan(vec![
            step("a", &[("x", "IN")], &[("y", "t")]),
            step("b", &[("x", "t")], &[("y", "u")]),
            step("c", &[("x", "t")], &[("y", "v")]),
            step("d", &[("x", "u"), ("z", "v")], &[("y", "OUT")]),
        ])
        .unwrap();
        assert_eq!(p.tensors, ["IN", "t", "u", "v", "OUT"]);
        // `t` is read by both branches; the join waits for two tensors.
        assert_eq!(p.consumers[1], [1, 2]);
        assert_eq!(p.steps[3].needs, 2);
        assert_eq!(p.producers[4], Producer::Step(3));
        assert_eq!(p.outputs, [4]);
        assert_eq!(p.steps[0].version, None);
    }

    #[test]
    fn a_step_reading_one_tensor_twice_waits_for_it_once() {
        let p = plan(vec![step(
            "a",
            &[("x", "IN"), ("z", "IN")],
            &[("y", "OUT")],
        )])
        .unwrap();
        assert_eq!(p.steps[0].needs, 1);
        assert_eq!(p.steps[0].inputs.len(), 2);
    }

    #[test]
    fn graph_errors_name_the_step_and_tensor() {
        let err = |steps| plan(steps).unwrap_err().to_string();
        let e = err(vec![
            step("a", &[("x", "IN")], &[("y", "t")]),
            step("b", &[("x", "IN")], &[("y", "t")]),
        ]);
        assert!(
            e.contains("tensor `t` is produced twice: by step 1 (model `a`) and by step 2 (model `b`) output `y`"),
            "{e}"
        );
        let e = err(vec![step("a", &[("x", "IN")], &[("y", "IN")])]);
        assert!(
            e.contains("tensor `IN` is produced twice: by the request"),
            "{e}"
        );
        let e = err(vec![step("a", &[("x", "IN")], &[("y", "t")])]);
        assert!(e.contains("ensemble output `OUT` is not produced"), "{e}");
        let e = err(vec![
            step("a", &[("x", "IN"), ("z", "v")], &[("y", "u")]),
            step("b", &[("x", "u")], &[("y", "v")]),
            step("c", &[("x", "u")], &[("y", "OUT")]),
        ]);
        assert!(
            e.contains("the steps form a cycle: step 1 (model `a`) reads `v`, written by step 2 (model `b`); step 2 (model `b`) reads `u`, written by step 1 (model `a`)"),
            "{e}"
        );
        let e = err(vec![step("a", &[("x", "IN")], &[])]);
        assert!(
            e.contains("step 1 (model `a`): `output_map` maps no output"),
            "{e}"
        );
        let e = err(vec![step("Bad Name", &[("x", "IN")], &[("y", "OUT")])]);
        assert!(e.contains("step 1 (model `Bad Name`)"), "{e}");
        let e = err(Vec::new());
        assert!(e.contains("lists no step"), "{e}");
    }
}
