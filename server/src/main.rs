//! `kiln`: the inference server binary.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use kiln_core::{Server, ServerConfig};
use kiln_server::drain::{self, Drained, StopSignals};
use kiln_server::grpc::{GrpcConfig, GrpcLimits, GrpcServer};
use kiln_server::http::{serve, HttpConfig};
use kiln_server::restricted::RestrictedApis;

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: a model inference server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the server.
    Serve(Box<ServeArgs>),
    /// Run one isolated worker instance for a server (`isolation = "process"`);
    /// started by `kiln serve` itself, with the descriptors it passes.
    #[command(hide = true)]
    WorkerHost(WorkerHostArgs),
}

#[derive(Args)]
struct WorkerHostArgs {
    /// The control socket's descriptor.
    #[arg(long)]
    control_fd: i32,
    /// The shared arena's descriptor (a sealed memfd).
    #[arg(long)]
    arena_fd: i32,
}

#[derive(Args)]
struct ServeArgs {
    /// HTTP port (0: any free port; the bound address is printed).
    #[arg(long, env = "KILN_HTTP_PORT", default_value_t = 8000)]
    http_port: u16,
    /// Address to listen on.
    #[arg(long, env = "KILN_HOST", default_value = "0.0.0.0")]
    host: IpAddr,
    /// Directory holding worker plugins (repeatable; env: `:`-separated). Default:
    /// the directory of the `kiln` executable, then ../lib/kiln beside it.
    #[arg(long = "plugin-dir", env = "KILN_PLUGIN_DIR", value_delimiter = ':')]
    plugin_dirs: Vec<PathBuf>,
    /// Load a worker at start: WORKER[:key=value,...] (repeatable; env: `;`-separated).
    #[arg(long = "load", env = "KILN_LOAD", value_delimiter = ';')]
    load: Vec<String>,
    #[command(flatten)]
    repository: kiln_server::repository_args::RepositoryArgs,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, env = "KILN_LOG_LEVEL", default_value = "info")]
    log_level: String,
    /// Log file; with one, the console shows only warnings and errors.
    #[arg(long, env = "KILN_LOG_FILE")]
    log_file: Option<PathBuf>,
    /// Log line format: `default`, `ISO8601` (Triton's) or `json` (one object a
    /// line). Changeable at run time through `POST /v2/logging`.
    #[arg(long, env = "KILN_LOG_FORMAT", default_value = "default", value_parser = parse_log_format)]
    log_format: kiln_server::log_settings::LogFormat,
    /// Largest request body in bytes.
    #[arg(long, env = "KILN_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// HTTP worker threads (default: one per core).
    #[arg(long, env = "KILN_HTTP_WORKERS")]
    http_workers: Option<usize>,
    /// A browser origin (`https://host[:port]`) allowed to call kiln besides its
    /// own (repeatable; env: `,`-separated; `*`: any). Requests with another
    /// `Origin` are refused 403; requests with none are unaffected (docs/security.md,
    /// "Browsers").
    #[arg(
        long = "cors-allow-origin",
        env = "KILN_CORS_ALLOW_ORIGIN",
        value_delimiter = ','
    )]
    cors_allow_origin: Vec<String>,
    /// A host name browsers may reach kiln by, besides IP addresses and
    /// `localhost` (repeatable; env: `,`-separated; `*`: any name). A browser's
    /// request to another name is refused 403: the defence against DNS rebinding
    /// (docs/security.md, "Browsers"). Clients that are not browsers are unaffected.
    #[arg(
        long = "allowed-host",
        env = "KILN_ALLOWED_HOST",
        value_delimiter = ','
    )]
    allowed_host: Vec<String>,
    /// gRPC port (0: any free port; the bound address is printed).
    #[arg(long, env = "KILN_GRPC_PORT", default_value_t = 8001)]
    grpc_port: u16,
    /// Largest gRPC message in bytes, received or sent.
    #[arg(long, env = "KILN_GRPC_MAX_MESSAGE_BYTES", default_value_t = 64 << 20)]
    grpc_max_message_bytes: usize,
    /// gRPC threads, each a single-threaded runtime (default: one per core).
    #[arg(long, env = "KILN_GRPC_THREADS")]
    grpc_threads: Option<usize>,
    /// Run the HTTP and gRPC serving threads under Linux's SCHED_BATCH policy, so
    /// that a thread woken with an answer does not preempt the instance thread
    /// handing out the rest of its batch (`false`: the default policy).
    #[arg(long, env = "KILN_SCHED_BATCH", default_value_t = true, action = clap::ArgAction::Set)]
    sched_batch: bool,
    // Access (issue #11, restricted APIs): Triton's flags, repeatable, one group
    // `<API_1>,<API_2>,...:<key>=<value>` each; in the environment, groups are
    // separated by `;`.
    /// Restrict REST API categories (health, metadata, inference, shared-memory,
    /// model-config, model-repository, statistics, trace, logging) to requests
    /// carrying the header `<key>: <value>`; others get 403.
    #[arg(long, env = "KILN_HTTP_RESTRICTED_API", value_delimiter = ';')]
    http_restricted_api: Vec<String>,
    /// The same for gRPC: the header is `triton-grpc-protocol-<key>`; others get
    /// UNAVAILABLE.
    #[arg(
        long,
        visible_alias = "grpc-restricted-api",
        env = "KILN_GRPC_RESTRICTED_PROTOCOL",
        value_delimiter = ';'
    )]
    grpc_restricted_protocol: Vec<String>,
    // Shared memory and HTTP decoding (hardening, shared-memory slice).
    /// Most bytes of shared-memory inputs the server holds at once: each is copied
    /// out of its region when its request is decoded (beyond: 429, and 413 for one
    /// input larger than this).
    #[arg(long, env = "KILN_SHM_MAX_HELD_BYTES", default_value_t = kiln_core::memory::shared_memory::DEFAULT_MAX_HELD_BYTES)]
    shm_max_held_bytes: usize,
    /// The one budget of bytes clients can make the server hold at once: decoded
    /// images and frames, stream results, shared-memory copies, unfinished gRPC
    /// messages, job submissions and results, model calls' inputs (beyond: 429 /
    /// RESOURCE_EXHAUSTED, or a frame dropped). Default: a quarter of the
    /// machine's memory.
    #[arg(long, env = "KILN_MAX_CLIENT_BYTES")]
    max_client_bytes: Option<usize>,
    // Queues and server-wide limits (hardening, slice "queues"): what loads may take
    // of the machine, per model and in total, and memory returned after floods.
    // The limits' defaults come from the machine (`Limits::for_machine`).
    /// Most worker instances of one model (default: 4 per core, at least 8).
    #[arg(long, env = "KILN_MAX_INSTANCES_PER_MODEL")]
    max_instances_per_model: Option<usize>,
    /// Most worker instances of all models together (default: 16 per core, at least 64).
    #[arg(long, env = "KILN_MAX_INSTANCES")]
    max_instances: Option<usize>,
    /// Most batcher threads of one model (default: one per core, at least 4).
    #[arg(long, env = "KILN_MAX_BATCHER_THREADS_PER_MODEL")]
    max_batcher_threads_per_model: Option<usize>,
    /// Most batcher threads of all models together (default: 16 per core, at least 256).
    #[arg(long, env = "KILN_MAX_BATCHER_THREADS")]
    max_batcher_threads: Option<usize>,
    /// Most buffer-pool bytes of one model at load: max_buffers sets of their
    /// initial sizes (default: a quarter of the machine's memory).
    #[arg(long, env = "KILN_MAX_BUFFER_BYTES_PER_MODEL")]
    max_buffer_bytes_per_model: Option<u64>,
    /// Most buffer-pool bytes of all models together (default: half the memory).
    #[arg(long, env = "KILN_MAX_BUFFER_BYTES")]
    max_buffer_bytes: Option<u64>,
    /// Seconds a stopping server (SIGTERM, SIGINT) waits for the requests it
    /// accepted before it cuts them and exits non-zero (Triton's flag). Meanwhile it
    /// is not ready, refuses new requests (503, gRPC UNAVAILABLE) but sequences'
    /// continuations, and keeps its ports open (docs/operations.md).
    #[arg(long, env = "KILN_EXIT_TIMEOUT_SECS", default_value_t = 30)]
    exit_timeout_secs: u64,
    /// How often (ms) housekeeping looks for a quiet server to return memory freed
    /// after a burst to the system (malloc_trim); 0: never.
    #[arg(long, env = "KILN_TRIM_INTERVAL_MS", default_value_t = 1000)]
    trim_interval_ms: u64,
    #[command(flatten)]
    connections: ConnectionArgs,
    #[command(flatten)]
    stream: kiln_server::stream::StreamArgs,
    #[command(flatten)]
    media: kiln_server::media::MediaArgs,
    #[command(flatten)]
    trace: TraceArgs,
    /// Offline jobs (docs/jobs.md).
    #[command(flatten)]
    jobs: kiln_server::jobs::JobsArgs,
}

// Traces (issue #16): OpenTelemetry spans exported over OTLP, sampled with
// Triton's trace settings (docs/tracing.md).
/// Tracing of requests.
#[derive(Args)]
struct TraceArgs {
    /// Export spans to this OTLP receiver (e.g. http://127.0.0.1:4317 for gRPC,
    /// http://127.0.0.1:4318 for HTTP/protobuf). Without it nothing is traced.
    #[arg(long, env = "KILN_TRACE_OTLP_ENDPOINT")]
    trace_otlp_endpoint: Option<String>,
    /// OTLP transport: grpc or http (HTTP/protobuf). Default: from
    /// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL, else from
    /// the URL (port 4318 or a /v1/traces path: http; otherwise grpc).
    #[arg(long, env = "KILN_TRACE_OTLP_PROTOCOL")]
    trace_otlp_protocol: Option<String>,
    /// Trace every N-th request (Triton's --trace-rate; 1: every request, 100:
    /// one in a hundred). Giving it turns tracing on (level TIMESTAMPS) when no
    /// --trace-level is given. Default: 1000, with tracing off.
    #[arg(long, env = "KILN_TRACE_RATE")]
    trace_rate: Option<u32>,
    /// Triton's --trace-level: OFF or TIMESTAMPS.
    #[arg(long, env = "KILN_TRACE_LEVEL")]
    trace_level: Option<String>,
    /// Triton's --trace-count: traces to take before tracing stops (-1: no limit).
    #[arg(long, env = "KILN_TRACE_COUNT", default_value_t = -1, allow_negative_numbers = true)]
    trace_count: i64,
}

impl TraceArgs {
    /// Sets up tracing: the operator's settings, and the exporter when an
    /// endpoint is given.
    fn configure(&self) -> anyhow::Result<()> {
        use kiln_core::observe::trace::{self, TraceConfig, Update};
        use kiln_server::otlp::{OtlpConfig, Protocol};
        let mut config = TraceConfig {
            rate: self.trace_rate.unwrap_or(TraceConfig::default().rate),
            count: self.trace_count,
            timestamps: self.trace_rate.is_some_and(|r| r > 0),
        };
        // The flags are checked as a settings request is.
        let mut check = trace::settings::Table::new(config);
        if let Some(level) = &self.trace_level {
            let levels = level.split(',').map(str::to_owned).collect();
            let update: Update = ("trace_level".into(), Some(levels));
            check.update(None, &[update]).context("--trace-level")?;
            config.timestamps = check.timestamps();
        }
        if config.count < -1 {
            anyhow::bail!("--trace-count {}: -1 (no limit) or a count", config.count);
        }
        let otlp = match &self.trace_otlp_endpoint {
            None => None,
            Some(endpoint) => {
                let named = self.trace_otlp_protocol.clone().or_else(|| {
                    [
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                        "OTEL_EXPORTER_OTLP_PROTOCOL",
                    ]
                    .into_iter()
                    .find_map(|v| std::env::var(v).ok().filter(|p| !p.is_empty()))
                });
                let protocol = match named {
                    Some(p) => Protocol::parse(&p).context("--trace-otlp-protocol")?,
                    None => Protocol::guess(endpoint),
                };
                Some(OtlpConfig {
                    endpoint: endpoint.clone(),
                    protocol,
                })
            }
        };
        trace::configure(config);
        if let Some(otlp) = &otlp {
            kiln_server::otlp::start(otlp).context("cannot set up the OTLP exporter")?;
            spdlog::info!(
                "tracing: OTLP {:?} to {}, level {}, every {} request(s)",
                otlp.protocol,
                otlp.endpoint,
                if config.timestamps {
                    "TIMESTAMPS"
                } else {
                    "OFF"
                },
                config.rate
            );
        }
        Ok(())
    }
}

impl ServeArgs {
    /// The server-wide limits: the flags given, the machine's defaults for the rest.
    fn limits(&self) -> kiln_core::load::limits::Limits {
        let d = kiln_core::load::limits::Limits::default();
        kiln_core::load::limits::Limits {
            instances_per_model: self
                .max_instances_per_model
                .unwrap_or(d.instances_per_model),
            instances: self.max_instances.unwrap_or(d.instances),
            batcher_threads_per_model: self
                .max_batcher_threads_per_model
                .unwrap_or(d.batcher_threads_per_model),
            batcher_threads: self.max_batcher_threads.unwrap_or(d.batcher_threads),
            buffer_bytes_per_model: self
                .max_buffer_bytes_per_model
                .unwrap_or(d.buffer_bytes_per_model),
            buffer_bytes: self.max_buffer_bytes.unwrap_or(d.buffer_bytes),
        }
    }
}

// Connections and transport (hardening, issue #11): timeouts, caps, descriptors.
/// Limits on connections (`docs/security.md`, "Connections").
#[derive(Args)]
struct ConnectionArgs {
    /// Open HTTP connections at most; beyond, new ones wait in the listen backlog
    /// until one closes (default: from the descriptor limit, see docs/security.md).
    #[arg(long, env = "KILN_HTTP_MAX_CONNECTIONS")]
    http_max_connections: Option<usize>,
    /// Open gRPC connections at most; beyond, a new one is closed at once
    /// (default: from the descriptor limit, see docs/security.md).
    #[arg(long, env = "KILN_GRPC_MAX_CONNECTIONS")]
    grpc_max_connections: Option<usize>,
    /// Seconds a new gRPC connection may take to send its HTTP/2 preface
    /// (and finish TLS's handshake); then it is dropped.
    #[arg(long, env = "KILN_GRPC_HANDSHAKE_TIMEOUT", default_value_t = 10.0)]
    grpc_handshake_timeout: f64,
    /// Seconds without a call after which a gRPC connection is closed (GOAWAY);
    /// the check runs at this interval, so it closes within twice this.
    #[arg(long, env = "KILN_GRPC_IDLE_TIMEOUT", default_value_t = 120.0)]
    grpc_idle_timeout: f64,
    /// Milliseconds without traffic after which a gRPC connection is probed
    /// (Triton's flag; TCP keepalive, whole seconds; 0: never).
    #[arg(long, env = "KILN_GRPC_KEEPALIVE_TIME", default_value_t = 7_200_000)]
    grpc_keepalive_time: u64,
    /// Milliseconds a keepalive probe's answer may take before the connection is
    /// dropped (Triton's flag; whole seconds).
    #[arg(long, env = "KILN_GRPC_KEEPALIVE_TIMEOUT", default_value_t = 20_000)]
    grpc_keepalive_timeout: u64,
    /// Concurrent calls (HTTP/2 streams) per gRPC connection.
    #[arg(long, env = "KILN_GRPC_MAX_CONCURRENT_STREAMS", default_value_t = 128)]
    grpc_max_concurrent_streams: u32,
    /// Bytes that unfinished gRPC messages may hold, server-wide; a call whose
    /// message would go beyond is answered RESOURCE_EXHAUSTED.
    #[arg(long, env = "KILN_GRPC_MAX_PENDING_BYTES", default_value_t = 1 << 30)]
    grpc_max_pending_bytes: usize,
    /// TLS on both ports: the server's certificate chain (PEM).
    #[arg(long, env = "KILN_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "KILN_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: CA certificates (PEM) a client's certificate must chain to;
    /// clients without one are refused.
    #[arg(long, env = "KILN_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
}

impl ConnectionArgs {
    /// The TLS configurations of the HTTP and the gRPC port, when TLS is asked for.
    fn tls(&self) -> anyhow::Result<Option<(rustls::ServerConfig, rustls::ServerConfig)>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let files = kiln_server::tls::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: self.tls_client_ca.clone(),
        };
        // actix-web adds h2 and http/1.1 to the HTTP port's ALPN itself.
        let http = kiln_server::tls::server_config(&files, &[])?;
        let grpc = kiln_server::tls::server_config(&files, &[b"h2"])?;
        Ok(Some((http, grpc)))
    }
}

/// The `--log-format` named `name`.
fn parse_log_format(name: &str) -> Result<kiln_server::log_settings::LogFormat, String> {
    kiln_server::log_settings::LogFormat::from_name(name)
}

/// `secs` as a duration; an error for a negative, infinite or NaN value.
fn seconds(flag: &str, secs: f64) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(secs)
        .map_err(|_| anyhow::anyhow!("--{flag} {secs}: not a number of seconds"))
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => serve_main(*args),
        // No runtime, no logger: the host's plugin logs through stderr, which
        // the server reads into its own log.
        Command::WorkerHost(args) => {
            kiln_core::compute::isolation::host::run(args.control_fd, args.arena_fd)
                .map_err(anyhow::Error::msg)
        }
    }
}

#[actix_web::main]
async fn serve_main(args: ServeArgs) -> anyhow::Result<()> {
    kiln_server::log_settings::LogSettings::from_level(
        &args.log_level,
        args.log_file.as_deref(),
        args.log_format,
    )
    .and_then(kiln_server::log_settings::init)
    .map_err(anyhow::Error::msg)
    .context("cannot set up logging")?;
    let descriptors = match kiln_server::fdlimit::raise_to_hard() {
        Ok(limit) if limit.before < limit.soft => {
            spdlog::info!(
                "open-file limit (RLIMIT_NOFILE): soft {} raised to {} (hard {})",
                limit.before,
                limit.soft,
                limit.hard
            );
            limit.soft
        }
        Ok(limit) => {
            spdlog::info!("open-file limit (RLIMIT_NOFILE): {} (hard)", limit.soft);
            limit.soft
        }
        Err(e) => {
            let soft = kiln_server::fdlimit::soft_limit();
            spdlog::warn!("open-file limit (RLIMIT_NOFILE): cannot raise soft {soft}: {e}");
            soft
        }
    };
    let default_cap = kiln_server::fdlimit::default_max_connections(descriptors);
    let c = &args.connections;
    let grpc_limits = GrpcLimits {
        max_message_bytes: args.grpc_max_message_bytes,
        handshake_timeout: seconds("grpc-handshake-timeout", c.grpc_handshake_timeout)?,
        idle_timeout: seconds("grpc-idle-timeout", c.grpc_idle_timeout)?,
        keepalive_time: (c.grpc_keepalive_time > 0)
            .then(|| std::time::Duration::from_millis(c.grpc_keepalive_time)),
        keepalive_timeout: std::time::Duration::from_millis(c.grpc_keepalive_timeout),
        max_connections: c.grpc_max_connections.unwrap_or(default_cap),
        max_concurrent_streams: c.grpc_max_concurrent_streams,
        max_pending_bytes: c.grpc_max_pending_bytes,
    };
    let http_max_connections = c.http_max_connections.unwrap_or(default_cap);
    let (http_tls, grpc_tls) = c.tls().context("cannot set up TLS")?.unzip();
    let loads = args
        .load
        .iter()
        .map(|s| kiln_server::load_spec::parse_load_spec(s).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let restricted =
        RestrictedApis::parse(&args.http_restricted_api, &args.grpc_restricted_protocol)?;
    args.trace.configure()?;
    let server = Server::start(ServerConfig {
        plugin_dirs: args.plugin_dirs.clone(),
        model_repository: args.repository.model_repository.clone(),
        limits: args.limits(),
        trim_interval: (args.trim_interval_ms > 0)
            .then(|| std::time::Duration::from_millis(args.trim_interval_ms)),
        max_client_bytes: args.max_client_bytes,
        builtin_workers: Vec::new(),
    })?;
    server
        .shared_memory()
        .set_max_held_bytes(args.shm_max_held_bytes);
    server.set_model_control(args.repository.control())?;
    let poller = args
        .repository
        .start(&server)
        .await
        .map_err(anyhow::Error::msg)?;
    if let Some((poller, every)) = poller {
        actix_web::rt::spawn(poller.run(every));
    }
    for (worker, params) in loads {
        let endpoint = server
            .load(&worker, params)
            .await
            .with_context(|| format!("loading `{worker}` at start"))?;
        spdlog::info!("serving `{endpoint}`");
    }
    let jobs_config = args.jobs.config().map_err(anyhow::Error::msg)?;
    let jobs = kiln_server::jobs::Jobs::start(server.clone(), jobs_config)
        .context("cannot open the job store")?;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (http, addrs) = serve(
        server.clone(),
        HttpConfig {
            addr: SocketAddr::new(args.host, args.http_port),
            max_body_bytes: args.max_body_bytes,
            workers: args.http_workers.unwrap_or(cores),
            sched_batch: args.sched_batch,
            max_connections: http_max_connections,
            tls: http_tls,
            stream: kiln_server::stream::StreamConfig {
                sources: Some(args.media.opener().map_err(anyhow::Error::msg)?),
                ..args.stream.config().map_err(anyhow::Error::msg)?
            },
            jobs: Some(jobs.clone()),
            origins: kiln_server::http::origin::OriginPolicy::new(&args.cors_allow_origin)
                .and_then(|policy| policy.with_hosts(&args.allowed_host))
                .map_err(anyhow::Error::msg)?,
            restricted: std::sync::Arc::clone(&restricted.http),
        },
    )
    .with_context(|| format!("cannot listen on {}:{}", args.host, args.http_port))?;
    let grpc = GrpcServer::start(
        server.clone(),
        GrpcConfig {
            addr: SocketAddr::new(args.host, args.grpc_port),
            threads: args.grpc_threads.unwrap_or(cores),
            sched_batch: args.sched_batch,
            limits: grpc_limits,
            tls: grpc_tls.map(std::sync::Arc::new),
            restricted: restricted.grpc,
        },
    )
    .with_context(|| format!("cannot listen on {}:{} (gRPC)", args.host, args.grpc_port))?;
    // Caught from here on: a SIGTERM sent once the port is announced drains.
    let mut signals = StopSignals::new().context("cannot catch SIGTERM and SIGINT")?;
    for addr in &addrs {
        // Stable lines for scripts and tests that start kiln on port 0.
        println!("kiln: HTTP listening on {addr}");
        spdlog::info!("HTTP listening on {addr}");
    }
    println!("kiln: gRPC listening on {}", grpc.local_addr());
    spdlog::info!("gRPC listening on {}", grpc.local_addr());
    std::io::stdout().flush()?;
    server.set_ready(true);
    let http_handle = http.handle();
    let mut http = actix_web::rt::spawn(http);
    let exit_timeout = std::time::Duration::from_secs(args.exit_timeout_secs);
    let drained = tokio::select! {
        name = signals.recv() => {
            spdlog::info!(
                "stopping ({name}): not ready, refusing new requests, answering the accepted ones (--exit-timeout-secs {})",
                args.exit_timeout_secs
            );
            let deadline = tokio::time::Instant::now() + exit_timeout;
            server.begin_stopping();
            // The dispatcher stops first: its claimed jobs go back to the queue.
            let jobs_stopped = tokio::task::spawn_blocking({
                let jobs = jobs.clone();
                move || jobs.stop(exit_timeout)
            });
            let drained = drain::until_idle(&server, deadline, &mut signals).await;
            let _ = jobs_stopped.await;
            drained
        }
        // The HTTP server ended by itself (an error): stop the rest as before.
        served = &mut http => {
            served.context("the HTTP server failed")??;
            jobs.stop(exit_timeout);
            Drained::Idle
        }
    };
    // Answers being written finish; then the ports close.
    let grace = match drained {
        Drained::Idle => std::time::Duration::from_secs(1),
        Drained::TimedOut | Drained::Interrupted(_) => std::time::Duration::ZERO,
    };
    spdlog::info!("stopping: HTTP and gRPC");
    // (`stop` sends its command when called, not when awaited.)
    let graceful = !grace.is_zero()
        && tokio::time::timeout(grace, http_handle.stop(true))
            .await
            .is_ok();
    if !graceful {
        http_handle.stop(false).await;
    }
    grpc.stop(grace).await;
    if drained != Drained::Idle {
        let left = drain::left(&server);
        let why = match drained {
            Drained::Interrupted(name) => format!("{name} again"),
            _ => format!("--exit-timeout-secs {} expired", args.exit_timeout_secs),
        };
        spdlog::error!("stopping: {why}: cut {left}");
        kiln_core::observe::trace::shutdown();
        spdlog::default_logger().flush();
        anyhow::bail!("stopped before every accepted request was answered ({why}): cut {left}");
    }
    spdlog::info!("stopping: unloading every model");
    server.shutdown().await;
    kiln_core::observe::trace::shutdown();
    spdlog::info!("stopped: every accepted request was answered");
    spdlog::default_logger().flush();
    Ok(())
}
