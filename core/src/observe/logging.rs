//! Plugins log through a callback into the process's default spdlog logger (which
//! the binary sets up: `kiln_server::log_settings`).

use kiln_worker_sdk::reexports::RStr;
use kiln_worker_sdk::LogSink;
use spdlog::Level;

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
