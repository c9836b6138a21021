//! A reader of the Prometheus text exposition format (version 0.0.4), as much of
//! it as the remote target needs: each sample's name, labels and value. Comments
//! (`# HELP`, `# TYPE`, `# EOF`) and blank lines are skipped; timestamps after the
//! value are ignored; label values are unescaped (`\\`, `\"`, `\n`).

use thiserror::Error;

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A line that is not a sample of the text format.
#[derive(Debug, Error, PartialEq)]
#[error("metrics line {line}: {reason}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    pub reason: &'static str,
}

/// Every sample of `text`, in order; the first malformed line is an error (a
/// half-read exposition is no reading).
pub fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    let mut samples = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let error = |reason| ParseError {
            line: index + 1,
            reason,
        };
        samples.push(parse_sample(line).map_err(error)?);
    }
    Ok(samples)
}

fn parse_sample(line: &str) -> Result<Sample, &'static str> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        return Err("bad metric name");
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let value = rest.split_ascii_whitespace().next().ok_or("no value")?;
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value: parse_value(value)?,
    })
}

/// Reads `key="value",...}` into `labels`; returns what follows the `}`.
fn parse_labels<'a>(
    mut text: &'a str,
    labels: &mut Vec<(String, String)>,
) -> Result<&'a str, &'static str> {
    loop {
        text = text.trim_start();
        if let Some(rest) = text.strip_prefix('}') {
            return Ok(rest);
        }
        let (key, after) = text.split_once('=').ok_or("label without '='")?;
        let key = key.trim();
        if key.is_empty() {
            return Err("empty label name");
        }
        let body = after
            .trim_start()
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut chars = body.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value"),
                Some((i, '"')) => break i + 1,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    _ => return Err("bad escape in label value"),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key.to_owned(), value));
        text = body[end..].trim_start();
        text = text.strip_prefix(',').unwrap_or(text);
    }
}

fn parse_value(text: &str) -> Result<f64, &'static str> {
    match text {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => text.parse().map_err(|_| "value is not a number"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_with_and_without_labels() {
        let text = "# HELP kiln_pending_requests Requests.\n\
                    # TYPE kiln_pending_requests gauge\n\
                    kiln_pending_requests{model=\"echo\"} 3\n\
                    process_open_fds 12 1700000000000\n\
                    \n\
                    kiln_batch_size_bucket{model=\"a\",le=\"+Inf\"} 7\n";
        let samples = parse(text).unwrap();
        assert_eq!(samples.len(), 3);
        assert_eq!(samples[0].name, "kiln_pending_requests");
        assert_eq!(samples[0].label("model"), Some("echo"));
        assert_eq!(samples[0].value, 3.0);
        assert_eq!(samples[1].name, "process_open_fds");
        assert!(samples[1].labels.is_empty());
        assert_eq!(samples[1].value, 12.0);
        assert_eq!(samples[2].label("le"), Some("+Inf"));
    }

    #[test]
    fn escaped_label_values_and_special_floats() {
        let text = "m{a=\"x\\\"y, z}\",b=\"back\\\\slash\\nline\"} +Inf\nn -Inf\no NaN\np 1.5e3\n";
        let samples = parse(text).unwrap();
        assert_eq!(samples[0].label("a"), Some("x\"y, z}"));
        assert_eq!(samples[0].label("b"), Some("back\\slash\nline"));
        assert_eq!(samples[0].value, f64::INFINITY);
        assert_eq!(samples[1].value, f64::NEG_INFINITY);
        assert!(samples[2].value.is_nan());
        assert_eq!(samples[3].value, 1500.0);
    }

    #[test]
    fn malformed_lines_are_errors_naming_the_line() {
        for (text, reason) in [
            ("ok 1\nno_value\n", "no value"),
            ("ok 1\nm{a=\"b 1\n", "unterminated label value"),
            ("ok 1\nm{a=\"b\" 1\n", "label without '='"),
            ("ok 1\nm{a=b} 1\n", "label value not quoted"),
            ("ok 1\nm not-a-number\n", "value is not a number"),
            ("ok 1\nm-x 1\n", "bad metric name"),
            ("ok 1\nm{a=\"\\q\"} 1\n", "bad escape in label value"),
        ] {
            assert_eq!(parse(text), Err(ParseError { line: 2, reason }), "{text:?}");
        }
    }
}
