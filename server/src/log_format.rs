//! How log lines are written (`--log-format`, and `log_format` of Triton's logging
//! extension). Every format writes a record's key-values (the `request_id` of a
//! line about a request, [`kiln_core::observe::request_log`]): the default format as
//! ` { request_id=… }`, ISO8601 likewise, JSON as its `kv` object.
//!
//! Lines carry what clients send (request ids, model and tensor names, values in
//! error messages), so every format writes one line per record whatever a client
//! put in it, and a bounded one: in the text formats control characters are
//! escaped (`\n`, `\r`, `\t`, `\u{1b}`: a newline in an id cannot forge a line)
//! and a line longer than [`MAX_LINE_BYTES`] is cut, saying how much was left out;
//! in JSON (whose strings escape control characters themselves) the payload and
//! each key-value are cut to [`MAX_JSON_FIELD_BYTES`]. So a failing request with a
//! 16 MiB id costs the log one bounded line.

use std::time::UNIX_EPOCH;

use spdlog::formatter::{Formatter, FormatterContext, FullFormatter};
use spdlog::{Level, Record, StringBuf};

/// The longest line the text formats write, in bytes (before its newline).
pub const MAX_LINE_BYTES: usize = 16 << 10;

/// The longest payload or key-value JSON lines carry, in bytes.
pub const MAX_JSON_FIELD_BYTES: usize = 8 << 10;

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
            LogFormat::Default => Box::new(OneLine(FullFormatter::new())),
            LogFormat::Iso8601 => Box::new(OneLine(Iso8601)),
            LogFormat::Json => Box::new(BoundedJson),
        }
    }
}

/// A text format's line made safe: control characters escaped (but the line's own
/// end), cut at [`MAX_LINE_BYTES`].
#[derive(Clone)]
struct OneLine<F>(F);

impl<F: Formatter + Clone> Formatter for OneLine<F> {
    fn format(
        &self,
        record: &Record,
        dest: &mut StringBuf,
        ctx: &mut FormatterContext,
    ) -> spdlog::Result<()> {
        let mut line = StringBuf::new();
        self.0.format(record, &mut line, ctx)?;
        let text = line.strip_suffix('\n').unwrap_or(&line);
        write_escaped(dest, text, MAX_LINE_BYTES).map_err(spdlog::Error::FormatRecord)?;
        dest.push('\n');
        Ok(())
    }
}

/// Writes `text` with control characters escaped, at most `max` bytes of it; what
/// is cut is said (`…[N more bytes]`).
fn write_escaped(dest: &mut impl std::fmt::Write, text: &str, max: usize) -> std::fmt::Result {
    let mut written = 0;
    for (at, c) in text.char_indices() {
        if written >= max {
            return write!(dest, "…[{} more bytes]", text.len() - at);
        }
        written += match c {
            '\n' => dest.write_str("\\n").map(|()| 2)?,
            '\r' => dest.write_str("\\r").map(|()| 2)?,
            '\t' => dest.write_str("\\t").map(|()| 2)?,
            c if c.is_control() => {
                write!(dest, "\\u{{{:x}}}", c as u32)?;
                6
            }
            c => dest.write_char(c).map(|()| c.len_utf8())?,
        };
    }
    Ok(())
}

/// `text` cut to at most `max` bytes (at a character's boundary), saying how
/// much was left out.
fn bounded(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…[{} more bytes]", &text[..end], text.len() - end).into()
}

/// spdlog's JSON line (`level`, `timestamp` in ms, `payload`, `kv`, `logger`,
/// `tid`) with the payload and the key-values bounded.
#[derive(Clone)]
struct BoundedJson;

impl Formatter for BoundedJson {
    fn format(
        &self,
        record: &Record,
        dest: &mut StringBuf,
        _ctx: &mut FormatterContext,
    ) -> spdlog::Result<()> {
        let mut line = serde_json::Map::new();
        line.insert("level".into(), record.level().as_str().into());
        let millis = record
            .time()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        line.insert("timestamp".into(), millis.into());
        line.insert(
            "payload".into(),
            bounded(record.payload(), MAX_JSON_FIELD_BYTES).into(),
        );
        let kv = record.key_values();
        if !kv.is_empty() {
            let values = kv
                .iter()
                .map(|(key, value)| {
                    let value = value.to_string();
                    let value = bounded(&value, MAX_JSON_FIELD_BYTES).into_owned();
                    (key.as_str().to_owned(), value.into())
                })
                .collect::<serde_json::Map<_, _>>();
            line.insert("kv".into(), values.into());
        }
        if let Some(logger) = record.logger_name() {
            line.insert("logger".into(), logger.into());
        }
        line.insert("tid".into(), record.tid().into());
        let text = serde_json::Value::Object(line).to_string();
        dest.push_str(&text);
        dest.push('\n');
        Ok(())
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

    #[test]
    fn client_text_is_escaped_and_bounded() {
        let mut out = String::new();
        write_escaped(&mut out, "a\nb\r\tc\u{1b}[31m", 100).unwrap();
        assert_eq!(out, "a\\nb\\r\\tc\\u{1b}[31m");
        out.clear();
        write_escaped(&mut out, &"x".repeat(1000), 10).unwrap();
        assert_eq!(out, format!("{}…[990 more bytes]", "x".repeat(10)));
        assert_eq!(bounded("héllo", 2), "h…[5 more bytes]");
        assert_eq!(bounded("ok", 2), "ok");
    }
}
