//! `onnx`: runs an ONNX model of the model repository with ONNX Runtime, loaded at
//! run time (`ort` with `load-dynamic`: the build downloads nothing).
//!
//! Inputs, outputs, datatypes and dynamic dims are read from the model. When every
//! input and output has a dynamic first dimension, that is the batch dimension and the
//! worker batches (up to `max_batch_size`, default 8); otherwise it does not batch
//! (`max_batch_size` 0), as Triton does. Batches run straight from kiln's pooled batch
//! memory (borrowed, no copy); outputs are split back per request.
//!
//! Load-time parameters: `model` (file inside the model's version folder, default
//! `model.onnx`), `model_dir` (set by the server's model repository), `runtime` (the
//! `libonnxruntime.so`; else `$KILN_ONNXRUNTIME`, else
//! `$KILN_CACHE/onnxruntime/libonnxruntime.so.1.31.1`, else `./.cache/onnxruntime/…`),
//! `intra_op_threads` (1), `inter_op_threads` (1), `optimization_level`
//! (`disable`, `basic`, `extended`, `all`; default `all`), `max_batch_size`.
//! The session is created in `acquire` and dropped in `release`.

mod convert;
mod runtime;

use std::path::{Component, Path, PathBuf};

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, Params, Shape, TensorSpec, Worker, WorkerError,
    WorkerInfo,
};
use ort::environment::Environment;
use ort::session::builder::GraphOptimizationLevel;
use ort::session::{Session, SessionInputValue};

/// Default largest batch for models with a batch dimension.
const DEFAULT_MAX_BATCH: i64 = 8;

/// One declared tensor of the model.
struct Tensor {
    name: String,
    dtype: DataType,
    /// Dims without the batch dimension when batching.
    dims: Vec<i64>,
}

/// The onnx worker.
pub struct Onnx {
    path: PathBuf,
    environment: Environment,
    intra_op_threads: usize,
    inter_op_threads: usize,
    level: GraphOptimizationLevel,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    max_batch_size: u32,
    session: Option<Session>,
}

fn ort_error(context: &str) -> impl Fn(ort::Error) -> WorkerError + '_ {
    move |e| WorkerError::new(format!("{context}: {e}"))
}

fn count(params: &Params<'_>, key: &str, default: i64) -> Result<usize, WorkerError> {
    match params.int(key)?.unwrap_or(default) {
        n @ 1..=256 => Ok(n as usize),
        n => Err(WorkerError::new(format!(
            "`{key}` must be in 1..=256, got {n}"
        ))),
    }
}

/// The model file: `model` inside `model_dir`, refusing anything that leaves it.
fn model_path(params: &Params<'_>) -> Result<PathBuf, WorkerError> {
    let dir = params.string("model_dir").ok_or_else(|| {
        WorkerError::new(
            "the onnx worker serves models of a model repository: start kiln with \
             --model-repository and load the model by name",
        )
    })?;
    let file = params
        .string("model")
        .unwrap_or_else(|| "model.onnx".to_owned());
    let relative = Path::new(&file);
    if relative
        .components()
        .any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err(WorkerError::new(format!(
            "`model` must be a path inside the model's folder, got `{file}`"
        )));
    }
    let path = Path::new(&dir).join(relative);
    if !path.is_file() {
        return Err(WorkerError::new(format!(
            "model file {} not found",
            path.display()
        )));
    }
    Ok(path)
}

fn optimization_level(params: &Params<'_>) -> Result<GraphOptimizationLevel, WorkerError> {
    Ok(
        match params
            .string("optimization_level")
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            None | Some("all") => GraphOptimizationLevel::All,
            Some("extended") => GraphOptimizationLevel::Level2,
            Some("basic") => GraphOptimizationLevel::Level1,
            Some("disable") => GraphOptimizationLevel::Disable,
            Some(other) => {
                return Err(WorkerError::new(format!(
                    "`optimization_level` must be disable, basic, extended or all, got `{other}`"
                )))
            }
        },
    )
}

impl Onnx {
    fn session(&self) -> Result<Session, WorkerError> {
        Session::builder(&self.environment)
            .map_err(ort_error("session options"))?
            .with_optimization_level(self.level)
            .map_err(|e| WorkerError::new(format!("optimization level: {e}")))?
            .with_intra_threads(self.intra_op_threads)
            .map_err(|e| WorkerError::new(format!("intra-op threads: {e}")))?
            .with_inter_threads(self.inter_op_threads)
            .map_err(|e| WorkerError::new(format!("inter-op threads: {e}")))?
            .commit_from_file(&self.path)
            .map_err(|e| WorkerError::new(format!("cannot load {}: {e}", self.path.display())))
    }
}

impl Worker for Onnx {
    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        let path = model_path(&params)?;
        let environment = runtime::environment(&runtime::locate(params.string("runtime")))?;
        let mut worker = Onnx {
            path,
            environment,
            intra_op_threads: count(&params, "intra_op_threads", 1)?,
            inter_op_threads: count(&params, "inter_op_threads", 1)?,
            level: optimization_level(&params)?,
            inputs: Vec::new(),
            outputs: Vec::new(),
            max_batch_size: 0,
            session: None,
        };
        // Read the model's signature from a session made only for that.
        let session = worker.session()?;
        let describe = |outlets: &[ort::value::Outlet]| -> Result<Vec<Tensor>, WorkerError> {
            outlets
                .iter()
                .map(|o| {
                    let (dtype, dims) = convert::tensor_type(o.name(), o.dtype())?;
                    Ok(Tensor {
                        name: o.name().to_owned(),
                        dtype,
                        dims,
                    })
                })
                .collect()
        };
        let mut inputs = describe(session.inputs())?;
        let mut outputs = describe(session.outputs())?;
        let batchable = inputs
            .iter()
            .chain(&outputs)
            .all(|t| t.dims.first() == Some(&-1));
        let max = match params.int("max_batch_size")? {
            Some(n) if !(0..=4096).contains(&n) => {
                return Err(WorkerError::new(format!(
                    "`max_batch_size` must be in 0..=4096, got {n}"
                )))
            }
            Some(n) => n,
            None if batchable => DEFAULT_MAX_BATCH,
            None => 0,
        };
        if max > 0 {
            if !batchable {
                return Err(WorkerError::new(
                    "this model has no batch dimension (a dynamic first dim on every input and output): \
                     set max_batch_size 0",
                ));
            }
            for t in inputs.iter_mut().chain(outputs.iter_mut()) {
                t.dims.remove(0);
            }
        }
        worker.max_batch_size = max as u32;
        worker.inputs = inputs;
        worker.outputs = outputs;
        log::info!(
            "onnx: {} — {} input(s), {} output(s), max_batch_size {}",
            worker.path.display(),
            worker.inputs.len(),
            worker.outputs.len(),
            worker.max_batch_size
        );
        Ok(worker)
    }

    fn info(&self) -> WorkerInfo {
        let specs = |tensors: &[Tensor]| {
            tensors
                .iter()
                .map(|t| TensorSpec::new(&t.name, t.dtype, &t.dims))
                .collect::<Vec<_>>()
                .into()
        };
        WorkerInfo {
            inputs: specs(&self.inputs),
            outputs: specs(&self.outputs),
            max_batch_size: self.max_batch_size,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: false,
        }
    }

    fn acquire(&mut self) -> Result<(), WorkerError> {
        self.session = Some(self.session()?);
        Ok(())
    }

    fn release(&mut self) -> Result<(), WorkerError> {
        self.session = None;
        Ok(())
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let batching = self.max_batch_size > 0;
        let requests = batch.request_count();
        if !batching && requests != 1 {
            return Err(WorkerError::new(format!(
                "{requests} requests in a batch for a model that does not batch"
            )));
        }
        let total_rows = batch.rows();
        let mut request_rows = Vec::with_capacity(requests);
        let mut values: Vec<SessionInputValue<'_>> = Vec::with_capacity(self.inputs.len());
        for (i, spec) in self.inputs.iter().enumerate() {
            let input = batch.input(i)?;
            let first = input
                .shapes()
                .first()
                .ok_or_else(|| WorkerError::new("an empty batch"))?;
            let shape: Vec<i64> = if batching {
                std::iter::once(total_rows as i64)
                    .chain(first.inner().dims().iter().copied())
                    .collect()
            } else {
                first.dims().to_vec()
            };
            if i == 0 {
                request_rows.extend(input.shapes().iter().map(Shape::rows));
            }
            values.push(convert::input_value(spec.dtype, &shape, input.bytes())?);
        }
        let session = self
            .session
            .as_mut()
            .ok_or_else(|| WorkerError::new("run before acquire"))?;
        let outputs = session
            .run(values.as_slice())
            .map_err(ort_error("inference"))?;
        for (k, spec) in self.outputs.iter().enumerate() {
            let value = outputs.get(&spec.name).ok_or_else(|| {
                WorkerError::new(format!("the model gave no output `{}`", spec.name))
            })?;
            let (shape, bytes) = convert::output_bytes(spec.dtype, value)?;
            let shapes: Vec<Shape> = if batching {
                if shape.first() != Some(&(total_rows as i64)) {
                    return Err(WorkerError::new(format!(
                        "output `{}` has shape {shape:?}, not {total_rows} rows",
                        spec.name
                    )));
                }
                let whole =
                    Shape::new(&shape).ok_or_else(|| WorkerError::new("output rank above 8"))?;
                request_rows
                    .iter()
                    .map(|&rows| whole.with_rows(rows))
                    .collect()
            } else {
                vec![Shape::new(&shape).ok_or_else(|| WorkerError::new("output rank above 8"))?]
            };
            batch
                .output(k)?
                .allocate_bytes(&shapes, bytes.len())?
                .copy_from_slice(bytes);
        }
        Ok(())
    }
}

export_worker!(Onnx);
