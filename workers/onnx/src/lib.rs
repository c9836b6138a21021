//! `onnx`: runs an ONNX model of the model repository with ONNX Runtime, loaded at
//! run time (`ort` with `load-dynamic`: the build downloads nothing).
//!
//! Inputs, outputs, datatypes and dynamic dims are read from the model. When every
//! input and output has a dynamic batch dimension, the worker batches (up to
//! `max_batch_size`, default 8); otherwise it does not batch (`max_batch_size` 0), as
//! Triton does. The batch dimension is the first, unless `batch_axis.<tensor>` = k
//! says it is axis k of that input or output: kiln still sees the tensor batch first
//! (the axis moved to the front, and declared without it), and the worker moves the
//! axis into place before running and back after (through per-instance scratch
//! buffers for inputs, straight into kiln's output buffers for outputs). `input.<name>` = value makes an input constant: the worker feeds it
//! itself (the model's static shape filled with the value) and does not declare it.
//! Batches otherwise run straight from kiln's pooled batch memory (borrowed, no copy);
//! outputs are split back per request.
//!
//! Load-time parameters: `model` (file inside the model's version folder, default
//! `model.onnx`), `model_dir` (set by the server's model repository), `runtime` (the
//! `libonnxruntime.so`; else `$KILN_ONNXRUNTIME`, else
//! `$KILN_CACHE/onnxruntime/libonnxruntime.so.1.31.1`, else `./.cache/onnxruntime/…`),
//! `side_by_side`, `intra_op_threads`, `inter_op_threads`, `allow_spinning`,
//! `force_spinning_stop` (ONNX Runtime's `session.force_spinning_stop`) (by default
//! none of the last four: the
//! session runs on the process's one ONNX Runtime thread pool, one thread per
//! physical core, shared by every model, whose runs take turns ([`turns`]: a run
//! alone takes the whole pool, runs that meet go side by side on one core each, on a
//! second session of one thread, made when first needed; `side_by_side` = false
//! turns that off);
//! setting any of them gives the session a
//! pool of its own: intra-op threads default to the physical cores divided among
//! the group's `instances`, inter-op 1, spinning on; see [`threads`]),
//! `optimization_level`
//! (`disable`, `basic`, `extended`, `all`; default `all`), `max_batch_size`,
//! `default_max_batch_size` (the batch size of a model that can batch when
//! `max_batch_size` is not set: 8; Triton's auto-completion uses 4),
//! `batch_axis.<tensor>`, `input.<name>`, `execution_provider` (`cpu`, the default,
//! or `cuda`: ONNX Runtime's CUDA provider, from the onnxruntime-gpu build named by
//! `runtime`; see [`provider`]) and `cuda_device` (0).
//! The session is created in `acquire` and dropped in `release`.
//!
//! `model_dir`, `model` and `runtime` name files and a library: they are declared
//! operator-only ([`Onnx::PARAMETERS`]), so the server refuses them from a client's
//! load request before `init` (which would probe the files and `dlopen` the runtime).

mod axes;
mod constant;
mod convert;
pub mod provider;
mod runtime;
mod signature;
mod threads;
pub mod turns;

use std::path::{Component, Path, PathBuf};

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, ParamKind, ParamSpec, Params, Shape, TensorSpec, Worker,
    WorkerError, WorkerInfo,
};
use ort::environment::Environment;
use ort::session::builder::GraphOptimizationLevel;
use ort::session::{Session, SessionInputValue};
use ort::value::DynValue;

use axes::{AlignedBytes, Split};
use provider::Provider;
use signature::{Feed, ModelTensor, Signature, Tensor};
use threads::Threads;
use turns::Runs;

/// The onnx worker.
pub struct Onnx {
    path: PathBuf,
    environment: Environment,
    threads: Threads,
    level: GraphOptimizationLevel,
    provider: Provider,
    signature: Signature,
    /// Per served input: the model's layout of a batch whose batch axis is not the
    /// first, reused from batch to batch.
    scratch: Vec<AlignedBytes>,
    session: Option<Session>,
    /// Whether runs that meet others on the shared pool go side by side on one core
    /// each (`side_by_side`, default true; [`turns`]).
    side_by_side: bool,
    /// The session on one core of its own for such runs, made the first time one
    /// is needed.
    side: Option<Session>,
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
    /// Whether this session's runs take turns on the shared pool ([`turns`]): on
    /// the CPU provider without a pool of its own.
    fn takes_turns(&self) -> bool {
        self.threads == Threads::Shared && self.provider == Provider::Cpu
    }

    /// Waits for this run's turn on the shared pool, if it takes turns, making the
    /// side session when the turn is one core and there is none yet. A side
    /// session that cannot be made is logged and given up: the run, and every
    /// later one, waits for the whole pool instead.
    fn turn(&mut self) -> Option<turns::Turn<'static>> {
        if !self.takes_turns() {
            return None;
        }
        let runs = if self.side_by_side {
            Runs::PoolOrCore
        } else {
            Runs::PoolOnly
        };
        let turn = turns::SHARED.take(runs);
        if turn.on_pool() || self.side.is_some() {
            return Some(turn);
        }
        match self.session_with(Threads::SIDE) {
            Ok(side) => {
                log::info!(
                    "onnx: {}: a second session on one core, for runs beside others",
                    self.path.display()
                );
                self.side = Some(side);
                Some(turn)
            }
            Err(e) => {
                log::warn!("onnx: no side session, runs wait for the whole pool: {e}");
                self.side_by_side = false;
                drop(turn);
                Some(turns::SHARED.take(Runs::PoolOnly))
            }
        }
    }

    fn session(&self) -> Result<Session, WorkerError> {
        self.session_with(self.threads)
    }

    /// Where the session a run uses is kept: the side session's slot or the main one.
    fn slot(&mut self, side: bool) -> &mut Option<Session> {
        if side {
            &mut self.side
        } else {
            &mut self.session
        }
    }

    fn session_with(&self, threads: Threads) -> Result<Session, WorkerError> {
        let builder = Session::builder(&self.environment)
            .map_err(ort_error("session options"))?
            .with_optimization_level(self.level)
            .map_err(|e| WorkerError::new(format!("optimization level: {e}")))?;
        // `Shared`: `ort` disables the session's own threads itself, since the
        // environment has global pools.
        let builder = match threads {
            Threads::Shared => builder,
            Threads::Own {
                intra,
                inter,
                spinning,
                stop_between_runs,
            } => builder
                .with_independent_thread_pool()
                .map_err(|e| WorkerError::new(format!("own thread pool: {e}")))?
                .with_intra_threads(intra)
                .map_err(|e| WorkerError::new(format!("intra-op threads: {e}")))?
                .with_inter_threads(inter)
                .map_err(|e| WorkerError::new(format!("inter-op threads: {e}")))?
                .with_intra_op_spinning(spinning)
                .map_err(|e| WorkerError::new(format!("allow_spinning: {e}")))?
                .with_config_entry(
                    "session.force_spinning_stop",
                    if stop_between_runs { "1" } else { "0" },
                )
                .map_err(|e| WorkerError::new(format!("force_spinning_stop: {e}")))?,
        };
        self.provider
            .register(builder)?
            .commit_from_file(&self.path)
            .map_err(|e| WorkerError::new(format!("cannot load {}: {e}", self.path.display())))
    }
}

/// The model's inputs or outputs as it declares them.
fn describe(outlets: &[ort::value::Outlet]) -> Result<Vec<ModelTensor>, WorkerError> {
    outlets
        .iter()
        .map(|o| {
            let (dtype, dims) = convert::tensor_type(o.name(), o.dtype())?;
            Ok(ModelTensor {
                name: o.name().to_owned(),
                dtype,
                dims,
            })
        })
        .collect()
}

fn rank_error() -> WorkerError {
    WorkerError::new("output rank above 8")
}

impl Onnx {
    fn batching(&self) -> bool {
        self.signature.max_batch_size > 0
    }

    /// Lays out, in the scratch buffers, every batched input whose batch axis is not
    /// the first, as the model holds it.
    fn move_inputs(&mut self, batch: &Batch<'_, '_>, rows: usize) -> Result<(), WorkerError> {
        if !self.batching() {
            return Ok(());
        }
        for (i, (spec, scratch)) in self
            .signature
            .inputs
            .iter()
            .zip(self.scratch.iter_mut())
            .enumerate()
        {
            if spec.axis == 0 {
                continue;
            }
            let input = batch.input(i)?;
            let shape = model_shape(spec, &input, rows)?;
            let split = Split::new(&spec.name, spec.dtype, &shape, spec.axis)?;
            let len = split
                .len()
                .filter(|&n| n == input.bytes().len())
                .ok_or_else(|| {
                    WorkerError::new(format!(
                        "input `{}`: {} bytes for shape {shape:?}",
                        spec.name,
                        input.bytes().len()
                    ))
                })?;
            split.kiln_to_model(input.bytes(), scratch.resize(len))?;
        }
        Ok(())
    }

    /// The value of model input `feed` for this batch: a constant, a scratch buffer
    /// (see [`Onnx::move_inputs`]), or kiln's batch memory.
    fn input_value<'v, 'a: 'v>(
        &'v self,
        feed: Feed,
        batch: &Batch<'_, 'a>,
        rows: usize,
    ) -> Result<SessionInputValue<'v>, WorkerError> {
        let i = match feed {
            Feed::Constant(c) => {
                let constant = self
                    .signature
                    .constants
                    .get(c)
                    .ok_or_else(|| WorkerError::new(format!("no constant #{c}")))?;
                return convert::input_value(
                    constant.dtype,
                    &constant.dims,
                    constant.data.as_slice(),
                );
            }
            Feed::Request(i) => i,
        };
        let spec = self
            .signature
            .inputs
            .get(i)
            .ok_or_else(|| WorkerError::new(format!("no input #{i}")))?;
        let input = batch.input(i)?;
        if !self.batching() {
            let first = input
                .shapes()
                .first()
                .ok_or_else(|| WorkerError::new("an empty batch"))?;
            return convert::input_value(spec.dtype, first.dims(), input.bytes());
        }
        let shape = model_shape(spec, &input, rows)?;
        let bytes = match (spec.axis, self.scratch.get(i)) {
            (0, _) => input.bytes(),
            (_, Some(scratch)) => scratch.as_slice(),
            (_, None) => return Err(WorkerError::new(format!("no scratch for input #{i}"))),
        };
        convert::input_value(spec.dtype, &shape, bytes)
    }

    /// Runs `session` on the batch in `turn` (given back as the run returns) and
    /// writes its outputs.
    fn run_session(
        &self,
        session: &mut Session,
        turn: Option<turns::Turn<'_>>,
        batch: &mut Batch<'_, '_>,
        request_rows: &[usize],
        rows: usize,
    ) -> Result<(), WorkerError> {
        let outputs = {
            let view: &Batch<'_, '_> = batch;
            let values = self
                .signature
                .feeds
                .iter()
                .map(|&feed| self.input_value(feed, view, rows))
                .collect::<Result<Vec<_>, _>>()?;
            let outputs = session.run(values.as_slice());
            drop(turn);
            outputs.map_err(ort_error("inference"))?
        };
        for (k, spec) in self.signature.outputs.iter().enumerate() {
            let value = outputs.get(&spec.name).ok_or_else(|| {
                WorkerError::new(format!("the model gave no output `{}`", spec.name))
            })?;
            self.write_output(k, value, batch, request_rows, rows)?;
        }
        Ok(())
    }

    /// Writes output `k` of the model, `value`, into the batch: batch first, split into
    /// each request's rows.
    fn write_output(
        &self,
        k: usize,
        value: &DynValue,
        batch: &mut Batch<'_, '_>,
        request_rows: &[usize],
        rows: usize,
    ) -> Result<(), WorkerError> {
        let spec = self
            .signature
            .outputs
            .get(k)
            .ok_or_else(|| WorkerError::new(format!("no output #{k}")))?;
        let (shape, bytes) = convert::output_bytes(spec.dtype, value)?;
        if !self.batching() {
            let shapes = [Shape::new(&shape).ok_or_else(rank_error)?];
            batch
                .output(k)?
                .allocate_bytes(&shapes, bytes.len())?
                .copy_from_slice(bytes);
            return Ok(());
        }
        if shape.get(spec.axis) != Some(&(rows as i64)) {
            return Err(WorkerError::new(format!(
                "output `{}` has shape {shape:?}, not {rows} rows on axis {}",
                spec.name, spec.axis
            )));
        }
        let whole = Shape::new(&axes::batch_first(&shape, spec.axis)).ok_or_else(rank_error)?;
        let shapes: Vec<Shape> = request_rows.iter().map(|&r| whole.with_rows(r)).collect();
        let mut output = batch.output(k)?;
        let out = output.allocate_bytes(&shapes, bytes.len())?;
        if spec.axis == 0 {
            out.copy_from_slice(bytes);
            return Ok(());
        }
        Split::new(&spec.name, spec.dtype, &shape, spec.axis)?.model_to_kiln(bytes, out)
    }
}

/// The model's shape of a batched input of `rows` rows: kiln's non-batch dims with
/// the rows at the model's batch axis.
fn model_shape(
    spec: &Tensor,
    input: &kiln_worker_sdk::Input<'_>,
    rows: usize,
) -> Result<Vec<i64>, WorkerError> {
    let first = input
        .shapes()
        .first()
        .ok_or_else(|| WorkerError::new("an empty batch"))?;
    Ok(axes::with_batch_at(first.inner().dims(), spec.axis, rows))
}

impl Worker for Onnx {
    const PARAMETERS: &'static [ParamSpec] = &[
        ParamSpec::operator("model_dir"),
        ParamSpec::operator("model"),
        ParamSpec::operator("runtime"),
        ParamSpec::load("intra_op_threads", ParamKind::Int { min: 1, max: 256 }),
        ParamSpec::load("inter_op_threads", ParamKind::Int { min: 1, max: 256 }),
        ParamSpec::load("allow_spinning", ParamKind::Bool),
        ParamSpec::load("force_spinning_stop", ParamKind::Bool),
        ParamSpec::load("side_by_side", ParamKind::Bool),
        ParamSpec::load("optimization_level", ParamKind::Any),
        ParamSpec::load("max_batch_size", ParamKind::Int { min: 0, max: 4096 }),
        ParamSpec::load(
            "default_max_batch_size",
            ParamKind::Int { min: 1, max: 4096 },
        ),
        ParamSpec::load(
            "batch_axis.*",
            ParamKind::Int {
                min: 0,
                max: i64::MAX,
            },
        ),
        ParamSpec::load("input.*", ParamKind::Any),
        ParamSpec::load("execution_provider", ParamKind::Any),
        ParamSpec::load("cuda_device", ParamKind::Int { min: 0, max: 63 }),
    ];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        let path = model_path(&params)?;
        let provider = Provider::from_params(&params)?;
        let environment = runtime::environment(&runtime::locate(params.string("runtime")))?;
        let mut worker = Onnx {
            path,
            environment,
            threads: Threads::from_params(&params, threads::physical_cores())?,
            level: optimization_level(&params)?,
            provider,
            signature: Signature::default(),
            scratch: Vec::new(),
            session: None,
            side_by_side: params
                .bool("side_by_side")
                .map_err(WorkerError::new)?
                .unwrap_or(true),
            side: None,
        };
        // Read the model's signature from a session made only for that.
        let session = worker.session()?;
        let inputs = describe(session.inputs())?;
        let outputs = describe(session.outputs())?;
        worker.signature = Signature::new(&inputs, &outputs, &params)?;
        worker.scratch = worker
            .signature
            .inputs
            .iter()
            .map(|_| AlignedBytes::default())
            .collect();
        log::info!(
            "onnx: {} — {} input(s), {} output(s), max_batch_size {}, on {}, {:?}{}",
            worker.path.display(),
            worker.signature.inputs.len(),
            worker.signature.outputs.len(),
            worker.signature.max_batch_size,
            worker.threads,
            worker.provider,
            worker.signature.describe_options()
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
            inputs: specs(&self.signature.inputs),
            outputs: specs(&self.signature.outputs),
            max_batch_size: self.signature.max_batch_size,
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
        self.side = None;
        Ok(())
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let requests = batch.request_count();
        if !self.batching() && requests != 1 {
            return Err(WorkerError::new(format!(
                "{requests} requests in a batch for a model that does not batch"
            )));
        }
        let rows = batch.rows();
        let request_rows: Vec<usize> = if self.signature.inputs.is_empty() {
            vec![1; requests]
        } else {
            batch.input(0)?.shapes().iter().map(Shape::rows).collect()
        };
        self.move_inputs(batch, rows)?;
        let turn = self.turn();
        let side = turn.as_ref().is_some_and(|t| !t.on_pool());
        let mut session = self
            .slot(side)
            .take()
            .ok_or_else(|| WorkerError::new("run before acquire"))?;
        let result = self.run_session(&mut session, turn, batch, &request_rows, rows);
        *self.slot(side) = Some(session);
        result
    }
}

export_worker!(Onnx);
