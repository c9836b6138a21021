//! How log lines are written (`--log-format`, and `log_format` of Triton's logging
//! extension). Every format writes a record's key-values (the `request_id` of a
//! line about a request, [`kiln_core::request_log`]): the default format as
//! ` { request_id=… }`, ISO8601 likewise, JSON as its `kv` object.

use std::time::UNIX_EPOCH;

use spdlog::formatter::{Formatter, FormatterContext, FullFormatter, JsonFormatter};
use spdlog::{Level, Record, StringBuf};

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// `[2026-11-25 06:18:35.123] [info] message { request_id=7 }` (local time).
    Default,
    /// Triton's `ISO8601`: `2026-11-25T06:18:35Z I message { request_id=7 }` (UTC).
    Iso8601,
    /// One JSON object a line:
    /// `{"level":"info","timestamp":…,"payload":"…","kv":{"request_id":"7"},"tid":…}`
    /// (the timestamp in milliseconds since the epoch).
    Json,
}

impl LogFormat {
    /// Its name, as Triton spells the first two.
    pub fn name(self) -> &'static str {
        match self {
            LogFormat::Default => "default",
            LogFormat::Iso8601 => "ISO8601",
            LogFormat::Json => "json",
        }
    }

    /// The format named `name` (`default`, `ISO8601`, `json`); the error names
    /// the choices.
    pub fn from_name(name: &str) -> Result<LogFormat, String> {
        [LogFormat::Default, LogFormat::Iso8601, LogFormat::Json]
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| format!("log_format `{name}` is not one of: default, ISO8601, json"))
    }

    /// The formatter writing lines in this format.
    pub fn formatter(self) -> Box<dyn Formatter> {
        match self {
            LogFormat::Default => Box::new(FullFormatter::new()),
            LogFormat::Iso8601 => Box::new(Iso8601),
            LogFormat::Json => Box::new(JsonFormatter::new()),
        }
    }
}

/// Triton's ISO8601 lines: `YYYY-MM-DDThh:mm:ssZ L message`, the time in UTC (as
/// Triton's, whatever the machine's time zone), `L` the level's initial.
#[derive(Clone)]
struct Iso8601;

impl Formatter for Iso8601 {
    fn format(
        &self,
        record: &Record,
        dest: &mut StringBuf,
        _ctx: &mut FormatterContext,
    ) -> spdlog::Result<()> {
        let secs = record
            .time()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let level = match record.level() {
            Level::Critical | Level::Error => 'E',
            Level::Warn => 'W',
            Level::Info => 'I',
            Level::Debug | Level::Trace => 'V',
        };
        let kv = record.key_values();
        write_line(dest, secs, level, record.payload(), kv.iter())
            .map_err(spdlog::Error::FormatRecord)
    }
}

/// Writes one line; `kv` are the record's key-values.
fn write_line<K: AsKey, V: std::fmt::Display>(
    dest: &mut impl std::fmt::Write,
    secs: u64,
    level: char,
    payload: &str,
    kv: impl Iterator<Item = (K, V)>,
) -> std::fmt::Result {
    let (year, month, day) = civil_from_days(secs / 86_400);
    let s = secs % 86_400;
    write!(
        dest,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z {level} {payload}",
        s / 3600,
        s / 60 % 60,
        s % 60,
    )?;
    let mut kv = kv.peekable();
    if kv.peek().is_some() {
        dest.write_str(" {")?;
        for (key, value) in kv {
            write!(dest, " {}={value}", key.key())?;
        }
        dest.write_str(" }")?;
    }
    dest.write_str("\n")
}

/// A key-value's key as text.
trait AsKey {
    fn key(&self) -> &str;
}

impl AsKey for spdlog::kv::Key<'_> {
    fn key(&self) -> &str {
        self.as_str()
    }
}

impl AsKey for &str {
    fn key(&self) -> &str {
        self
    }
}

/// The calendar date of `days` days after 1970-01-01 (proleptic Gregorian; Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc_calendar_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        // 2000-02-29, a leap day of a century divisible by 400.
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        // 2026-11-25.
        assert_eq!(civil_from_days(20_782), (2026, 11, 25));
        assert_eq!(civil_from_days(20_819), (2027, 1, 1));
    }

    #[test]
    fn iso8601_lines_carry_the_level_initial_and_the_key_values() {
        let mut line = String::new();
        // 2026-11-25 06:18:35 UTC.
        let secs = 20_782 * 86_400 + 6 * 3600 + 18 * 60 + 35;
        write_line(
            &mut line,
            secs,
            'W',
            "queue full",
            [("request_id", "r-7")].into_iter(),
        )
        .unwrap();
        assert_eq!(
            line,
            "2026-11-25T06:18:35Z W queue full { request_id=r-7 }\n"
        );
        line.clear();
        write_line(&mut line, 0, 'I', "up", std::iter::empty::<(&str, &str)>()).unwrap();
        assert_eq!(line, "1970-01-01T00:00:00Z I up\n");
    }
}
