//! `python`: runs a `model.py` written for Triton's python backend, unmodified
//! (`class TritonPythonModel` with `initialize(args)`, `execute(requests)`,
//! `finalize()`), in an interpreter embedded with PyO3.
//!
//! - One interpreter per instance, each in its own `kiln worker-host` process
//!   (`isolation = "process"` is required): instances share no GIL, and a crash of
//!   the interpreter (`os._exit`, a segfault in a C extension) costs its batch only.
//! - A batch is handed to `execute` as a list of requests, one per client request;
//!   inputs are read-only numpy views of the batch's shared memory (no copy);
//!   each output is copied once into the batch's output memory.
//! - `InferenceResponse(error=...)` fails its request alone (400 for
//!   `TritonError.INVALID_ARG`, else 500); an exception, or a wrong number of
//!   responses, fails the batch.
//! - [`signature`]: the tensors and Triton's model config from `config.toml`;
//!   [`interpreter`]: starting the interpreter with the operator's environment;
//!   [`bls`]: `InferenceRequest.exec()`, calls of other models;
//!   `triton_python_backend_utils.py`: the module `model.py` imports.

mod bls;
mod interpreter;
mod signature;

use std::ffi::CString;
use std::path::{Path, PathBuf};

use kiln_worker_sdk::{
    export_worker, tensor_byte_len, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params,
    RequestError, Shape, Worker, WorkerError, WorkerInfo,
};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use signature::Signature;

/// The module's source, registered as `triton_python_backend_utils`.
const UTILS: &str = include_str!("triton_python_backend_utils.py");

/// Debian's interpreter: its `dist-packages` (python3-numpy) serve by default.
const DEFAULT_PYTHON: &str = "/usr/bin/python3";

/// The operator's interpreter for models that name none (a `config.pbtxt` cannot):
/// Triton's python backend takes its environment from the server's, so kiln's does
/// too. Worker hosts get the server's `KILN_*` variables.
const PYTHON_ENV: &str = "KILN_PYTHON";

/// Triton's `TritonError.INVALID_ARG`: the one code answered 400.
const INVALID_ARG: i64 = 3;

/// The python worker: the model object and the utils module's entry points.
pub struct PythonWorker {
    signature: Signature,
    model: Py<PyAny>,
    utils: Py<PyModule>,
    /// `[(name, datatype)]` of the outputs, as `_kiln_execute` takes them.
    outputs: Py<PyAny>,
    /// The output names, as each request's `requested_output_names` (a tuple).
    output_names: Py<PyAny>,
}

impl Worker for PythonWorker {
    const PARAMETERS: &'static [ParamSpec] = &[
        // An interpreter (or a virtualenv's): a program on the machine.
        ParamSpec::operator("python"),
        ParamSpec::load(
            "max_batch_size",
            ParamKind::Int {
                min: 0,
                max: 1 << 20,
            },
        ),
        ParamSpec::load("input.*", ParamKind::Any),
        ParamSpec::load("output.*", ParamKind::Any),
        ParamSpec::load("parameters.*", ParamKind::Any),
        ParamSpec::load("model_config", ParamKind::Any),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        if params.string("isolation").as_deref() != Some("process") {
            return Err(
                "the python worker runs each instance's interpreter in its own \
                 process: load it with isolation = \"process\""
                    .into(),
            );
        }
        let signature = Signature::from_params(params)?;
        let model_dir = PathBuf::from(
            params
                .string("model_dir")
                .ok_or("the python worker serves a model repository's model.py: no model_dir")?,
        );
        let python = params
            .string("python")
            .or_else(|| std::env::var(PYTHON_ENV).ok().filter(|p| !p.is_empty()))
            .unwrap_or_else(|| DEFAULT_PYTHON.into());
        interpreter::start(Path::new(&python))?;
        let instances = params.int("instances")?.unwrap_or(1);
        Python::attach(|py| load(py, signature, &model_dir, instances))
            .map_err(|e| WorkerError::new(e.to_string()))
    }

    fn info(&self) -> WorkerInfo {
        WorkerInfo {
            inputs: self.signature.inputs.clone().into(),
            outputs: self.signature.outputs.clone().into(),
            max_batch_size: self.signature.max_batch_size,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: false,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        Python::attach(|py| self.run_batch(py, batch))
    }
}

impl Drop for PythonWorker {
    fn drop(&mut self) {
        Python::attach(|py| {
            let model = self.model.bind(py);
            if model.hasattr("finalize").unwrap_or(false) {
                if let Err(e) = model.call_method0("finalize") {
                    log::error!("finalize() failed: {}", described(py, &e));
                }
            }
        });
    }
}

/// Registers the utils module, imports `model.py`, completes the config with the
/// model's `auto_complete_config` if it has one, and calls `initialize(args)`.
fn load(
    py: Python<'_>,
    mut signature: Signature,
    model_dir: &Path,
    instances: i64,
) -> Result<PythonWorker, String> {
    let failed = |what: &str, e: PyErr| format!("{what}: {}", described(py, &e));
    let source = CString::new(UTILS).map_err(|e| e.to_string())?;
    let utils = PyModule::from_code(
        py,
        &source,
        c"triton_python_backend_utils.py",
        c"triton_python_backend_utils",
    )
    .map_err(|e| failed("triton_python_backend_utils (is numpy installed?)", e))?;
    let set_up = || -> PyResult<Bound<'_, PyAny>> {
        utils.setattr("_kiln_log", wrap_pyfunction!(kiln_log, &utils)?)?;
        utils.setattr("_kiln_call", wrap_pyfunction!(bls::kiln_call, &utils)?)?;
        let sys = py.import("sys")?;
        sys.getattr("modules")?
            .set_item("triton_python_backend_utils", &utils)?;
        // model.py's own imports find the files beside it, as under Triton.
        let dir = model_dir.to_string_lossy().into_owned();
        sys.getattr("path")?.call_method1("insert", (0, dir))?;
        let file = model_dir.join("model.py").to_string_lossy().into_owned();
        let util = py.import("importlib.util")?;
        let spec = util.call_method1("spec_from_file_location", ("model", file))?;
        let module = util.call_method1("module_from_spec", (&spec,))?;
        spec.getattr("loader")?
            .call_method1("exec_module", (&module,))?;
        module.getattr("TritonPythonModel")
    };
    let class = set_up().map_err(|e| failed(&format!("{}/model.py", model_dir.display()), e))?;
    let version_dir = model_dir
        .canonicalize()
        .unwrap_or_else(|_| model_dir.into());
    let repository = version_dir.parent().unwrap_or(&version_dir);
    let name = repository
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let version = version_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if class.hasattr("auto_complete_config").unwrap_or(false) {
        let completed: String = utils
            .getattr("_kiln_auto_complete")
            .and_then(|f| f.call1((&class, signature.model_config(&name, instances))))
            .and_then(|c| c.extract())
            .map_err(|e| failed("auto_complete_config()", e))?;
        signature.complete(&completed)?;
    }
    signature.check()?;
    let model = class
        .call0()
        .map_err(|e| failed("TritonPythonModel()", e))?;
    let args = PyDict::new(py);
    let fill = || -> PyResult<()> {
        args.set_item("model_config", signature.model_config(&name, instances))?;
        args.set_item("model_instance_kind", "CPU")?;
        args.set_item("model_instance_name", format!("{name}_0"))?;
        args.set_item("model_instance_device_id", "0")?;
        args.set_item("model_repository", repository.to_string_lossy().as_ref())?;
        args.set_item("model_version", version.as_str())?;
        args.set_item("model_name", name.as_str())?;
        Ok(())
    };
    fill().map_err(|e| failed("initialize arguments", e))?;
    if model.hasattr("initialize").unwrap_or(false) {
        model
            .call_method1("initialize", (args,))
            .map_err(|e| failed("initialize()", e))?;
    }
    let outputs: Vec<(String, &str)> = signature
        .outputs
        .iter()
        .map(|t| (t.name.to_string(), t.dtype.as_str()))
        .collect();
    let output_names =
        PyTuple::new(py, outputs.iter().map(|(name, _)| name)).map_err(|e| failed("outputs", e))?;
    let outputs = outputs
        .into_pyobject(py)
        .map_err(|e| failed("outputs", e))?;
    Ok(PythonWorker {
        signature,
        model: model.unbind(),
        utils: utils.unbind(),
        outputs: outputs.into_any().unbind(),
        output_names: output_names.into_any().unbind(),
    })
}

/// What `_kiln_execute` answered for one request.
enum Answer {
    Failed(RequestError),
    Outputs(Vec<(Shape, PyBuffer<u8>)>),
}

impl PythonWorker {
    fn run_batch(&self, py: Python<'_>, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let utils = self.utils.bind(py);
        let requests = self.requests(py, batch)?;
        let answers = utils
            .getattr("_kiln_execute")
            .and_then(|f| f.call1((self.model.bind(py), &requests, self.outputs.bind(py))))
            .map_err(|e| WorkerError::new(described(py, &e)))?;
        let mut parsed = Vec::with_capacity(batch.request_count());
        for answer in answers.try_iter().map_err(|e| batch_error(py, e))? {
            parsed.push(read_answer(&answer.map_err(|e| batch_error(py, e))?));
        }
        // Failed requests still get (zero-filled) outputs of a plausible shape.
        let rows: Vec<usize> = match batch.input(0) {
            Ok(input) if self.signature.max_batch_size > 0 => {
                input.shapes().iter().map(Shape::rows).collect()
            }
            _ => vec![1; batch.request_count()],
        };
        for (index, spec) in self.signature.outputs.iter().enumerate() {
            let mut shapes = Vec::with_capacity(parsed.len());
            let mut sizes = Vec::with_capacity(parsed.len());
            for (request, answer) in parsed.iter().enumerate() {
                let (shape, size) = match answer {
                    Answer::Outputs(outputs) => (outputs[index].0, outputs[index].1.len_bytes()),
                    Answer::Failed(_) => {
                        let shape = placeholder(spec, self.signature.max_batch_size, rows[request]);
                        // A BYTES element of length 0 is four zero bytes.
                        (
                            shape,
                            shape.element_count() * spec.dtype.size().unwrap_or(4),
                        )
                    }
                };
                shapes.push(shape);
                sizes.push(size);
            }
            let mut output = batch.output(index)?;
            let out = output.allocate_bytes(&shapes, sizes.iter().sum())?;
            let mut at = 0;
            for (answer, size) in parsed.iter().zip(sizes) {
                let part = &mut out[at..at + size];
                match answer {
                    Answer::Outputs(outputs) => outputs[index]
                        .1
                        .copy_to_slice(py, part)
                        .map_err(|e| batch_error(py, e))?,
                    Answer::Failed(_) => part.fill(0),
                }
                at += size;
            }
        }
        for (request, answer) in parsed.into_iter().enumerate() {
            if let Answer::Failed(error) = answer {
                batch.fail(request, error)?;
            }
        }
        Ok(())
    }

    /// One `InferenceRequest` per client request, its inputs numpy views of the
    /// batch's memory: one call of `_kiln_requests` for the batch.
    fn requests<'py>(
        &self,
        py: Python<'py>,
        batch: &Batch<'_, '_>,
    ) -> Result<Bound<'py, PyAny>, WorkerError> {
        let failed = |e| batch_error(py, e);
        let inputs = PyList::empty(py);
        for index in 0..batch.input_count() {
            let input = batch.input(index)?;
            let (bytes, dtype) = (input.bytes(), input.dtype());
            let (memories, shapes) = (PyList::empty(py), PyList::empty(py));
            let mut at = 0;
            for shape in input.shapes().iter() {
                let len = match dtype.size() {
                    Some(size) => shape.element_count() * size,
                    None => tensor_byte_len(DataType::Bytes, shape.element_count(), &bytes[at..])?,
                };
                let data = &bytes[at..at + len];
                at += len;
                memories
                    .append(read_only_view(py, data).map_err(failed)?)
                    .map_err(failed)?;
                shapes
                    .append(PyTuple::new(py, shape.dims()).map_err(failed)?)
                    .map_err(failed)?;
            }
            inputs
                .append((input.name(), dtype.as_str(), memories, shapes))
                .map_err(failed)?;
        }
        let parameters: Vec<String> = (0..batch.request_count())
            .map(|request| parameters_json(batch.params(request)))
            .collect();
        self.utils
            .bind(py)
            .getattr("_kiln_requests")
            .and_then(|f| f.call1((inputs, self.output_names.bind(py), parameters)))
            .map_err(failed)
    }
}

/// A read-only `memoryview` of `data`, no copy. It must not be read after `run`
/// returns (the batch's memory is reused): a model that keeps an input array past
/// `execute` sees later batches' data (Triton's inputs behave the same).
fn read_only_view<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: the pointer and length describe `data`, alive for this call of `run`;
    // PyBUF_READ makes the view read-only, so Python never writes through it.
    unsafe {
        let view = pyo3::ffi::PyMemoryView_FromMemory(
            data.as_ptr() as *mut std::ffi::c_char,
            data.len() as pyo3::ffi::Py_ssize_t,
            pyo3::ffi::PyBUF_READ,
        );
        Bound::from_owned_ptr_or_err(py, view)
    }
}

/// One request's answer: `(code, message)` or `[(shape, memoryview)]`.
fn read_answer<'py>(answer: &Bound<'py, PyAny>) -> Answer {
    let py = answer.py();
    if let Ok((code, message)) = answer.extract::<(i64, String)>() {
        return Answer::Failed(if code == INVALID_ARG {
            RequestError::invalid(message)
        } else {
            RequestError::internal(message)
        });
    }
    let read = || -> Result<Vec<(Shape, PyBuffer<u8>)>, String> {
        let mut outputs = Vec::new();
        for item in answer.try_iter().map_err(|e| described(py, &e))? {
            let (dims, data): (Vec<i64>, Bound<'py, PyAny>) = item
                .and_then(|i| i.extract())
                .map_err(|e| described(py, &e))?;
            let shape = Shape::new(&dims)
                .ok_or_else(|| format!("an output of shape {dims:?} has too many dims"))?;
            let buffer = PyBuffer::<u8>::get(&data).map_err(|e| described(py, &e))?;
            outputs.push((shape, buffer));
        }
        Ok(outputs)
    };
    match read() {
        Ok(outputs) => Answer::Outputs(outputs),
        Err(message) => Answer::Failed(RequestError::internal(message)),
    }
}

/// A failed request's output shape: `rows` first when batching, dynamic dims 0.
fn placeholder(spec: &kiln_worker_sdk::TensorSpec, max_batch_size: u32, rows: usize) -> Shape {
    let batch = (max_batch_size > 0).then_some(rows as i64);
    let dims: Vec<i64> = batch
        .into_iter()
        .chain(spec.dims.iter().map(|&d| d.max(0)))
        .collect();
    Shape::new(&dims).unwrap_or_else(|| Shape::new(&[0]).unwrap_or_else(|| unreachable!()))
}

/// A request's parameters as the JSON object `InferenceRequest.parameters()` gives.
fn parameters_json(params: Params<'_>) -> String {
    let map: serde_json::Map<String, serde_json::Value> = params
        .0
        .iter()
        .map(|p| {
            let value = match &p.value {
                kiln_worker_sdk::ParamValue::Bool(b) => (*b).into(),
                kiln_worker_sdk::ParamValue::Int(i) => (*i).into(),
                kiln_worker_sdk::ParamValue::Uint(u) => (*u).into(),
                kiln_worker_sdk::ParamValue::Float(f) => (*f).into(),
                kiln_worker_sdk::ParamValue::Str(s) => s.as_str().into(),
            };
            (p.key.to_string(), value)
        })
        .collect();
    serde_json::Value::Object(map).to_string()
}

fn batch_error(py: Python<'_>, e: PyErr) -> WorkerError {
    WorkerError::new(described(py, &e))
}

/// An exception as its type and message; the traceback goes to the log.
fn described(py: Python<'_>, e: &PyErr) -> String {
    if let Some(traceback) = e.traceback(py).and_then(|t| t.format().ok()) {
        log::error!("{traceback}{e}");
    }
    e.to_string()
}

/// `pb_utils.Logger`'s records, into the server's log.
#[pyfunction]
fn kiln_log(level: i64, message: &str) {
    match level {
        0 => log::info!("{message}"),
        1 => log::warn!("{message}"),
        2 => log::error!("{message}"),
        _ => log::debug!("{message}"),
    }
}

export_worker!(PythonWorker);
