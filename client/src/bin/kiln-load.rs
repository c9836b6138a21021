//! kiln-load: a load generator for kiln.
//!
//! Closed loop (`--concurrency N`: N clients, each sends its next request when the
//! last is answered) or open loop (`--rate R`: requests start on a fixed schedule,
//! latency counted from the scheduled start, so a slow server cannot hide queueing).
//! Over HTTP (one keep-alive HTTP/1.1 connection per client, KServe v2 JSON, or
//! with `--binary` binary tensor data both ways), over gRPC (`--grpc`: one HTTP/2
//! connection per client, raw tensor contents; with `--streaming` each client keeps
//! one `ModelStreamInfer` stream and sends its next request when the last is
//! answered) or in-process (`--in-process`: an embedded server, no socket; needs
//! kiln-client's `embedded` feature).
//!
//! HTTP and gRPC calls go through small clients of this program's own
//! (`kiln_load/http1.rs`, `kiln_load/grpc.rs`), alike in what they do per call: the
//! request is encoded once and written whole on each call, the answer is read to
//! its end and its status checked (HTTP status; `:status` and `grpc-status`; a
//! stream answer's `error_message`), its payload counted, not decoded. So both
//! protocols cost the load generator about the same, and on a machine it shares
//! with the server the numbers say more about the server. `--grpc --tonic` calls
//! through kiln's tonic client instead (each request encoded, each answer
//! decoded), as an application would.
//!
//! ```text
//! kiln-load --url http://127.0.0.1:8000 --model echo --input INPUT0:UINT32:1x16 \
//!           --concurrency 1,8,32,128 --duration 10
//! kiln-load --grpc --streaming --model echo --input INPUT0:UINT32:1x16 --concurrency 32
//! kiln-load --in-process --load echo --model echo --input INPUT0:UINT32:1x16 --concurrency 32
//! ```
//!
//! With `--sequence-length N` (a stateful model), each client is one stream of
//! sequences: client `i` sends with `sequence_id` `i + 1`, `sequence_start` on every
//! N-th request and `sequence_end` on the one before the next start. Each request
//! is then encoded on its own: over HTTP the body is encoded per call, over gRPC
//! the calls go through the tonic client.
//!
//! `--stream` drives WebSocket sessions instead (`kiln_load/stream.rs`): frames
//! per second and latency per frame at `--concurrency` sessions.
//!
//! The server's CPU per request: `--server-pid PID` reads the user + system time of
//! the server process from `/proc/PID/stat` when the measured window opens (after
//! the warm-up) and when it closes, and reports that time divided by the requests
//! answered in the window (`server_cpu=…µs/req`; `server_cpu_us_per_request` with
//! `--json`). Any server on this machine, Triton included. `--server-cpu` reads the
//! same from the server's Prometheus `process_cpu_seconds_total` at
//! `--server-metrics` (default: `--url` + `/metrics`), for a server elsewhere.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use kiln_client::{DataType, InputTensor};

#[path = "kiln_load/caller.rs"]
mod caller;
#[path = "kiln_load/frames.rs"]
mod frames;
#[path = "kiln_load/grpc.rs"]
mod grpc;
#[path = "kiln_load/hpack.rs"]
mod hpack;
#[path = "kiln_load/http1.rs"]
mod http1;
#[path = "kiln_load/io.rs"]
mod io;
#[path = "kiln_load/server_cpu.rs"]
mod server_cpu;
#[path = "kiln_load/stream.rs"]
mod stream;

use caller::{target, Sequencer, Target};
use server_cpu::CpuSource;

#[derive(Parser, Clone)]
#[command(
    name = "kiln-load",
    about = "Load generator for kiln (closed or open loop)"
)]
struct Args {
    /// Server base URL (HTTP mode).
    #[arg(long, env = "KILN_URL", default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Drive an embedded server instead of HTTP (needs kiln-client's `embedded` feature).
    #[arg(long)]
    in_process: bool,
    /// In-process: worker to load first, WORKER[:key=value,...].
    #[arg(long)]
    load: Option<String>,
    /// In-process: plugin directory (default: beside this executable).
    #[arg(long)]
    plugin_dir: Vec<std::path::PathBuf>,
    /// In-process: model repository.
    #[arg(long)]
    model_repository: Option<std::path::PathBuf>,
    /// In-process: repository model to load first, NAME[:key=value,...] (overrides).
    #[arg(long)]
    load_model: Option<String>,
    /// Model (endpoint) to call.
    #[arg(long, default_value = "echo")]
    model: String,
    /// Input NAME:DATATYPE:SHAPE, shape as 1x16 (repeatable).
    #[arg(long = "input", required_unless_present = "stream")]
    inputs: Vec<String>,
    /// Closed loop: clients, one run per value (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    concurrency: Vec<usize>,
    /// Open loop: requests per second (clients then bound requests in flight).
    #[arg(long)]
    rate: Option<f64>,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Unmeasured seconds before each run.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Runtime threads of the load generator.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Print one JSON object per run.
    #[arg(long)]
    json: bool,
    /// HTTP: send the inputs as binary tensor data and ask for binary outputs.
    #[arg(long)]
    binary: bool,
    /// HTTP: the `Accept-Encoding` to send (`gzip`, `deflate`): compressed answers.
    #[arg(long, conflicts_with_all = ["grpc", "in_process"])]
    accept_encoding: Option<String>,
    /// Use gRPC (`--grpc-url`) instead of HTTP.
    #[arg(long, conflicts_with = "in_process")]
    grpc: bool,
    /// gRPC server URL.
    #[arg(long, env = "KILN_GRPC_URL", default_value = "http://127.0.0.1:8001")]
    grpc_url: String,
    /// gRPC: each client sends over one bidirectional stream (ModelStreamInfer).
    #[arg(long, requires = "grpc")]
    streaming: bool,
    /// gRPC through kiln's tonic client (each request encoded, each answer decoded)
    /// instead of the load generator's own HTTP/2 client.
    #[arg(long, requires = "grpc")]
    tonic: bool,
    /// WebSocket streams (docs/websocket.md): `--concurrency` sessions, each
    /// streaming JPEG frames of `--frame-size` and keeping `--stream-window`
    /// unanswered; frames per second and latency per frame.
    #[arg(long, conflicts_with_all = ["grpc", "in_process", "rate", "binary"])]
    stream: bool,
    /// `--stream`: the frames' WIDTHxHEIGHT.
    #[arg(long, default_value = "640x480", requires = "stream")]
    frame_size: String,
    /// `--stream`: frames a session keeps unanswered (its `max_inflight_frames`).
    #[arg(long, default_value_t = 4, requires = "stream")]
    stream_window: usize,
    /// Stateful models: each client runs sequences of this many requests.
    #[arg(long)]
    sequence_length: Option<u64>,
    /// Report the server's CPU per request: user + system time of process PID
    /// (`/proc/PID/stat`, so a server on this machine) over the measured window.
    #[arg(long, env = "KILN_LOAD_SERVER_PID", conflicts_with = "server_cpu")]
    server_pid: Option<u32>,
    /// Report the server's CPU per request from its `process_cpu_seconds_total`
    /// at `--server-metrics`.
    #[arg(long, env = "KILN_LOAD_SERVER_CPU", conflicts_with = "in_process")]
    server_cpu: bool,
    /// The server's Prometheus metrics for `--server-cpu` (which it implies);
    /// default `--url` + `/metrics`.
    #[arg(long, env = "KILN_LOAD_SERVER_METRICS", conflicts_with_all = ["server_pid", "in_process"])]
    server_metrics: Option<String>,
}

impl Args {
    /// Whether gRPC calls go through kiln's tonic client: asked for, or a sequence
    /// run (each request carries its own flags, so it is encoded per call; the
    /// lean client sends one body encoded once).
    fn grpc_through_tonic(&self) -> bool {
        self.tonic || self.sequence_length.is_some()
    }

    /// Where the server's CPU time is read, if asked.
    fn cpu_source(&self) -> Option<CpuSource> {
        if let Some(pid) = self.server_pid {
            return Some(CpuSource::Pid(pid));
        }
        let url = self.server_metrics.clone().or_else(|| {
            self.server_cpu
                .then(|| format!("{}/metrics", self.url.trim_end_matches('/')))
        })?;
        Some(CpuSource::Metrics(url))
    }
}

fn parse_input(spec: &str) -> anyhow::Result<InputTensor> {
    let parts: Vec<&str> = spec.split(':').collect();
    let [name, dtype, shape] = parts.as_slice() else {
        bail!("--input `{spec}`: expected NAME:DATATYPE:SHAPE");
    };
    let dtype = DataType::parse(dtype).with_context(|| format!("unknown datatype `{dtype}`"))?;
    let shape: Vec<i64> = shape
        .split('x')
        .map(|d| {
            d.parse::<i64>()
                .with_context(|| format!("bad dimension `{d}`"))
        })
        .collect::<anyhow::Result<_>>()?;
    let elements: usize = shape.iter().map(|&d| d.max(0) as usize).product();
    let size = dtype
        .size()
        .context("BYTES inputs are not supported by kiln-load")?;
    // Small deterministic values valid for every numeric type; floats in [-0.5, 0.5]
    // like a normalized image (the same data kiln-onnx-bench feeds the engine).
    let data: Vec<u8> = (0..elements)
        .flat_map(|i| {
            let v = (i % 100) as u8;
            let f = (i % 255) as f32 / 255.0 - 0.5;
            let mut word = vec![0u8; size];
            match dtype {
                DataType::Fp32 => word.copy_from_slice(&f.to_le_bytes()),
                DataType::Fp64 => word.copy_from_slice(&f64::from(f).to_le_bytes()),
                DataType::Fp16 => word.copy_from_slice(&half::f16::from_f32(f).to_le_bytes()),
                DataType::Bf16 => word.copy_from_slice(&half::bf16::from_f32(f).to_le_bytes()),
                DataType::Bool => word[0] = v % 2,
                _ => word[0] = v,
            }
            word
        })
        .collect();
    Ok(InputTensor {
        name: (*name).to_owned(),
        dtype,
        shape,
        // Kept for the whole run: every request's clone of it is then free (no shared
        // count that the callers and the instance would pass between cores; a real
        // client's requests carry data of their own).
        data: Bytes::from_static(Box::leak(data.into_boxed_slice())),
    })
}

#[derive(Default)]
struct Stats {
    ok: u64,
    errors: BTreeMap<String, u64>,
    latency: Option<Histogram<u64>>,
    /// The server's CPU seconds over the measured window (`--server-pid`,
    /// `--server-cpu`).
    server_cpu: Option<f64>,
    /// In-process: the model's mean batch size (rows per batch run) over the
    /// measured window, from the embedded server's statistics.
    mean_batch: Option<f64>,
}

impl Stats {
    fn record(&mut self, latency: Duration, result: Result<(), String>) {
        match result {
            Ok(()) => {
                self.ok += 1;
                let micros = latency.as_micros().max(1) as u64;
                if let Some(h) = self.latency.as_mut() {
                    let _ = h.record(micros.min(h.high()));
                }
            }
            Err(e) => *self.errors.entry(e).or_default() += 1,
        }
    }

    fn merge(&mut self, other: Stats) {
        self.ok += other.ok;
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        if let (Some(a), Some(b)) = (self.latency.as_mut(), other.latency.as_ref()) {
            let _ = a.add(b);
        }
    }
}

fn histogram() -> Option<Histogram<u64>> {
    Histogram::new_with_bounds(1, 120_000_000, 3).ok()
}

/// One run: `clients` clients for warmup + duration; returns the measured stats,
/// with the server's CPU time over the measured window when `cpu` says where to
/// read it.
async fn run(
    target: Arc<Target>,
    clients: usize,
    args: &Args,
    cpu: Option<(CpuSource, reqwest::Client)>,
) -> anyhow::Result<Stats> {
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.duration);
    // Read at the window's edges on its own task, so a slow client cannot move them.
    let sampler = cpu.map(|(source, http)| {
        tokio::spawn(async move {
            tokio::time::sleep_until(measure_from.into()).await;
            let before = source.cpu_seconds(&http).await?;
            tokio::time::sleep_until(end.into()).await;
            let after = source.cpu_seconds(&http).await?;
            Ok::<f64, String>(after - before)
        })
    });
    let batch_sampler = mean_batch_sampler(&target, measure_from, end);
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(clients);
    for client in 0..clients {
        let mut caller = target.caller().await?;
        let (next, rate) = (Arc::clone(&next), args.rate);
        let mut sequencer = args.sequence_length.map(|length| Sequencer {
            id: client as i64 + 1,
            length: length.max(1),
            sent: 0,
        });
        tasks.push(tokio::spawn(async move {
            let mut stats = Stats {
                latency: histogram(),
                ..Default::default()
            };
            // Closed loop: each call starts when the last one ended, so that moment is
            // read once (one clock read per call, not two).
            let mut ended = Instant::now();
            loop {
                let scheduled = match rate {
                    Some(rate) => {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let at = start + Duration::from_secs_f64(k as f64 / rate);
                        tokio::time::sleep_until(at.into()).await;
                        at
                    }
                    None => ended,
                };
                if scheduled >= end {
                    break;
                }
                if let Some(sequencer) = sequencer.as_mut() {
                    caller.set_sequence(sequencer.next());
                }
                let result = caller.call().await;
                ended = Instant::now();
                if scheduled >= measure_from {
                    stats.record(ended.duration_since(scheduled), result);
                }
            }
            stats
        }));
    }
    let mut total = Stats {
        latency: histogram(),
        ..Default::default()
    };
    for task in tasks {
        total.merge(task.await?);
    }
    if let Some(sampler) = sampler {
        total.server_cpu = Some(sampler.await?.map_err(anyhow::Error::msg)?);
    }
    if let Some(sampler) = batch_sampler {
        total.mean_batch = sampler.await?;
    }
    Ok(total)
}

/// In-process: reads the model's batch counts at the window's edges, on its own
/// task; yields rows per batch over the window (`None` when no batch ran).
#[cfg(feature = "embedded")]
fn mean_batch_sampler(
    target: &Target,
    from: Instant,
    end: Instant,
) -> Option<tokio::task::JoinHandle<Option<f64>>> {
    let Target::Native { client, request } = target else {
        return None;
    };
    let group = client.server().lookup(&request.model, None).ok()?;
    Some(tokio::spawn(async move {
        let counts = || {
            let s = group.stats().snapshot();
            (s.inference_count, s.execution_count)
        };
        tokio::time::sleep_until(from.into()).await;
        let (rows0, runs0) = counts();
        tokio::time::sleep_until(end.into()).await;
        let (rows1, runs1) = counts();
        let runs = runs1.saturating_sub(runs0);
        (runs > 0).then(|| rows1.saturating_sub(rows0) as f64 / runs as f64)
    }))
}

#[cfg(not(feature = "embedded"))]
fn mean_batch_sampler(
    _: &Target,
    _: Instant,
    _: Instant,
) -> Option<tokio::task::JoinHandle<Option<f64>>> {
    None
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.stream {
        return run_stream(&args);
    }
    let inputs = args
        .inputs
        .iter()
        .map(|s| parse_input(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(args.threads.max(1)).enable_all();
    #[cfg(feature = "embedded")]
    if args.in_process {
        // In-process the load generator's threads await the answers, as the server's
        // serving threads do over the network: under SCHED_BATCH, not woken into
        // preempting the instance thread once per answer (kiln_core::system::sched).
        builder.on_thread_start(kiln_core::system::sched::serving_thread);
    }
    let runtime = builder.build()?;
    let cpu_source = args.cpu_source();
    runtime.block_on(async {
        let target = Arc::new(target(&args, inputs).await?);
        let metrics_client = reqwest::Client::new();
        for &clients in &args.concurrency {
            let cpu = cpu_source.clone().map(|s| (s, metrics_client.clone()));
            let stats = run(Arc::clone(&target), clients.max(1), &args, cpu).await?;
            let throughput = stats.ok as f64 / args.duration;
            // Server CPU µs per request answered in the window.
            let server_cpu_us = stats
                .server_cpu
                .map(|s| s * 1e6 / stats.ok.max(1) as f64);
            let q = |p: f64| {
                stats
                    .latency
                    .as_ref()
                    .map_or(0.0, |h| h.value_at_quantile(p) as f64 / 1000.0)
            };
            let errors: u64 = stats.errors.values().sum();
            let tonic = args.grpc_through_tonic();
            let mode = match (args.in_process, args.grpc, args.streaming, args.binary) {
                (true, ..) => "in-process",
                (false, true, true, _) if tonic => "grpc-stream-tonic",
                (false, true, true, _) => "grpc-stream",
                (false, true, false, _) if tonic => "grpc-tonic",
                (false, true, false, _) => "grpc",
                (false, false, _, true) => "http-binary",
                (false, false, _, false) => "http",
            };
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "mode": mode, "model": args.model, "concurrency": clients,
                        "rate": args.rate, "requests": stats.ok, "errors": stats.errors,
                        "throughput": throughput, "p50_ms": q(0.5), "p90_ms": q(0.9),
                        "p99_ms": q(0.99), "max_ms": q(1.0),
                        "server_cpu_seconds": stats.server_cpu,
                        "server_cpu_us_per_request": server_cpu_us,
                        "mean_batch": stats.mean_batch,
                    })
                );
            } else {
                println!(
                    "{mode} model={} concurrency={clients}{} requests={} throughput={throughput:.0}/s p50={:.3}ms p90={:.3}ms p99={:.3}ms max={:.3}ms{}{} errors={errors}{}",
                    args.model,
                    args.rate.map(|r| format!(" rate={r}/s")).unwrap_or_default(),
                    stats.ok,
                    q(0.5),
                    q(0.9),
                    q(0.99),
                    q(1.0),
                    server_cpu_us
                        .map(|us| format!(" server_cpu={us:.1}us/req"))
                        .unwrap_or_default(),
                    stats
                        .mean_batch
                        .map(|b| format!(" batch={b:.1}"))
                        .unwrap_or_default(),
                    if errors > 0 { format!(" {:?}", stats.errors) } else { String::new() },
                );
            }
        }
        #[cfg(feature = "embedded")]
        if let Target::Native { client, .. } = &*target {
            client.shutdown().await;
        }
        anyhow::Ok(())
    })
}

/// `kiln-load --stream`: one run per `--concurrency` value (`kiln_load/stream.rs`).
fn run_stream(args: &Args) -> anyhow::Result<()> {
    let (width, height) = stream::parse_size(&args.frame_size)?;
    let load = stream::StreamLoad {
        url: args.url.clone(),
        model: args.model.clone(),
        width,
        height,
        window: args.stream_window.max(1),
        warmup: Duration::from_secs_f64(args.warmup),
        duration: Duration::from_secs_f64(args.duration),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    runtime.block_on(async {
        for &sessions in &args.concurrency {
            let stats = stream::run(&load, sessions.max(1)).await?;
            let fps = stats.frames as f64 / args.duration;
            let q = |p: f64| stats.latency.value_at_quantile(p) as f64 / 1000.0;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "mode": "stream", "model": args.model, "sessions": sessions,
                        "frame_size": args.frame_size, "window": load.window,
                        "frames": stats.frames, "fps": fps,
                        "fps_per_session": fps / sessions.max(1) as f64,
                        "p50_ms": q(0.5), "p99_ms": q(0.99), "errors": stats.errors,
                        "dropped": stats.dropped, "mean_batch": stats.mean_batch,
                    })
                );
            } else {
                println!(
                    "stream model={} sessions={sessions} frame={} window={} frames={} fps={fps:.1} fps/session={:.1} p50={:.2}ms p99={:.2}ms errors={} dropped={}{}",
                    args.model,
                    args.frame_size,
                    load.window,
                    stats.frames,
                    fps / sessions.max(1) as f64,
                    q(0.5),
                    q(0.99),
                    stats.errors,
                    stats.dropped,
                    stats.mean_batch.map(|b| format!(" batch={b:.1}")).unwrap_or_default(),
                );
            }
        }
        anyhow::Ok(())
    })
}
