//! Logging through spdlog-rs: the console, and optionally a file. With a file, the
//! file gets everything at the chosen level and the console only warnings and worse.
//! Plugins log through a callback into the same logger.

use std::path::Path;
use std::sync::Arc;

use kiln_worker_sdk::reexports::RStr;
use kiln_worker_sdk::LogSink;
use spdlog::sink::{FileSink, Sink, StdStream, StdStreamSink};
use spdlog::{Level, LevelFilter, Logger};

/// Installs the default logger. `level` is `error`, `warn`, `info`, `debug` or `trace`.
///
/// Also installs `tracing`'s no-op subscriber, once per process: kiln logs through
/// spdlog, and without a subscriber every span that h2, hyper and tonic open (several
/// per gRPC call) still goes through `tracing`'s `log` fallback.
pub fn init(level: &str, file: Option<&Path>) -> Result<(), String> {
    // Fails only when a subscriber is already installed, which is as good.
    let _ = tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::new());
    let level: Level = level
        .parse()
        .map_err(|_| format!("unknown log level `{level}`"))?;
    let chosen = LevelFilter::MoreSevereEqual(level);
    let console_filter = if file.is_some() {
        LevelFilter::MoreSevereEqual(Level::Warn)
    } else {
        chosen
    };
    let console = StdStreamSink::builder()
        .std_stream(StdStream::Stderr)
        .level_filter(console_filter)
        .build()
        .map_err(|e| e.to_string())?;
    let mut sinks: Vec<Arc<dyn Sink>> = vec![Arc::new(console)];
    if let Some(path) = file {
        let file_sink = FileSink::builder()
            .path(path)
            .level_filter(chosen)
            .build()
            .map_err(|e| format!("log file {}: {e}", path.display()))?;
        sinks.push(Arc::new(file_sink));
    }
    let logger = Logger::builder()
        .sinks(sinks)
        .level_filter(chosen)
        .flush_level_filter(LevelFilter::MoreSevereEqual(Level::Info))
        .build()
        .map_err(|e| e.to_string())?;
    spdlog::set_default_logger(Arc::new(logger));
    Ok(())
}

extern "C" fn plugin_log(level: u8, target: RStr<'_>, message: RStr<'_>) {
    // `log` levels: 1 error .. 5 trace.
    let level = match level {
        1 => Level::Error,
        2 => Level::Warn,
        3 => Level::Info,
        4 => Level::Debug,
        _ => Level::Trace,
    };
    spdlog::log!(level, "[plugin {}] {}", target.as_str(), message.as_str());
}

/// The callback handed to every plugin.
pub fn plugin_log_sink() -> LogSink {
    LogSink { log: plugin_log }
}
