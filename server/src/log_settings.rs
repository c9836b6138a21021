//! The process's logger and its settings: what `--log-level`, `--log-file` and
//! `--log-format` set at start, and what Triton's logging extension
//! (`GET/POST /v2/logging`, gRPC `LogSettings`) reads and changes while kiln runs.
//!
//! Every record goes through a [`LevelGate`] sink that holds Triton's four switches
//! (info, warnings, errors, verbose level), then to the console and, with a log file,
//! to the file (the console then shows only warnings and worse). The logger's own
//! filter is kept at the most verbose level switched on, so a disabled record is
//! not even formatted. The log file is the operator's: a request may read its path
//! but never change it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

pub use crate::log_format::LogFormat;

use parking_lot::Mutex;
use spdlog::formatter::Formatter;
use spdlog::sink::{FileSink, Sink, SinkPropAccess, StdStream, StdStreamSink};
use spdlog::{ErrorHandler, Level, LevelFilter, Logger, Record};

/// A setting refused (400 over REST, `INVALID_ARGUMENT` over gRPC).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LogSettingError(pub String);

/// Triton's log settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSettings {
    /// The log file (`--log-file`); `None`: the console only.
    pub file: Option<PathBuf>,
    pub info: bool,
    pub warnings: bool,
    pub errors: bool,
    /// 0: no verbose records; 1: debug; 2 and up: trace too.
    pub verbose: u32,
    pub format: LogFormat,
}

impl LogSettings {
    /// The settings a `--log-level` (`error`, `warn`, `info`, `debug`, `trace`)
    /// stands for.
    pub fn from_level(level: &str, file: Option<&Path>, format: LogFormat) -> Result<Self, String> {
        let level: Level = level
            .parse()
            .map_err(|_| format!("unknown log level `{level}`"))?;
        let on = |l: Level| LevelFilter::MoreSevereEqual(level).test(l);
        Ok(LogSettings {
            file: file.map(Path::to_path_buf),
            info: on(Level::Info),
            warnings: on(Level::Warn),
            errors: on(Level::Error),
            verbose: u32::from(on(Level::Debug)) + u32::from(on(Level::Trace)),
            format,
        })
    }

    fn enables(&self, level: Level) -> bool {
        match level {
            Level::Critical | Level::Error => self.errors,
            Level::Warn => self.warnings,
            Level::Info => self.info,
            Level::Debug => self.verbose >= 1,
            Level::Trace => self.verbose >= 2,
        }
    }

    /// The logger's filter: the most verbose level switched on and all above it
    /// (the gate drops the ones switched off in between).
    fn logger_filter(&self) -> LevelFilter {
        let levels = [
            Level::Trace,
            Level::Debug,
            Level::Info,
            Level::Warn,
            Level::Error,
        ];
        levels
            .into_iter()
            .find(|&l| self.enables(l))
            .map_or(LevelFilter::MoreSevereEqual(Level::Critical), |l| {
                LevelFilter::MoreSevereEqual(l)
            })
    }
}

/// One setting a request changes.
#[derive(Debug, Clone, PartialEq)]
pub enum LogSettingValue {
    Bool(bool),
    Uint(u32),
    String(String),
}

/// Forwards the records of the levels switched on to the real sinks.
struct LevelGate {
    /// Indexed by `Level as usize`.
    enabled: [AtomicBool; Level::count()],
    sinks: Vec<Arc<dyn Sink>>,
}

impl LevelGate {
    fn set(&self, settings: &LogSettings) {
        for level in Level::iter() {
            self.enabled[level as usize].store(settings.enables(level), Ordering::Relaxed);
        }
    }
}

impl SinkPropAccess for LevelGate {
    fn level_filter(&self) -> LevelFilter {
        LevelFilter::All
    }

    fn set_level_filter(&self, _: LevelFilter) {
        // The gate's filter is its switches ([`LevelGate::set`]).
    }

    fn set_formatter(&self, formatter: Box<dyn Formatter>) {
        for sink in &self.sinks {
            sink.set_formatter(formatter.clone());
        }
    }

    fn set_error_handler(&self, handler: ErrorHandler) {
        for sink in &self.sinks {
            sink.set_error_handler(handler.clone());
        }
    }
}

impl Sink for LevelGate {
    fn log(&self, record: &Record) -> spdlog::Result<()> {
        if !self.enabled[record.level() as usize].load(Ordering::Relaxed) {
            return Ok(());
        }
        for sink in &self.sinks {
            if sink.should_log(record.level()) {
                sink.log(record)?;
            }
        }
        Ok(())
    }

    fn flush(&self) -> spdlog::Result<()> {
        for sink in &self.sinks {
            sink.flush()?;
        }
        Ok(())
    }
}

/// The process's log settings, changed only through [`update`].
struct Control {
    settings: Mutex<LogSettings>,
    gate: Arc<LevelGate>,
    logger: Arc<Logger>,
}

static CONTROL: OnceLock<Control> = OnceLock::new();

/// Installs the default logger with `settings` (once per process; a second call
/// changes nothing and fails).
///
/// Also installs `tracing`'s no-op subscriber, once per process: kiln logs through
/// spdlog, and without a subscriber every span that h2, hyper and tonic open (several
/// per gRPC call) still goes through `tracing`'s `log` fallback.
pub fn init(settings: LogSettings) -> Result<(), String> {
    // Fails only when a subscriber is already installed, which is as good.
    let _ = tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::new());
    let console_filter = if settings.file.is_some() {
        LevelFilter::MoreSevereEqual(Level::Warn)
    } else {
        LevelFilter::All
    };
    let console = StdStreamSink::builder()
        .std_stream(StdStream::Stderr)
        .level_filter(console_filter)
        .build()
        .map_err(|e| e.to_string())?;
    let mut sinks: Vec<Arc<dyn Sink>> = vec![Arc::new(console)];
    if let Some(path) = &settings.file {
        let file = FileSink::builder()
            .path(path)
            .build()
            .map_err(|e| format!("log file {}: {e}", path.display()))?;
        sinks.push(Arc::new(file));
    }
    let gate = Arc::new(LevelGate {
        enabled: Default::default(),
        sinks,
    });
    gate.set(&settings);
    kiln_core::observe::request_log::set_verbose(settings.enables(Level::Debug));
    gate.set_formatter(settings.format.formatter());
    let logger = Arc::new(
        Logger::builder()
            .sink(Arc::clone(&gate) as Arc<dyn Sink>)
            .level_filter(settings.logger_filter())
            .flush_level_filter(LevelFilter::MoreSevereEqual(Level::Info))
            .build()
            .map_err(|e| e.to_string())?,
    );
    let control = Control {
        settings: Mutex::new(settings),
        gate,
        logger: Arc::clone(&logger),
    };
    CONTROL
        .set(control)
        .map_err(|_| "logging is already set up".to_owned())?;
    spdlog::set_default_logger(logger);
    Ok(())
}

/// The settings in force; `None` when [`init`] was not called (an embedding
/// application that logs its own way).
pub fn settings() -> Option<LogSettings> {
    CONTROL.get().map(|c| c.settings.lock().clone())
}

/// Applies `changes` (Triton's names: `log_info`, `log_warnings`, `log_errors`,
/// `log_verbose_level`, `log_format`, and `log_file`, which may only be given its
/// current value) all or none, and returns the settings now in force.
pub fn update(changes: &[(String, LogSettingValue)]) -> Result<LogSettings, LogSettingError> {
    let control = CONTROL
        .get()
        .ok_or_else(|| LogSettingError("this process does not manage its logging".into()))?;
    let mut settings = control.settings.lock();
    let mut next = settings.clone();
    for (name, value) in changes {
        apply(&mut next, name, value)?;
    }
    if next.format != settings.format {
        control.gate.set_formatter(next.format.formatter());
    }
    control.gate.set(&next);
    control.logger.set_level_filter(next.logger_filter());
    kiln_core::observe::request_log::set_verbose(next.enables(Level::Debug));
    *settings = next.clone();
    Ok(next)
}

fn apply(
    settings: &mut LogSettings,
    name: &str,
    value: &LogSettingValue,
) -> Result<(), LogSettingError> {
    let wrong = |kind: &str| LogSettingError(format!("{name} must be {kind}, got {value:?}"));
    match (name, value) {
        ("log_info", LogSettingValue::Bool(b)) => settings.info = *b,
        ("log_warnings", LogSettingValue::Bool(b)) => settings.warnings = *b,
        ("log_errors", LogSettingValue::Bool(b)) => settings.errors = *b,
        ("log_info" | "log_warnings" | "log_errors", _) => return Err(wrong("a boolean")),
        ("log_verbose_level", LogSettingValue::Uint(n)) => settings.verbose = *n,
        ("log_verbose_level", _) => return Err(wrong("an unsigned integer")),
        ("log_format", LogSettingValue::String(s)) => {
            settings.format = LogFormat::from_name(s).map_err(LogSettingError)?
        }
        ("log_format", _) => return Err(wrong("a string")),
        ("log_file", LogSettingValue::String(s)) => {
            let current = settings
                .file
                .as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            if *s != current {
                return Err(LogSettingError(format!(
                    "log_file is the operator's to set (--log-file); it is `{current}`"
                )));
            }
        }
        ("log_file", _) => return Err(wrong("a string")),
        _ => {
            return Err(LogSettingError(format!(
                "unknown log setting `{name}` (known: log_file, log_info, log_warnings, \
                 log_errors, log_verbose_level, log_format)"
            )))
        }
    }
    Ok(())
}

/// Settings as Triton's name/value pairs, in Triton's order.
pub fn as_pairs(settings: &LogSettings) -> Vec<(&'static str, LogSettingValue)> {
    let file = settings
        .file
        .as_deref()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    vec![
        ("log_file", LogSettingValue::String(file)),
        ("log_info", LogSettingValue::Bool(settings.info)),
        ("log_warnings", LogSettingValue::Bool(settings.warnings)),
        ("log_errors", LogSettingValue::Bool(settings.errors)),
        ("log_verbose_level", LogSettingValue::Uint(settings.verbose)),
        (
            "log_format",
            LogSettingValue::String(settings.format.name().to_owned()),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_level_stands_for_triton_switches() {
        let s = LogSettings::from_level("warn", None, LogFormat::Default).unwrap();
        assert!(s.errors && s.warnings && !s.info && s.verbose == 0);
        let s = LogSettings::from_level("trace", None, LogFormat::Json).unwrap();
        assert!(s.errors && s.warnings && s.info && s.verbose == 2);
        assert_eq!(
            s.logger_filter(),
            LevelFilter::MoreSevereEqual(Level::Trace)
        );
        assert!(LogSettings::from_level("loud", None, LogFormat::Default).is_err());
    }

    #[test]
    fn changes_are_checked_by_name_and_type_and_the_file_stays() {
        let mut s = LogSettings::from_level(
            "info",
            Some(Path::new("/var/log/kiln.log")),
            LogFormat::Default,
        )
        .unwrap();
        apply(&mut s, "log_verbose_level", &LogSettingValue::Uint(1)).unwrap();
        assert_eq!(
            s.logger_filter(),
            LevelFilter::MoreSevereEqual(Level::Debug)
        );
        apply(
            &mut s,
            "log_format",
            &LogSettingValue::String("ISO8601".into()),
        )
        .unwrap();
        assert_eq!(s.format, LogFormat::Iso8601);
        let refused = [
            ("log_info", LogSettingValue::Uint(1)),
            ("log_verbose_level", LogSettingValue::Bool(true)),
            ("log_format", LogSettingValue::String("xml".into())),
            ("log_file", LogSettingValue::String("/tmp/elsewhere".into())),
            ("log_warning", LogSettingValue::Bool(true)),
        ];
        for (name, value) in refused {
            assert!(apply(&mut s, name, &value).is_err(), "{name} {value:?}");
        }
        apply(
            &mut s,
            "log_file",
            &LogSettingValue::String("/var/log/kiln.log".into()),
        )
        .unwrap();
        // Info off, warnings on: the logger still lets debug through to the gate.
        apply(&mut s, "log_info", &LogSettingValue::Bool(false)).unwrap();
        assert!(!s.enables(Level::Info) && s.enables(Level::Debug) && s.enables(Level::Warn));
    }
}
