//! The validation of protocol-free inference requests against a worker's declared
//! inputs and outputs. The requests and responses themselves are
//! [`kiln_protocol`]'s, re-exported here.

use kiln_worker_sdk::{tensor_byte_len, DataType, Shape, TensorSpec, WorkerInfo, MAX_RANK};

pub use kiln_protocol::{InferRequest, InferResponse, InputTensor, OutputTensor};

use crate::error::{Result, ServerError};

/// A request checked against a worker: inputs in declared order, rows counted, the
/// requested outputs as a bit mask over the declared outputs.
pub struct Validated {
    pub inputs: Vec<kiln_batchers::Tensor>,
    pub rows: usize,
    pub output_mask: u64,
}

/// Most outputs a worker may declare (the requested-output mask is a `u64`).
pub const MAX_OUTPUTS: usize = 64;

/// Checks names, datatypes, shapes and data sizes of `request` against `info`, with
/// `batch_size` the largest batch a request may carry.
pub fn validate(info: &WorkerInfo, batch_size: usize, request: InferRequest) -> Result<Validated> {
    let batching = info.max_batch_size > 0;
    for (i, input) in request.inputs.iter().enumerate() {
        if !info.inputs.iter().any(|s| s.name.as_str() == input.name) {
            return Err(ServerError::invalid(format!(
                "unknown input `{}`; the model takes {}",
                input.name,
                names(&info.inputs)
            )));
        }
        if request.inputs[..i].iter().any(|o| o.name == input.name) {
            return Err(ServerError::invalid(format!(
                "input `{}` is given twice",
                input.name
            )));
        }
    }
    let mut inputs = Vec::with_capacity(info.inputs.len());
    let mut rows = None;
    let mut given = request.inputs;
    for spec in info.inputs.iter() {
        let position = given
            .iter()
            .position(|t| t.name == spec.name.as_str())
            .ok_or_else(|| ServerError::invalid(format!("missing input `{}`", spec.name)))?;
        let tensor = given.swap_remove(position);
        let (shape, tensor_rows) = check_input(spec, batching, batch_size, &tensor)?;
        match rows {
            None => rows = Some(tensor_rows),
            Some(r) if r != tensor_rows => {
                return Err(ServerError::invalid(format!(
                    "input `{}` has batch dimension {tensor_rows} but other inputs have {r}",
                    spec.name
                )))
            }
            Some(_) => {}
        }
        inputs.push(kiln_batchers::Tensor {
            dtype: tensor.dtype,
            shape,
            data: tensor.data,
        });
    }
    let output_mask = match &request.outputs {
        None => u64::MAX,
        Some(wanted) => {
            let mut mask = 0u64;
            for name in wanted {
                let index = info
                    .outputs
                    .iter()
                    .position(|s| s.name.as_str() == name)
                    .ok_or_else(|| {
                        ServerError::invalid(format!(
                            "unknown output `{name}`; the model gives {}",
                            names(&info.outputs)
                        ))
                    })?;
                // As Triton: the same output requested twice is a bad request.
                if mask & (1 << index) != 0 {
                    return Err(ServerError::invalid(format!(
                        "output `{name}` is requested more than once"
                    )));
                }
                mask |= 1 << index;
            }
            mask
        }
    };
    Ok(Validated {
        inputs,
        rows: rows.unwrap_or(1),
        output_mask,
    })
}

fn check_input(
    spec: &TensorSpec,
    batching: bool,
    batch_size: usize,
    tensor: &InputTensor,
) -> Result<(Shape, usize)> {
    let name = &tensor.name;
    if tensor.dtype != spec.dtype {
        return Err(ServerError::invalid(format!(
            "input `{name}`: expected datatype {}, got {}",
            spec.dtype, tensor.dtype
        )));
    }
    // The shape expected is built for an error message only.
    let shape_error = || shape_error(name, &expected_shape(spec, batching), &tensor.shape);
    let shape = Shape::new(&tensor.shape)
        .filter(|_| tensor.shape.iter().all(|&d| d >= 0))
        .ok_or_else(|| {
            ServerError::invalid(format!(
                "input `{name}`: shape {:?} is invalid (at most {MAX_RANK} non-negative dims)",
                tensor.shape
            ))
        })?;
    let (inner, rows) = if batching {
        if shape.dims().is_empty() {
            return Err(shape_error());
        }
        (shape.inner(), shape.rows())
    } else {
        (shape, 1)
    };
    if !spec.accepts(inner.dims()) {
        return Err(shape_error());
    }
    if batching && (rows == 0 || rows > batch_size) {
        return Err(ServerError::invalid(format!(
            "input `{name}`: batch dimension {rows} is outside 1..={batch_size}"
        )));
    }
    let elements = shape.element_count();
    let needed = tensor_byte_len(tensor.dtype, elements, &tensor.data)
        .map_err(|e| ServerError::invalid(format!("input `{name}`: {e}")))?;
    if needed != tensor.data.len() {
        return Err(ServerError::invalid(format!(
            "input `{name}`: shape {:?} of {} needs {needed} bytes of data, got {}",
            tensor.shape,
            tensor.dtype,
            tensor.data.len()
        )));
    }
    // BOOL is one byte, 0 or 1 (binary and shared-memory data arrive unchecked).
    if tensor.dtype == DataType::Bool {
        if let Some(at) = tensor.data.iter().position(|&b| b > 1) {
            return Err(ServerError::invalid(format!(
                "input `{name}`: BOOL element {at} is {}, not 0 or 1",
                tensor.data[at]
            )));
        }
    }
    Ok((shape, rows))
}

/// The shape a client must send for `spec` (`-1` for the batch dim when batching).
pub fn expected_shape(spec: &TensorSpec, batching: bool) -> Vec<i64> {
    let mut dims = Vec::with_capacity(spec.dims.len() + 1);
    if batching {
        dims.push(-1);
    }
    dims.extend_from_slice(&spec.dims);
    dims
}

fn shape_error(name: &str, expected: &[i64], got: &[i64]) -> ServerError {
    ServerError::invalid(format!(
        "input `{name}`: expected shape {expected:?} (-1: any size), got {got:?}"
    ))
}

/// Tensor names as a message lists them: `` `a`, `b` ``.
pub(crate) fn names(specs: &[TensorSpec]) -> String {
    specs
        .iter()
        .map(|s| format!("`{}`", s.name))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use kiln_worker_sdk::BatcherKind;

    fn info() -> WorkerInfo {
        WorkerInfo {
            inputs: vec![
                TensorSpec::new("A", DataType::Fp32, &[2]),
                TensorSpec::new("B", DataType::Bytes, &[-1]),
            ]
            .into(),
            outputs: vec![TensorSpec::new("Y", DataType::Fp32, &[2])].into(),
            max_batch_size: 8,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: false,
        }
    }

    fn request(a_shape: &[i64], a: &[f32], b_shape: &[i64], b: &[u8]) -> InferRequest {
        InferRequest {
            model: "m".into(),
            inputs: vec![
                InputTensor {
                    name: "B".into(),
                    dtype: DataType::Bytes,
                    shape: b_shape.to_vec(),
                    data: Bytes::copy_from_slice(b),
                },
                InputTensor::from_slice("A", DataType::Fp32, a_shape, a),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn reorders_inputs_and_counts_rows() {
        let bytes = [1, 0, 0, 0, b'x', 0, 0, 0, 0];
        let v = validate(&info(), 8, request(&[2, 2], &[1.0; 4], &[2, 1], &bytes)).unwrap();
        assert_eq!(v.rows, 2);
        assert_eq!(v.inputs[0].dtype, DataType::Fp32);
        assert_eq!(v.inputs[1].dtype, DataType::Bytes);
        assert_eq!(v.output_mask, u64::MAX);
    }

    #[test]
    fn bool_elements_must_be_zero_or_one() {
        let info = WorkerInfo {
            inputs: vec![TensorSpec::new("F", DataType::Bool, &[3])].into(),
            ..info()
        };
        let request = |data: &'static [u8]| InferRequest {
            model: "m".into(),
            inputs: vec![InputTensor {
                name: "F".into(),
                dtype: DataType::Bool,
                shape: vec![1, 3],
                data: Bytes::from_static(data),
            }],
            ..Default::default()
        };
        assert!(validate(&info, 8, request(&[0, 1, 1])).is_ok());
        let err = validate(&info, 8, request(&[0, 2, 1]))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("BOOL element 1 is 2, not 0 or 1"), "{err}");
    }

    #[test]
    fn rejects_what_does_not_fit() {
        let bytes = [0u8; 4];
        let cases: Vec<(InferRequest, &str)> = vec![
            (
                request(&[1, 3], &[1.0; 3], &[1, 1], &bytes),
                "expected shape [-1, 2]",
            ),
            (request(&[2], &[1.0; 2], &[1, 1], &bytes), "expected shape"),
            (
                request(&[1, 2], &[1.0; 3], &[1, 1], &bytes),
                "needs 8 bytes",
            ),
            (
                request(&[9, 2], &[1.0; 18], &[9, 1], &[0u8; 36]),
                "outside 1..=8",
            ),
            (
                request(&[1, 2], &[1.0; 2], &[2, 1], &[0u8; 8]),
                "batch dimension 2 but",
            ),
            (
                request(&[1, 2], &[1.0; 2], &[1, 1], &[5, 0, 0, 0]),
                "cut short",
            ),
            (request(&[1, -2], &[], &[1, 1], &bytes), "invalid"),
        ];
        for (req, want) in cases {
            let err = validate(&info(), 8, req).err().unwrap().to_string();
            assert!(err.contains(want), "{err} should contain {want}");
        }
        let mut req = request(&[1, 2], &[1.0; 2], &[1, 1], &bytes);
        req.inputs[1].dtype = DataType::Fp64;
        assert!(validate(&info(), 8, req)
            .err()
            .unwrap()
            .to_string()
            .contains("expected datatype FP32"));
        let mut req = request(&[1, 2], &[1.0; 2], &[1, 1], &bytes);
        req.inputs[1].name = "C".into();
        assert!(validate(&info(), 8, req)
            .err()
            .unwrap()
            .to_string()
            .contains("unknown input `C`"));
        let mut req = request(&[1, 2], &[1.0; 2], &[1, 1], &bytes);
        req.inputs.pop();
        assert!(validate(&info(), 8, req)
            .err()
            .unwrap()
            .to_string()
            .contains("missing input `A`"));
        let mut req = request(&[1, 2], &[1.0; 2], &[1, 1], &bytes);
        req.outputs = Some(vec!["Z".into()]);
        assert!(validate(&info(), 8, req)
            .err()
            .unwrap()
            .to_string()
            .contains("unknown output `Z`"));
        let mut req = request(&[1, 2], &[1.0; 2], &[1, 1], &bytes);
        req.outputs = Some(vec!["Y".into(), "Y".into()]);
        assert!(validate(&info(), 8, req)
            .err()
            .unwrap()
            .to_string()
            .contains("output `Y` is requested more than once"));
    }
}
