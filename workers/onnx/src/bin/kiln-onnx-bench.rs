//! kiln-onnx-bench: ONNX Runtime alone, no server — the baseline that served
//! throughput is compared with. Runs one FP32 input of a fixed batch shape through a
//! session with the given threads for a while and reports samples per second and the
//! latency of each batch.
//!
//! ```text
//! kiln-onnx-bench --model examples/models/ocr-cls/1/model.onnx --shape 32x3x48x192 --seconds 10
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ort::session::builder::GraphOptimizationLevel;
use ort::session::Session;
use ort::value::TensorRef;

struct Args {
    model: PathBuf,
    shape: Vec<i64>,
    seconds: f64,
    intra: usize,
    runtime: PathBuf,
}

fn args() -> anyhow::Result<Args> {
    let mut model = None;
    let mut shape = None;
    let mut seconds = 10.0;
    let mut intra = 1;
    let mut runtime = std::env::var_os("KILN_ONNXRUNTIME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".cache/onnxruntime/libonnxruntime.so.1.31.1"));
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(value)),
            "--shape" => {
                shape = Some(
                    value
                        .split('x')
                        .map(|d| d.parse::<i64>().context("shape"))
                        .collect::<anyhow::Result<Vec<_>>>()?,
                )
            }
            "--seconds" => seconds = value.parse()?,
            "--intra-op-threads" => intra = value.parse()?,
            "--runtime" => runtime = PathBuf::from(value),
            other => bail!("unknown flag {other}; flags: --model --shape --seconds --intra-op-threads --runtime"),
        }
    }
    Ok(Args {
        model: model.context("--model is required")?,
        shape: shape.context("--shape is required (e.g. 32x3x48x192)")?,
        seconds,
        intra,
        runtime,
    })
}

fn main() -> anyhow::Result<()> {
    let args = args()?;
    let environment = ort::init_from(&args.runtime)?.with_name("bench").build()?;
    // Builder errors carry the builder back; keep only their message.
    let text =
        |e: ort::Error<ort::session::builder::SessionBuilder>| anyhow::anyhow!(e.to_string());
    let mut session = Session::builder(&environment)?
        .with_optimization_level(GraphOptimizationLevel::All)
        .map_err(text)?
        .with_intra_threads(args.intra)
        .map_err(text)?
        .with_inter_threads(1)
        .map_err(text)?
        .commit_from_file(&args.model)?;
    let elements: usize = args.shape.iter().map(|&d| d as usize).product();
    let data: Vec<f32> = (0..elements)
        .map(|i| ((i % 255) as f32) / 255.0 - 0.5)
        .collect();
    let mut latencies = Vec::new();
    let warmup_end = Instant::now() + Duration::from_secs(1);
    while Instant::now() < warmup_end {
        let input = TensorRef::from_array_view((args.shape.clone(), data.as_slice()))?;
        session.run([input.into()])?;
    }
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(args.seconds);
    while Instant::now() < end {
        let t = Instant::now();
        let input = TensorRef::from_array_view((args.shape.clone(), data.as_slice()))?;
        let outputs = session.run([input.into()])?;
        drop(outputs);
        latencies.push(t.elapsed());
    }
    let elapsed = start.elapsed().as_secs_f64();
    latencies.sort_unstable();
    let q = |p: f64| latencies[((latencies.len() - 1) as f64 * p) as usize].as_secs_f64() * 1000.0;
    let batch = args.shape.first().copied().unwrap_or(1);
    println!(
        "engine model={} shape={:?} intra_op_threads={} batches={} throughput={:.1} samples/s batch_p50={:.2}ms batch_p99={:.2}ms",
        args.model.display(),
        args.shape,
        args.intra,
        latencies.len(),
        latencies.len() as f64 * batch as f64 / elapsed,
        q(0.5),
        q(0.99)
    );
    Ok(())
}
