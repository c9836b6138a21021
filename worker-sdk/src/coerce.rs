//! The one coercion of a parameter's value to the type a reader wants, shared by
//! [`Params`](crate::Params)' getters (workers, request parameters) and the
//! server's load-parameter deserializer (`kiln_core::params`): a CLI and gRPC's
//! string parameters give text, so `"8"` is an integer and `"TRUE"` a boolean.

use kiln_types::ParamValue;

/// A value that does not have the type its reader wants; `key` names the
/// parameter as the reader asked for it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoerceError {
    /// Not an integer, nor text that parses as one.
    #[error("parameter `{key}` must be an integer, got `{got}`")]
    NotInteger { key: String, got: String },
    /// An unsigned integer beyond `i64::MAX`.
    #[error("parameter `{key}`: {got} is too large (the most is {})", i64::MAX)]
    TooLarge { key: String, got: u64 },
    /// Not a boolean, 0/1, nor `true`/`false`/`yes`/`no`/`1`/`0` text.
    #[error("parameter `{key}` must be a boolean, got `{got}`")]
    NotBool { key: String, got: String },
    /// Not a number, nor text that parses as one.
    #[error("parameter `{key}` must be a number, got `{got}`")]
    NotNumber { key: String, got: String },
}

/// `value` as an integer: an `Int`, or a `Str` that parses as one.
pub fn int(key: &str, value: &ParamValue) -> Result<i64, CoerceError> {
    match value {
        ParamValue::Int(v) => Ok(*v),
        ParamValue::Str(s) => s.trim().parse().map_err(|_| CoerceError::NotInteger {
            key: key.to_owned(),
            got: s.to_string(),
        }),
        ParamValue::Uint(v) => Err(CoerceError::TooLarge {
            key: key.to_owned(),
            got: *v,
        }),
        other => Err(CoerceError::NotInteger {
            key: key.to_owned(),
            got: other.to_string(),
        }),
    }
}

/// `value` as a boolean: a `Bool`, an `Int` 0/1, or `true`/`false`/`yes`/`no`/`1`/`0`
/// text in any case.
pub fn bool(key: &str, value: &ParamValue) -> Result<bool, CoerceError> {
    let not_bool = |got: String| CoerceError::NotBool {
        key: key.to_owned(),
        got,
    };
    match value {
        ParamValue::Bool(v) => Ok(*v),
        ParamValue::Int(0) => Ok(false),
        ParamValue::Int(1) => Ok(true),
        ParamValue::Str(s) => match s.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => Err(not_bool(s.to_string())),
        },
        other => Err(not_bool(other.to_string())),
    }
}

/// `value` as a float: any number, or text that parses as one.
pub fn float(key: &str, value: &ParamValue) -> Result<f64, CoerceError> {
    match value {
        ParamValue::Float(v) => Ok(*v),
        ParamValue::Int(v) => Ok(*v as f64),
        ParamValue::Uint(v) => Ok(*v as f64),
        ParamValue::Str(s) => s.trim().parse().map_err(|_| CoerceError::NotNumber {
            key: key.to_owned(),
            got: s.to_string(),
        }),
        other => Err(CoerceError::NotNumber {
            key: key.to_owned(),
            got: other.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_takes_the_type_and_errors_name_the_key() {
        let text = |s: &str| ParamValue::Str(s.into());
        assert_eq!(int("k", &text(" 8 ")), Ok(8));
        assert_eq!(bool("k", &text("YES")), Ok(true));
        assert_eq!(bool("k", &ParamValue::Int(0)), Ok(false));
        assert_eq!(float("k", &ParamValue::Int(2)), Ok(2.0));
        assert_eq!(
            int("k", &text("x")).unwrap_err().to_string(),
            "parameter `k` must be an integer, got `x`"
        );
        assert_eq!(
            int("k", &ParamValue::Uint(u64::MAX))
                .unwrap_err()
                .to_string(),
            format!(
                "parameter `k`: {} is too large (the most is {})",
                u64::MAX,
                i64::MAX
            )
        );
        assert_eq!(
            bool("k", &ParamValue::Int(2)).unwrap_err().to_string(),
            "parameter `k` must be a boolean, got `2`"
        );
        assert_eq!(
            float("k", &ParamValue::Bool(true)).unwrap_err().to_string(),
            "parameter `k` must be a number, got `true`"
        );
    }
}
