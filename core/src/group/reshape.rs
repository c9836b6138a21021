//! The shapes clients use where they differ from the model's: Triton's `dims`
//! (more precise than the model's dynamic dims) and `reshape` (the model takes or
//! gives another shape of the same elements), from the load parameters
//! `dims.<tensor>` and `reshape.<tensor>` (a `config.pbtxt`'s tensors,
//! [`crate::load::triton_config::map`]).
//!
//! [`TensorShapes::client_view`] turns the worker's description into the one
//! clients see (metadata, validation) and a [`Reshape`]: where a request's tensor
//! enters the group its shape becomes the model's ([`Reshape::inputs`]), where an
//! output leaves it, the client's ([`Reshape::output_dims`]). Only the shape
//! changes, never the bytes (row-major data of equal element count).

use std::collections::BTreeMap;

use kiln_worker_sdk::{Shape, WorkerInfo};

/// Client dims and model shapes by tensor name, without the batch dimension.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TensorShapes {
    /// `dims.<tensor>`: the dims clients see and send.
    pub dims: BTreeMap<String, Vec<i64>>,
    /// `reshape.<tensor>`: the model's shape of a tensor whose `dims` clients use.
    pub reshape: BTreeMap<String, Vec<i64>>,
}

/// What a group does to shapes at its edges (empty: nothing).
#[derive(Debug, Clone, Default)]
pub struct Reshape {
    /// By input index (as validated: the client's order), the model's shape.
    inputs: Vec<(usize, Shape)>,
    /// By output index of the worker, the client's dims of a reshaped output.
    outputs: Vec<Option<Shape>>,
}

impl TensorShapes {
    /// `client` (what clients would see without these shapes) with each named
    /// tensor's dims replaced by the client's, and the [`Reshape`] of the
    /// worker's (`worker`) outputs; the error names the tensor.
    pub fn client_view(
        &self,
        client: &WorkerInfo,
        worker: &WorkerInfo,
    ) -> Result<(WorkerInfo, Reshape), String> {
        if let Some(name) = self.reshape.keys().find(|n| !self.dims.contains_key(*n)) {
            return Err(format!(
                "`reshape.{name}` needs `dims.{name}`, the client's dims"
            ));
        }
        let mut view = client.clone();
        let mut reshape = Reshape {
            inputs: Vec::new(),
            outputs: vec![None; worker.outputs.len()],
        };
        for (name, dims) in &self.dims {
            let model_shape = self.reshape.get(name);
            let input = view.inputs.iter().position(|t| t.name.as_str() == name);
            let output = worker.outputs.iter().position(|t| t.name.as_str() == name);
            let spec = match (input, output) {
                (Some(i), None) => &mut view.inputs[i],
                (None, Some(_)) => {
                    match view.outputs.iter_mut().find(|t| t.name.as_str() == name) {
                        Some(spec) => spec,
                        // A stateful model's state output: not the client's.
                        None => continue,
                    }
                }
                (Some(_), Some(_)) => {
                    return Err(format!(
                        "`{name}` is both an input and an output of the model: kiln cannot \
                         tell which `dims.{name}` means"
                    ))
                }
                (None, None) => return Err(format!("the model has no tensor `{name}`")),
            };
            let at = |m: String| format!("`{name}`: {m}");
            let shape = |dims: &[i64]| {
                Shape::new(dims)
                    .filter(|_| dims.iter().all(|d| *d >= 0))
                    .ok_or_else(|| at(format!("{dims:?} is not a fixed shape")))
            };
            match model_shape {
                None if spec.accepts(dims) => spec.dims = dims.clone().into(),
                None => {
                    return Err(at(format!(
                        "the config's dims {dims:?} do not fit the model's {:?}",
                        spec.dims.to_vec()
                    )))
                }
                Some(model) => {
                    // kiln reshapes fixed shapes (Triton also matches dynamic dims).
                    let (client_shape, model_shape) = (shape(dims)?, shape(model)?);
                    if client_shape.element_count() != model_shape.element_count() {
                        return Err(at(format!(
                            "dims {dims:?} and reshape {model:?} hold different numbers of \
                             elements"
                        )));
                    }
                    if !spec.accepts(model) {
                        return Err(at(format!(
                            "reshape {model:?} does not fit the model's {:?}",
                            spec.dims.to_vec()
                        )));
                    }
                    spec.dims = dims.clone().into();
                    match (input, output) {
                        (Some(i), _) => reshape.inputs.push((i, model_shape)),
                        (_, Some(o)) => reshape.outputs[o] = Some(client_shape),
                        _ => {}
                    }
                }
            }
        }
        if reshape.outputs.iter().all(Option::is_none) {
            reshape.outputs.clear();
        }
        Ok((view, reshape))
    }
}

impl Reshape {
    /// Gives each reshaped input of a validated request (`inputs`, `batching`:
    /// they carry a batch dimension) the model's shape.
    pub fn inputs(&self, inputs: &mut [kiln_batchers::Tensor], batching: bool) {
        for (i, model) in &self.inputs {
            if let Some(t) = inputs.get_mut(*i) {
                t.shape = if batching {
                    model.with_batch(t.shape.rows()).unwrap_or(t.shape)
                } else {
                    *model
                };
            }
        }
    }

    /// The shape a client gets for worker output `index`, which the model gave
    /// as `shape` (`batching`: with a batch dimension); `None`: as it is.
    pub fn output_dims(&self, index: usize, shape: &Shape, batching: bool) -> Option<Shape> {
        let client = self.outputs.get(index)?.as_ref()?;
        if batching {
            client.with_batch(shape.rows())
        } else {
            Some(*client)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::{BatcherKind, DataType, TensorSpec};

    fn dims_of(spec: &TensorSpec) -> Vec<i64> {
        spec.dims.to_vec()
    }

    fn info() -> WorkerInfo {
        WorkerInfo {
            inputs: vec![TensorSpec::new("x", DataType::Fp32, &[4])].into(),
            outputs: vec![TensorSpec::new("y", DataType::Fp32, &[-1])].into(),
            max_batch_size: 8,
            batcher: BatcherKind::Dynamic,
            allow_ragged_batch: false,
        }
    }

    fn shapes(dims: &[(&str, &[i64])], reshape: &[(&str, &[i64])]) -> TensorShapes {
        let map =
            |l: &[(&str, &[i64])]| l.iter().map(|(n, d)| (n.to_string(), d.to_vec())).collect();
        TensorShapes {
            dims: map(dims),
            reshape: map(reshape),
        }
    }

    #[test]
    fn reshaped_tensors_show_the_clients_dims_and_change_shape_at_the_edges() {
        let s = shapes(
            &[("x", &[2, 2]), ("y", &[2, 2])],
            &[("x", &[4]), ("y", &[4])],
        );
        let (view, reshape) = s.client_view(&info(), &info()).unwrap();
        assert_eq!(dims_of(&view.inputs[0]), [2, 2]);
        assert_eq!(dims_of(&view.outputs[0]), [2, 2]);
        let mut inputs = [kiln_batchers::Tensor {
            dtype: DataType::Fp32,
            shape: Shape::new(&[3, 2, 2]).unwrap(),
            data: bytes::Bytes::new(),
        }];
        reshape.inputs(&mut inputs, true);
        assert_eq!(inputs[0].shape.dims(), [3, 4]);
        let out = reshape.output_dims(0, &Shape::new(&[3, 4]).unwrap(), true);
        assert_eq!(out.unwrap().dims(), [3, 2, 2]);
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused_by_tensor() {
        for (s, want) in [
            (
                shapes(&[("x", &[3, 2])], &[("x", &[4])]),
                "different numbers",
            ),
            (shapes(&[("x", &[2, 2])], &[("x", &[2, 2])]), "does not fit"),
            (shapes(&[("x", &[5])], &[]), "do not fit"),
            (shapes(&[], &[("x", &[4])]), "needs `dims.x`"),
            (shapes(&[("z", &[1])], &[]), "no tensor `z`"),
            (
                shapes(&[("x", &[-1, 4])], &[("x", &[4])]),
                "not a fixed shape",
            ),
        ] {
            let e = s.client_view(&info(), &info()).unwrap_err();
            assert!(e.contains(want), "{s:?}: {e}");
        }
    }

    #[test]
    fn dims_alone_narrow_what_clients_see() {
        let (view, reshape) = shapes(&[("y", &[7])], &[])
            .client_view(&info(), &info())
            .unwrap();
        assert_eq!(dims_of(&view.outputs[0]), [7]);
        assert!(reshape
            .output_dims(0, &Shape::new(&[1, 7]).unwrap(), true)
            .is_none());
    }
}
