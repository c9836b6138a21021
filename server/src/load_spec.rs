//! `kiln serve --load`'s specs (`WORKER[:key=value,...]`), read where the flag is:
//! the operator's text into a worker name and its parameters, which the server
//! then checks as any load's (`kiln_core::params`). kiln-load's `--load` reads the
//! same form.

use kiln_core::{Param, ParamValue};

/// A `--load` spec that does not parse (see [`parse_load_spec`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadSpecError {
    /// Nothing before the `:`.
    #[error("--load `{spec}`: no worker name")]
    NoWorker { spec: String },
    /// A parameter without its `=`.
    #[error("--load `{spec}`: `{pair}` is not key=value")]
    NotKeyValue { spec: String, pair: String },
    /// A list left open.
    #[error("--load `{spec}`: `[` without its `]`")]
    Unclosed { spec: String },
}

/// Parses `WORKER[:key=value,...]`, the form of `kiln serve --load`. A value in
/// brackets is a list: `preferred_batch_size=[4,8]` is `preferred_batch_size` with
/// the text `4,8`, the form JSON's and TOML's `[4, 8]` take (commas inside the
/// brackets do not separate parameters). Values are text; the worker name is
/// lower-cased.
pub fn parse_load_spec(spec: &str) -> Result<(String, Vec<Param>), LoadSpecError> {
    let (worker, rest) = spec.split_once(':').unwrap_or((spec, ""));
    if worker.trim().is_empty() {
        return Err(LoadSpecError::NoWorker {
            spec: spec.to_owned(),
        });
    }
    let mut pairs = Vec::new();
    let (mut start, mut depth) = (0, 0usize);
    for (i, c) in rest.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                pairs.push(&rest[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(LoadSpecError::Unclosed {
            spec: spec.to_owned(),
        });
    }
    pairs.push(&rest[start..]);
    let mut params = Vec::new();
    for pair in pairs.into_iter().filter(|p| !p.trim().is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(LoadSpecError::NotKeyValue {
                spec: spec.to_owned(),
                pair: pair.to_owned(),
            });
        };
        let value = value.trim();
        let value = match value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) {
            Some(items) => items
                .split(',')
                .map(str::trim)
                .collect::<Vec<_>>()
                .join(","),
            None => value.to_owned(),
        };
        params.push(Param {
            key: key.trim().into(),
            value: ParamValue::Str(value.as_str().into()),
        });
    }
    Ok((worker.trim().to_ascii_lowercase(), params))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_specs_take_lists_in_brackets() {
        let (w, p) =
            parse_load_spec("Echo:batcher=dynamic, preferred_batch_size=[4, 8],timeout=2").unwrap();
        assert_eq!(w, "echo");
        let text: Vec<(&str, String)> = p
            .iter()
            .map(|p| (p.key.as_str(), p.value.to_string()))
            .collect();
        assert_eq!(
            text,
            [
                ("batcher", "dynamic".to_owned()),
                ("preferred_batch_size", "4,8".to_owned()),
                ("timeout", "2".to_owned())
            ]
        );
        assert_eq!(
            parse_load_spec("echo:preferred_batch_size=[4,8").unwrap_err(),
            LoadSpecError::Unclosed {
                spec: "echo:preferred_batch_size=[4,8".into()
            }
        );
        assert!(parse_load_spec("echo:batch_size").is_err());
        assert!(parse_load_spec(":x=1").is_err());
        assert_eq!(parse_load_spec("invert-image").unwrap().1.len(), 0);
    }
}
