//! The model's signature as kiln serves it, from the model's own and the load-time
//! parameters `batch_axis.<tensor>`, `input.<name>` and `max_batch_size`: which inputs
//! come from requests and which are constant, each tensor's batch axis, the dims
//! declared to kiln, and the largest batch.

use kiln_worker_sdk::{DataType, Param, Params, WorkerError};

use crate::axes;
use crate::constant::Constant;

/// Default largest batch for models with a batch dimension.
const DEFAULT_MAX_BATCH: i64 = 8;

/// The prefix of the batch-axis parameters.
const BATCH_AXIS: &str = "batch_axis.";

/// The prefix of the constant-input parameters.
const INPUT: &str = "input.";

/// One tensor as the model declares it.
pub struct ModelTensor {
    pub name: String,
    pub dtype: DataType,
    /// Dims, -1 for a dynamic one.
    pub dims: Vec<i64>,
}

/// One input or output served to kiln.
pub struct Tensor {
    pub name: String,
    pub dtype: DataType,
    /// The model's batch axis (0 unless `batch_axis.<name>` says otherwise); kiln sees
    /// it first.
    pub axis: usize,
    /// Dims declared to kiln: without the batch axis when batching.
    pub dims: Vec<i64>,
}

/// Where a model input's value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feed {
    /// kiln's input with this index (in [`Signature::inputs`]).
    Request(usize),
    /// The constant with this index (in [`Signature::constants`]).
    Constant(usize),
}

/// The served signature.
#[derive(Default)]
pub struct Signature {
    /// Inputs that requests carry, in the model's order.
    pub inputs: Vec<Tensor>,
    /// Every output, in the model's order.
    pub outputs: Vec<Tensor>,
    /// Inputs the worker feeds itself.
    pub constants: Vec<Constant>,
    /// For each model input, in the model's order, where its value comes from.
    pub feeds: Vec<Feed>,
    /// The largest batch; 0: no batching.
    pub max_batch_size: u32,
}

/// A `batch_axis.<tensor>` parameter.
struct AxisParam<'a> {
    key: &'a str,
    name: &'a str,
    axis: usize,
}

/// An `input.<name>` parameter.
struct ConstantParam<'a> {
    param: &'a Param,
    name: &'a str,
}

impl Signature {
    /// The signature of a model with these inputs and outputs under `params`.
    pub fn new(
        inputs: &[ModelTensor],
        outputs: &[ModelTensor],
        params: &Params<'_>,
    ) -> Result<Signature, WorkerError> {
        let (axis_params, constant_params) = parse(params)?;
        let (constants, constant_of) = constants(inputs, &constant_params)?;
        let (input_axes, output_axes) = batch_axes(inputs, outputs, &axis_params, &constant_of)?;
        let fed: Vec<usize> = (0..inputs.len())
            .filter(|&i| constant_of[i].is_none())
            .collect();
        if fed.is_empty() && !inputs.is_empty() {
            return Err(WorkerError::new(
                "every input of the model is a constant input (`input.<name>`): at least one \
                 must come from requests",
            ));
        }
        let served = |tensors: &[ModelTensor], index: &[usize], axes: &[usize]| -> Vec<Tensor> {
            index
                .iter()
                .map(|&i| Tensor {
                    name: tensors[i].name.clone(),
                    dtype: tensors[i].dtype,
                    axis: axes[i],
                    dims: tensors[i].dims.clone(),
                })
                .collect()
        };
        let all_outputs: Vec<usize> = (0..outputs.len()).collect();
        let mut served_inputs = served(inputs, &fed, &input_axes);
        let mut served_outputs = served(outputs, &all_outputs, &output_axes);
        let unbatchable = served_inputs
            .iter()
            .chain(&served_outputs)
            .find(|t| t.dims.get(t.axis) != Some(&-1));
        let max = max_batch_size(params, unbatchable, &axis_params)?;
        if max > 0 {
            for t in served_inputs.iter_mut().chain(served_outputs.iter_mut()) {
                t.dims.remove(t.axis);
            }
        }
        let mut next = 0;
        let feeds = constant_of
            .iter()
            .map(|c| match c {
                Some(k) => Feed::Constant(*k),
                None => {
                    next += 1;
                    Feed::Request(next - 1)
                }
            })
            .collect();
        Ok(Signature {
            inputs: served_inputs,
            outputs: served_outputs,
            constants,
            feeds,
            max_batch_size: max as u32,
        })
    }

    /// The constant inputs and moved batch axes, for the log: `; constant inputs: sr;
    /// batch axes: state 1, stateN 1` (empty when there are none).
    pub fn describe_options(&self) -> String {
        let mut text = String::new();
        if !self.constants.is_empty() {
            let names: Vec<&str> = self.constants.iter().map(|c| c.name.as_str()).collect();
            text.push_str(&format!("; constant inputs: {}", names.join(", ")));
        }
        let moved: Vec<String> = self
            .inputs
            .iter()
            .chain(&self.outputs)
            .filter(|t| t.axis != 0)
            .map(|t| format!("{} {}", t.name, t.axis))
            .collect();
        if !moved.is_empty() {
            text.push_str(&format!("; batch axes: {}", moved.join(", ")));
        }
        text
    }
}

/// `key` without `prefix` (matched case-insensitively), if it starts with it.
fn strip_prefix<'a>(key: &'a str, prefix: &str) -> Option<&'a str> {
    key.get(..prefix.len())
        .filter(|p| p.eq_ignore_ascii_case(prefix))
        .and_then(|_| key.get(prefix.len()..))
}

/// The `batch_axis.*` and `input.*` parameters.
fn parse<'a>(
    params: &Params<'a>,
) -> Result<(Vec<AxisParam<'a>>, Vec<ConstantParam<'a>>), WorkerError> {
    let mut axes = Vec::new();
    let mut constants = Vec::new();
    for param in params.0 {
        let key = param.key.as_str();
        if let Some(name) = strip_prefix(key, BATCH_AXIS) {
            let axis = Params(std::slice::from_ref(param))
                .int(key)?
                .unwrap_or_default();
            let axis = usize::try_from(axis).map_err(|_| {
                WorkerError::new(format!("`{key}` must be an axis (0 or more), got {axis}"))
            })?;
            axes.push(AxisParam {
                key,
                name: named(key, name)?,
                axis,
            });
        } else if let Some(name) = strip_prefix(key, INPUT) {
            constants.push(ConstantParam {
                param,
                name: named(key, name)?,
            });
        }
    }
    Ok((axes, constants))
}

fn named<'a>(key: &str, name: &'a str) -> Result<&'a str, WorkerError> {
    if name.is_empty() {
        return Err(WorkerError::new(format!("`{key}` names no tensor")));
    }
    Ok(name)
}

/// The index of the tensor called `name`: the exact name, else the only one that
/// matches ignoring ASCII case.
fn find(tensors: &[ModelTensor], name: &str) -> Option<usize> {
    if let Some(i) = tensors.iter().position(|t| t.name == name) {
        return Some(i);
    }
    let mut matches = tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| t.name.eq_ignore_ascii_case(name));
    match (matches.next(), matches.next()) {
        (Some((i, _)), None) => Some(i),
        _ => None,
    }
}

fn names(tensors: &[ModelTensor]) -> String {
    tensors
        .iter()
        .map(|t| format!("`{}`", t.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The constant inputs, and for each model input the index of its constant, if any.
fn constants(
    inputs: &[ModelTensor],
    params: &[ConstantParam<'_>],
) -> Result<(Vec<Constant>, Vec<Option<usize>>), WorkerError> {
    let mut constants = Vec::with_capacity(params.len());
    let mut constant_of = vec![None; inputs.len()];
    for p in params {
        let key = p.param.key.as_str();
        let i = find(inputs, p.name).ok_or_else(|| {
            WorkerError::new(format!(
                "`{key}`: the model has no input `{}` (inputs: {})",
                p.name,
                names(inputs)
            ))
        })?;
        if constant_of[i].is_some() {
            return Err(WorkerError::new(format!(
                "`{key}`: input `{}` is given a constant value twice",
                inputs[i].name
            )));
        }
        let input = &inputs[i];
        constant_of[i] = Some(constants.len());
        constants.push(Constant::new(
            &input.name,
            input.dtype,
            &input.dims,
            p.param,
        )?);
    }
    Ok((constants, constant_of))
}

/// Each model input's and output's batch axis.
fn batch_axes(
    inputs: &[ModelTensor],
    outputs: &[ModelTensor],
    params: &[AxisParam<'_>],
    constant_of: &[Option<usize>],
) -> Result<(Vec<usize>, Vec<usize>), WorkerError> {
    let mut input_axes: Vec<Option<usize>> = vec![None; inputs.len()];
    let mut output_axes: Vec<Option<usize>> = vec![None; outputs.len()];
    for p in params {
        let input = find(inputs, p.name);
        let output = find(outputs, p.name);
        if input.is_none() && output.is_none() {
            return Err(WorkerError::new(format!(
                "`{}`: the model has no input or output `{}` (inputs: {}; outputs: {})",
                p.key,
                p.name,
                names(inputs),
                names(outputs)
            )));
        }
        if let Some(i) = input {
            if constant_of[i].is_some() {
                return Err(WorkerError::new(format!(
                    "`{}`: input `{}` is a constant input (`input.{}`), which has no batch axis",
                    p.key, inputs[i].name, inputs[i].name
                )));
            }
            set_axis(&mut input_axes[i], &inputs[i], p)?;
        }
        if let Some(o) = output {
            set_axis(&mut output_axes[o], &outputs[o], p)?;
        }
    }
    let or_first =
        |axes: Vec<Option<usize>>| axes.into_iter().map(Option::unwrap_or_default).collect();
    Ok((or_first(input_axes), or_first(output_axes)))
}

/// Checks `p` against `tensor` and records its axis.
fn set_axis(
    slot: &mut Option<usize>,
    tensor: &ModelTensor,
    p: &AxisParam<'_>,
) -> Result<(), WorkerError> {
    if slot.is_some() {
        return Err(WorkerError::new(format!(
            "`{}`: the batch axis of `{}` is given twice",
            p.key, tensor.name
        )));
    }
    let rank = tensor.dims.len();
    if p.axis >= rank {
        return Err(WorkerError::new(format!(
            "`{}` = {}: `{}` has rank {rank} (dims {:?}), so its batch axis must be below {rank}",
            p.key, p.axis, tensor.name, tensor.dims
        )));
    }
    if p.axis != 0 {
        axes::element_size(&tensor.name, tensor.dtype)
            .map_err(|e| WorkerError::new(format!("`{}`: {e}", p.key)))?;
    }
    *slot = Some(p.axis);
    Ok(())
}

/// Why `t` cannot be batched on its batch axis.
fn not_batchable(t: &Tensor) -> String {
    let hint = if t.axis == 0 {
        format!(
            " (set `batch_axis.{}` if its batch axis is another)",
            t.name
        )
    } else {
        String::new()
    };
    format!(
        "`{}` has dims {:?}, whose axis {} is not dynamic{hint}",
        t.name, t.dims, t.axis
    )
}

/// `max_batch_size`: the parameter, else `default_max_batch_size` (8 unless set;
/// a `config.pbtxt` auto-completed as Triton does sets Triton's 4) when the model
/// can batch, else 0.
fn max_batch_size(
    params: &Params<'_>,
    unbatchable: Option<&Tensor>,
    axis_params: &[AxisParam<'_>],
) -> Result<i64, WorkerError> {
    let max = match params.int("max_batch_size")? {
        Some(n) if !(0..=4096).contains(&n) => {
            return Err(WorkerError::new(format!(
                "`max_batch_size` must be in 0..=4096, got {n}"
            )))
        }
        Some(n) => n,
        None if unbatchable.is_none() => match params.int("default_max_batch_size")? {
            Some(n) if !(1..=4096).contains(&n) => {
                return Err(WorkerError::new(format!(
                    "`default_max_batch_size` must be in 1..=4096, got {n}"
                )))
            }
            Some(n) => n,
            None => DEFAULT_MAX_BATCH,
        },
        None => 0,
    };
    match (max, unbatchable, axis_params.first()) {
        (1.., Some(t), _) => Err(WorkerError::new(format!(
            "this model has no batch dimension: {}; set max_batch_size 0",
            not_batchable(t)
        ))),
        (0, Some(t), Some(p)) => Err(WorkerError::new(format!(
            "`{}` is set but the model does not batch: {}",
            p.key,
            not_batchable(t)
        ))),
        (0, None, Some(p)) => Err(WorkerError::new(format!(
            "`{}` is set but max_batch_size is 0: a batch axis needs batching",
            p.key
        ))),
        _ => Ok(max),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::params_from_pairs;

    fn tensor(name: &str, dtype: DataType, dims: &[i64]) -> ModelTensor {
        ModelTensor {
            name: name.to_owned(),
            dtype,
            dims: dims.to_vec(),
        }
    }

    /// Silero VAD's signature.
    fn silero() -> (Vec<ModelTensor>, Vec<ModelTensor>) {
        (
            vec![
                tensor("input", DataType::Fp32, &[-1, -1]),
                tensor("state", DataType::Fp32, &[2, -1, 128]),
                tensor("sr", DataType::Int64, &[]),
            ],
            vec![
                tensor("output", DataType::Fp32, &[-1, 1]),
                tensor("stateN", DataType::Fp32, &[-1, -1, -1]),
            ],
        )
    }

    fn signature(
        inputs: &[ModelTensor],
        outputs: &[ModelTensor],
        pairs: &[(&str, &str)],
    ) -> Result<Signature, String> {
        let params = params_from_pairs(pairs);
        Signature::new(inputs, outputs, &Params(&params)).map_err(|e| e.0)
    }

    fn dims(tensors: &[Tensor]) -> Vec<(&str, usize, &[i64])> {
        tensors
            .iter()
            .map(|t| (t.name.as_str(), t.axis, t.dims.as_slice()))
            .collect()
    }

    #[test]
    fn silero_batched_with_moved_axes_and_constant_sr() {
        let (inputs, outputs) = silero();
        let s = signature(
            &inputs,
            &outputs,
            &[
                ("max_batch_size", "64"),
                ("INPUT.sr", "16000"),
                ("batch_axis.state", "1"),
                ("Batch_Axis.staten", "1"),
            ],
        )
        .unwrap();
        assert_eq!(s.max_batch_size, 64);
        assert_eq!(
            dims(&s.inputs),
            vec![("input", 0, &[-1][..]), ("state", 1, &[2, 128][..])]
        );
        assert_eq!(
            dims(&s.outputs),
            vec![("output", 0, &[1][..]), ("stateN", 1, &[-1, -1][..])]
        );
        assert_eq!(
            s.feeds,
            vec![Feed::Request(0), Feed::Request(1), Feed::Constant(0)]
        );
        assert_eq!(s.constants[0].data.as_slice(), &16000i64.to_le_bytes());
        assert_eq!(
            s.describe_options(),
            "; constant inputs: sr; batch axes: state 1, stateN 1"
        );
        // Without max_batch_size, the default.
        let s = signature(
            &inputs,
            &outputs,
            &[
                ("input.sr", "8000"),
                ("batch_axis.state", "1"),
                ("batch_axis.stateN", "1"),
            ],
        )
        .unwrap();
        assert_eq!(s.max_batch_size, 8);
        // Triton's auto-completion default, and `max_batch_size` still wins over it.
        let batchable = [
            ("input.sr", "8000"),
            ("batch_axis.state", "1"),
            ("batch_axis.stateN", "1"),
        ];
        let with = |extra: &[(&str, &str)]| {
            let pairs: Vec<(&str, &str)> = batchable.iter().chain(extra).copied().collect();
            signature(&inputs, &outputs, &pairs).map(|s| s.max_batch_size)
        };
        assert_eq!(with(&[("default_max_batch_size", "4")]).unwrap(), 4);
        let both = [("default_max_batch_size", "4"), ("max_batch_size", "16")];
        assert_eq!(with(&both).unwrap(), 16);
        assert!(with(&[("default_max_batch_size", "0")]).is_err());
        // A model that cannot batch stays at 0 whatever the default.
        let s = signature(&inputs, &outputs, &[("default_max_batch_size", "4")]).unwrap();
        assert_eq!(s.max_batch_size, 0);
    }

    #[test]
    fn unbatchable_models_keep_their_dims() {
        let (inputs, outputs) = silero();
        let s = signature(&inputs, &outputs, &[]).unwrap();
        assert_eq!(s.max_batch_size, 0);
        assert_eq!(s.inputs.len(), 3);
        assert_eq!(s.inputs[1].dims, vec![2, -1, 128]);
        // A constant scalar does not stop batching on its own.
        let s = signature(&inputs, &outputs, &[("input.sr", "16000")]).unwrap();
        assert_eq!(s.max_batch_size, 0, "state's first dim is static");
        let e = signature(
            &inputs,
            &outputs,
            &[("input.sr", "16000"), ("max_batch_size", "4")],
        )
        .err()
        .unwrap_or_default();
        assert!(
            e.contains("`state` has dims [2, -1, 128], whose axis 0"),
            "{e}"
        );
    }

    #[test]
    fn refuses_bytes_unknown_names_and_bad_axes() {
        let inputs = vec![
            tensor("text", DataType::Bytes, &[3, -1]),
            tensor("x", DataType::Fp32, &[-1, 4]),
        ];
        let outputs = vec![tensor("y", DataType::Fp32, &[-1, 4])];
        let e = signature(&inputs, &outputs, &[("batch_axis.text", "1")])
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("`batch_axis.text`") && e.contains("BYTES") && e.contains("fixed size"),
            "{e}"
        );
        let e = signature(&inputs, &outputs, &[("batch_axis.z", "0")])
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("no input or output `z` (inputs: `text`, `x`; outputs: `y`)"),
            "{e}"
        );
        let e = signature(&inputs, &outputs, &[("batch_axis.", "0")])
            .err()
            .unwrap_or_default();
        assert!(e.contains("names no tensor"), "{e}");
        let e = signature(&inputs, &outputs, &[("batch_axis.y", "2")])
            .err()
            .unwrap_or_default();
        assert!(e.contains("rank 2"), "{e}");
        let e = signature(
            &inputs,
            &outputs,
            &[("batch_axis.y", "1"), ("batch_axis.Y", "0")],
        )
        .err()
        .unwrap_or_default();
        assert!(e.contains("given twice"), "{e}");
        let e = signature(&inputs, &outputs, &[("input.x", "1")])
            .err()
            .unwrap_or_default();
        assert!(e.contains("fixed shape"), "{e}");
        let e = signature(&inputs[1..], &outputs, &[("input.x", "1")]);
        assert!(e.is_err());
    }

    #[test]
    fn names_match_exactly_first_then_ignoring_case() {
        let inputs = vec![
            tensor("a", DataType::Fp32, &[-1]),
            tensor("A", DataType::Fp32, &[-1]),
            tensor("Bb", DataType::Fp32, &[-1]),
        ];
        assert_eq!(find(&inputs, "A"), Some(1));
        assert_eq!(find(&inputs, "bb"), Some(2));
        assert_eq!(find(&inputs, "c"), None);
        let ambiguous = [
            tensor("ab", DataType::Fp32, &[]),
            tensor("AB", DataType::Fp32, &[]),
        ];
        assert_eq!(find(&ambiguous, "Ab"), None);
    }
}
