//! `InferenceRequest.exec()` (Triton's BLS): a `model.py`'s call of another
//! model, made through the SDK's model calls, which the worker host relays to
//! the server's one inference path (the batch's deadline and cancellation apply).
//! The call is made on the thread that runs `execute`, holding the GIL: the
//! inputs' memory cannot change while the host copies it.

use std::time::Duration;

use kiln_worker_sdk::call::{self, CallErrorKind, CallInput, ModelCall};
use kiln_worker_sdk::DataType;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyList, PyTuple};

/// Triton's `TritonError` code for a failed call.
fn code(kind: CallErrorKind) -> i64 {
    match kind {
        CallErrorKind::Invalid => 3,
        CallErrorKind::NotFound => 2,
        CallErrorKind::Exhausted | CallErrorKind::Unavailable | CallErrorKind::Timeout => 4,
        CallErrorKind::Refused => 5,
        CallErrorKind::Cancelled => 7,
        CallErrorKind::Failed => 1,
    }
}

/// One input as `_kiln_exec` passes it: name, datatype, shape, bytes (a
/// C-contiguous buffer).
type Input<'py> = (String, String, Vec<i64>, Bound<'py, PyAny>);

/// Calls `model`; answers `(code, message)` when the call failed, else
/// `[(name, datatype, shape, bytearray)]`, one per output.
#[pyfunction]
pub fn kiln_call<'py>(
    py: Python<'py>,
    model: &str,
    inputs: Vec<Input<'py>>,
    outputs: Vec<String>,
    timeout_us: u64,
) -> PyResult<Bound<'py, PyAny>> {
    let buffers = inputs
        .iter()
        .map(|(_, _, _, data)| PyBuffer::<u8>::get(data))
        .collect::<PyResult<Vec<_>>>()?;
    let mut call_inputs = Vec::with_capacity(inputs.len());
    for ((name, dtype, shape, _), buffer) in inputs.iter().zip(&buffers) {
        let dtype = DataType::parse(dtype)
            .ok_or_else(|| PyValueError::new_err(format!("input `{name}`: datatype {dtype}")))?;
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "input `{name}`: not contiguous"
            )));
        }
        let data: &[u8] = match buffer.len_bytes() {
            0 => &[],
            // SAFETY: a C-contiguous buffer of `len_bytes` bytes, kept exported
            // (so its memory stays) until the call returns; the GIL is held, so
            // no Python code writes it meanwhile.
            len => unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, len) },
        };
        call_inputs.push(CallInput {
            name,
            dtype,
            shape,
            data,
        });
    }
    let answer = call::infer(&ModelCall {
        model,
        inputs: call_inputs,
        outputs: outputs.iter().map(String::as_str).collect(),
        for_request: None,
        timeout: (timeout_us > 0).then(|| Duration::from_micros(timeout_us)),
    });
    let outputs = match answer {
        Ok(outputs) => outputs,
        Err(e) => {
            let failed = (code(e.kind), e.message.as_str()).into_pyobject(py)?;
            return Ok(failed.into_any());
        }
    };
    let list = PyList::empty(py);
    for output in outputs {
        let shape = PyTuple::new(py, &output.shape)?;
        let data = PyByteArray::new(py, &output.data);
        list.append((output.name, output.dtype.as_str(), shape, data))?;
    }
    Ok(list.into_any())
}
