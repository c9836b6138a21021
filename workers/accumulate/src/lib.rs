//! `accumulate`: a running sum, written as a stateless worker for the sequence
//! batcher's implicit state. Each request's FP32 `INPUT` [1] is added to the FP32
//! `STATE` [1] the server keeps for its sequence; `OUTPUT` and `STATE_OUT` are the
//! sum (the server feeds `STATE_OUT` back as the next `STATE`). It also takes the
//! control inputs START, END, READY (INT32 [1]) and CORRID (UINT64 [1]) and reports
//! them: `CONTROLS` (INT32 [3]: start, end, ready) and `CORRID_OUT` (the id).
//! The load-time parameter `corrid_type` picks CORRID's type: `UINT64` (default) or
//! `STRING` (BYTES, for string sequence ids).
//!
//! Serve it with `batcher=sequence`, `state.STATE=STATE_OUT` and
//! `control.start=START`, `control.end=END`, `control.ready=READY`,
//! `control.corrid=CORRID`.

use kiln_worker_sdk::{
    export_worker, Batch, BatcherKind, DataType, ParamKind, ParamSpec, Params, Shape, TensorSpec,
    Worker, WorkerError, WorkerInfo,
};

/// Largest batch (rows) the worker accepts.
const MAX_BATCH: u32 = 256;

/// The accumulate worker.
pub struct Accumulate {
    corrid: DataType,
}

impl Worker for Accumulate {
    const PARAMETERS: &'static [ParamSpec] = &[ParamSpec::load("corrid_type", ParamKind::Any)];

    fn init(params: Params<'_>) -> Result<Self, WorkerError> {
        let corrid = match params.string("corrid_type").as_deref() {
            None | Some("UINT64") => DataType::Uint64,
            Some("STRING") | Some("BYTES") => DataType::Bytes,
            Some(other) => {
                return Err(WorkerError::new(format!(
                    "corrid_type must be UINT64 or STRING, got `{other}`"
                )))
            }
        };
        Ok(Accumulate { corrid })
    }

    fn info(&self) -> WorkerInfo {
        let spec = TensorSpec::new;
        WorkerInfo {
            inputs: vec![
                spec("INPUT", DataType::Fp32, &[1]),
                spec("STATE", DataType::Fp32, &[1]),
                spec("START", DataType::Int32, &[1]),
                spec("END", DataType::Int32, &[1]),
                spec("READY", DataType::Int32, &[1]),
                spec("CORRID", self.corrid, &[1]),
            ]
            .into(),
            outputs: vec![
                spec("OUTPUT", DataType::Fp32, &[1]),
                spec("STATE_OUT", DataType::Fp32, &[1]),
                spec("CONTROLS", DataType::Int32, &[3]),
                spec("CORRID_OUT", self.corrid, &[1]),
            ]
            .into(),
            max_batch_size: MAX_BATCH,
            batcher: BatcherKind::Sequence,
            allow_ragged_batch: false,
        }
    }

    fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
        let rows = batch.rows();
        let input = batch.input(0)?;
        let shapes = input.shapes().to_vec();
        let values = input.as_slice::<f32>()?;
        let state = batch.input(1)?.as_slice::<f32>()?;
        let controls: Vec<&[i32]> = (2..5)
            .map(|i| batch.input(i).and_then(|t| t.as_slice::<i32>()))
            .collect::<Result<_, _>>()?;
        let corrid = batch.input(5)?.bytes();
        if [values.len(), state.len()]
            .into_iter()
            .chain(controls.iter().map(|c| c.len()))
            .any(|n| n != rows)
        {
            return Err(WorkerError::new("every input must have one value per row"));
        }
        let sums: Vec<f32> = values.iter().zip(state).map(|(v, s)| v + s).collect();
        batch
            .output(0)?
            .allocate_as::<f32>(&shapes)?
            .copy_from_slice(&sums);
        batch
            .output(1)?
            .allocate_as::<f32>(&shapes)?
            .copy_from_slice(&sums);
        let three: Vec<Shape> = shapes
            .iter()
            .map(|s| Shape::new(&[s.rows() as i64, 3]).ok_or_else(|| WorkerError::new("shape")))
            .collect::<Result<_, _>>()?;
        let mut flags_out = batch.output(2)?;
        let flags = flags_out.allocate_as::<i32>(&three)?;
        for (row, chunk) in flags.chunks_exact_mut(3).enumerate() {
            for (k, c) in controls.iter().enumerate() {
                chunk[k] = c[row];
            }
        }
        // One id per row, in the input's own encoding: echoed as they are.
        batch
            .output(3)?
            .allocate_bytes(&shapes, corrid.len())?
            .copy_from_slice(corrid);
        Ok(())
    }
}

export_worker!(Accumulate);
