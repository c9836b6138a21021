//! Triton's trace settings (its trace extension): `trace_level`, `trace_rate`,
//! `trace_count`, `log_frequency`, `trace_file` and `trace_mode`, server-wide and
//! per model. A model's setting that was never set (or was cleared) follows the
//! server's; a server setting cleared goes back to the operator's flag.
//!
//! Sampling is Triton's: with `trace_rate` N, every N-th request of a model is
//! traced, while `trace_count` (-1: no limit) traces remain. `trace_level` `OFF`
//! (the default) or a rate of 0 traces nothing.
//!
//! kiln exports spans over OTLP (`trace_mode` `opentelemetry`): it writes no trace
//! file, so `trace_file` is empty and `log_frequency` (how often Triton flushes its
//! file) is 0; a request naming a file is refused: files are the operator's.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Result, ServerError};

/// A setting's value as the protocols carry it: `trace_level` is a list, the rest
/// single strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettingValue {
    One(String),
    Many(Vec<String>),
}

impl SettingValue {
    /// The strings, one or many (gRPC's `SettingValue.value`).
    pub fn values(&self) -> Vec<String> {
        match self {
            SettingValue::One(v) => vec![v.clone()],
            SettingValue::Many(v) => v.clone(),
        }
    }
}

/// The settings in force, by name.
pub type SettingMap = BTreeMap<String, SettingValue>;

/// One change a request asks for: a setting's new strings, or `None` to clear it.
pub type Update = (String, Option<Vec<String>>);

/// What the operator started the server with (`--trace-level`, `--trace-rate`,
/// `--trace-count`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceConfig {
    /// Whether `TIMESTAMPS` (spans) is on.
    pub timestamps: bool,
    /// Every `rate`-th request is traced; 0 traces none.
    pub rate: u32,
    /// Traces left to take; -1: no limit.
    pub count: i64,
}

impl Default for TraceConfig {
    /// Triton's defaults: level `OFF`, rate 1000, no count limit.
    fn default() -> Self {
        TraceConfig {
            timestamps: false,
            rate: 1000,
            count: -1,
        }
    }
}

/// Settings given at one scope: `None` follows the wider scope.
#[derive(Debug, Clone, Copy, Default)]
struct Overrides {
    timestamps: Option<bool>,
    rate: Option<u32>,
    count: Option<i64>,
}

/// The settings a request is sampled under, with the counters they drive.
#[derive(Debug)]
pub(crate) struct Effective {
    config: TraceConfig,
    seen: AtomicU64,
    left: AtomicI64,
}

impl Effective {
    fn new(config: TraceConfig) -> Arc<Effective> {
        Arc::new(Effective {
            config,
            seen: AtomicU64::new(0),
            left: AtomicI64::new(config.count),
        })
    }

    /// Whether tracing can take any request under these settings.
    pub(crate) fn active(&self) -> bool {
        self.config.timestamps && self.config.rate > 0 && self.left.load(Ordering::Relaxed) != 0
    }

    /// Counts a request and says whether it is traced: every `rate`-th, while the
    /// count lasts.
    pub(crate) fn sample(&self) -> bool {
        if !self.active() {
            return false;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        if n % u64::from(self.config.rate) != 0 {
            return false;
        }
        // -1 (no limit) stays; a positive count is taken one at a time.
        self.left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| match left {
                0 => None,
                l if l < 0 => Some(l),
                l => Some(l - 1),
            })
            .is_ok()
    }

    fn map(&self) -> SettingMap {
        let c = &self.config;
        let level = if c.timestamps { "TIMESTAMPS" } else { "OFF" };
        let one = |v: String| SettingValue::One(v);
        SettingMap::from([
            ("trace_level".into(), SettingValue::Many(vec![level.into()])),
            ("trace_rate".into(), one(c.rate.to_string())),
            (
                "trace_count".into(),
                one(self.left.load(Ordering::Relaxed).to_string()),
            ),
            ("log_frequency".into(), one("0".into())),
            ("trace_file".into(), one(String::new())),
            ("trace_mode".into(), one("opentelemetry".into())),
        ])
    }
}

/// The server's and each model's settings (the process keeps one, in
/// [`crate::observe::trace`]).
#[derive(Debug)]
pub struct Table {
    operator: TraceConfig,
    server: Overrides,
    server_effective: Arc<Effective>,
    models: HashMap<String, (Overrides, Arc<Effective>)>,
}

impl Table {
    /// The settings an operator's flags give, with no request's change yet.
    pub fn new(operator: TraceConfig) -> Table {
        Table {
            operator,
            server: Overrides::default(),
            server_effective: Effective::new(operator),
            models: HashMap::new(),
        }
    }

    /// The settings `model`'s requests are sampled under.
    pub(crate) fn effective(&self, model: &str) -> &Arc<Effective> {
        self.models
            .get(model)
            .map_or(&self.server_effective, |(_, e)| e)
    }

    /// Whether the server's level is `TIMESTAMPS`.
    pub fn timestamps(&self) -> bool {
        self.server_effective.config.timestamps
    }

    /// Whether any scope can trace a request.
    pub(crate) fn any_active(&self) -> bool {
        self.server_effective.active() || self.models.values().any(|(_, e)| e.active())
    }

    /// The settings in force for `model` (`None`: the server's).
    pub(crate) fn get(&self, model: Option<&str>) -> SettingMap {
        match model {
            None => self.server_effective.map(),
            Some(m) => self.effective(m).map(),
        }
    }

    /// Applies `updates` to the server's (`None`) or `model`'s settings, all or
    /// none; the counters of the scopes they change start again.
    pub fn update(&mut self, model: Option<&str>, updates: &[Update]) -> Result<()> {
        let mut scope = match model {
            None => self.server,
            Some(m) => self.models.get(m).map(|(o, _)| *o).unwrap_or_default(),
        };
        for (name, value) in updates {
            apply(&mut scope, name, value.as_deref())?;
        }
        match model {
            None => {
                self.server = scope;
                self.server_effective = Effective::new(resolve(self.operator, scope));
                let server = self.server_effective.config;
                for (o, e) in self.models.values_mut() {
                    *e = Effective::new(resolve(server, *o));
                }
            }
            Some(m) => {
                let server = self.server_effective.config;
                self.models.insert(
                    m.to_owned(),
                    (scope, Effective::new(resolve(server, scope))),
                );
            }
        }
        Ok(())
    }
}

fn resolve(wider: TraceConfig, o: Overrides) -> TraceConfig {
    TraceConfig {
        timestamps: o.timestamps.unwrap_or(wider.timestamps),
        rate: o.rate.unwrap_or(wider.rate),
        count: o.count.unwrap_or(wider.count),
    }
}

fn apply(scope: &mut Overrides, name: &str, value: Option<&[String]>) -> Result<()> {
    let single = |value: &[String]| match value {
        [one] => Ok(one.trim().to_owned()),
        _ => Err(ServerError::invalid(format!(
            "trace setting `{name}` takes one value, got {}",
            value.len()
        ))),
    };
    match name {
        "trace_level" => scope.timestamps = value.map(level).transpose()?,
        "trace_rate" => {
            scope.rate = value
                .map(|v| {
                    let v = single(v)?;
                    v.parse::<u32>().map_err(|_| {
                        ServerError::invalid(format!(
                            "trace_rate must be a non-negative integer, got `{v}`"
                        ))
                    })
                })
                .transpose()?
        }
        "trace_count" => {
            scope.count = value
                .map(|v| {
                    let v = single(v)?;
                    v.parse::<i64>().ok().filter(|&c| c >= -1).ok_or_else(|| {
                        ServerError::invalid(format!(
                            "trace_count must be -1 (no limit) or a non-negative integer, got `{v}`"
                        ))
                    })
                })
                .transpose()?
        }
        "trace_mode" => match value.map(single).transpose()?.as_deref() {
            None | Some("opentelemetry") => {}
            Some(other) => {
                return Err(ServerError::invalid(format!(
                    "trace_mode `{other}` is not served: kiln exports OpenTelemetry spans (`opentelemetry`)"
                )))
            }
        },
        "trace_file" | "log_frequency" => {
            return Err(ServerError::invalid(format!(
                "trace setting `{name}` cannot be set by a request: kiln writes no trace file \
                 (spans are exported over OTLP, configured by the operator)"
            )))
        }
        other => {
            return Err(ServerError::invalid(format!(
                "unknown trace setting `{other}` (known: trace_level, trace_rate, trace_count, \
                 trace_mode, trace_file, log_frequency)"
            )))
        }
    }
    Ok(())
}

/// `trace_level`'s list: `OFF`, or `TIMESTAMPS`.
fn level(values: &[String]) -> Result<bool> {
    let mut timestamps = false;
    for v in values {
        match v.trim().to_ascii_uppercase().as_str() {
            "OFF" => {}
            "TIMESTAMPS" => timestamps = true,
            "TENSORS" => return Err(ServerError::invalid(
                "trace_level TENSORS is not served: kiln's spans carry timestamps, not tensor data",
            )),
            other => {
                return Err(ServerError::invalid(format!(
                    "unknown trace_level `{other}` (OFF or TIMESTAMPS)"
                )))
            }
        }
    }
    if timestamps && values.iter().any(|v| v.trim().eq_ignore_ascii_case("OFF")) {
        return Err(ServerError::invalid(
            "trace_level OFF cannot be given with another level",
        ));
    }
    Ok(timestamps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(name: &str, v: Option<&[&str]>) -> Update {
        (
            name.into(),
            v.map(|v| v.iter().map(|s| s.to_string()).collect()),
        )
    }

    #[test]
    fn every_nth_request_while_the_count_lasts() {
        let mut t = Table::new(TraceConfig::default());
        assert!(!t.effective("m").sample(), "level OFF traces nothing");
        t.update(
            None,
            &[
                up("trace_level", Some(&["TIMESTAMPS"])),
                up("trace_rate", Some(&["3"])),
                up("trace_count", Some(&["2"])),
            ],
        )
        .unwrap();
        let taken: Vec<bool> = (0..9).map(|_| t.effective("m").sample()).collect();
        assert_eq!(
            taken,
            [true, false, false, true, false, false, false, false, false]
        );
        assert_eq!(t.get(None)["trace_count"], SettingValue::One("0".into()));
        assert!(!t.any_active());
    }

    #[test]
    fn a_model_follows_the_server_until_set_and_after_clearing() {
        let mut t = Table::new(TraceConfig {
            timestamps: true,
            rate: 1,
            count: -1,
        });
        t.update(Some("m"), &[up("trace_rate", Some(&["7"]))])
            .unwrap();
        assert_eq!(
            t.get(Some("m"))["trace_rate"],
            SettingValue::One("7".into())
        );
        t.update(None, &[up("trace_level", Some(&["OFF"]))])
            .unwrap();
        assert_eq!(
            t.get(Some("m"))["trace_level"],
            SettingValue::Many(vec!["OFF".into()])
        );
        t.update(Some("m"), &[up("trace_rate", None)]).unwrap();
        assert_eq!(
            t.get(Some("m"))["trace_rate"],
            SettingValue::One("1".into())
        );
        t.update(None, &[up("trace_level", None)]).unwrap();
        assert!(
            t.effective("m").sample(),
            "cleared: the operator's level again"
        );
    }

    #[test]
    fn bad_updates_change_nothing() {
        let mut t = Table::new(TraceConfig::default());
        for bad in [
            up("trace_file", Some(&["/etc/passwd"])),
            up("log_frequency", Some(&["5"])),
            up("trace_rate", Some(&["-1"])),
            up("trace_count", Some(&["-2"])),
            up("trace_level", Some(&["TENSORS"])),
            up("trace_level", Some(&["OFF", "TIMESTAMPS"])),
            up("trace_mode", Some(&["triton"])),
            up("colour", Some(&["blue"])),
        ] {
            let before = t.get(None);
            let updates = [up("trace_rate", Some(&["5"])), bad.clone()];
            assert!(t.update(None, &updates).is_err(), "{bad:?}");
            assert_eq!(t.get(None), before);
        }
    }
}
