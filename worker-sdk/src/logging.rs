//! Plugin logging: the host hands each plugin a callback; the SDK installs a `log`
//! logger in the plugin (globals are per library) that forwards to it, and a panic
//! hook that reports panics the same way.

use std::sync::OnceLock;

use abi_stable::std_types::RStr;
use abi_stable::StableAbi;

/// The host's logging callback.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct LogSink {
    /// `level`: 1 error, 2 warn, 3 info, 4 debug, 5 trace.
    pub log: extern "C" fn(level: u8, target: RStr<'_>, message: RStr<'_>),
}

static SINK: OnceLock<LogSink> = OnceLock::new();

struct Forward;

impl log::Log for Forward {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        if let Some(sink) = SINK.get() {
            let message = record.args().to_string();
            (sink.log)(
                record.level() as u8,
                record.target().into(),
                message.as_str().into(),
            );
        }
    }

    fn flush(&self) {}
}

static FORWARD: Forward = Forward;

/// Installs the host's sink for this plugin (first call wins).
pub fn install(sink: LogSink) {
    if SINK.set(sink).is_ok() {
        if log::set_logger(&FORWARD).is_ok() {
            log::set_max_level(log::LevelFilter::Trace);
        }
        std::panic::set_hook(Box::new(|info| {
            log::error!(target: "kiln_worker", "worker panicked: {info}");
        }));
    }
}
