//! The identity of a load's parameters: what makes two loads "the same
//! configuration" (one endpoint), whatever form their values arrived in.

use kiln_worker_sdk::{Param, ParamValue};

/// The identity of a parameter set: sorted lower-case keys with their values,
/// without `share`. Equal identities mean "the same configuration".
pub fn identity(params: &[Param]) -> String {
    let mut pairs: Vec<(String, String)> = params
        .iter()
        .filter(|p| !p.key.as_str().eq_ignore_ascii_case("share"))
        .map(|p| (p.key.as_str().to_ascii_lowercase(), value_text(&p.value)))
        .collect();
    // Stable sort by key, then keep the first of repeated keys: the value
    // `Params::get` would read.
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    pairs.dedup_by(|later, first| later.0 == first.0);
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// A value's canonical text: `2`, `2.0` and `"2"` are one value, as are `true`
/// and `"TRUE"`, so a CLI (text) and a JSON (typed) load agree.
fn value_text(value: &ParamValue) -> String {
    match value {
        ParamValue::Str(s) => {
            let t = s.trim();
            if let Ok(i) = t.parse::<i64>() {
                i.to_string()
            } else if let Ok(u) = t.parse::<u64>() {
                u.to_string()
            } else if let Ok(f) = t.parse::<f64>() {
                canonical_float(f)
            } else if t.eq_ignore_ascii_case("true") || t.eq_ignore_ascii_case("false") {
                t.to_ascii_lowercase()
            } else {
                s.to_string()
            }
        }
        ParamValue::Float(f) => canonical_float(*f),
        other => other.to_string(),
    }
}

fn canonical_float(f: f64) -> String {
    if f.fract() == 0.0 && f.abs() < 9e15 {
        (f as i64).to_string()
    } else {
        f.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::params_from_pairs;

    #[test]
    fn identity_ignores_order_case_and_share() {
        let a = params_from_pairs(&[("batch_size", "8"), ("Timeout", "5"), ("share", "false")]);
        let b = params_from_pairs(&[("timeout", "5"), ("batch_size", "8")]);
        assert_eq!(identity(&a), identity(&b));
        let c = params_from_pairs(&[("batch_size", "4")]);
        assert_ne!(identity(&a), identity(&c));
        // Text and typed values that mean the same are the same.
        let typed = vec![
            Param {
                key: "scale".into(),
                value: ParamValue::Float(2.0),
            },
            Param {
                key: "on".into(),
                value: ParamValue::Bool(true),
            },
        ];
        let text = params_from_pairs(&[("scale", "2.0"), ("on", "TRUE")]);
        assert_eq!(identity(&typed), identity(&text));
        // A repeated key counts with its first value, as `Params::get` reads it.
        let repeated = params_from_pairs(&[("x", "9"), ("x", "1")]);
        assert_eq!(identity(&repeated), "x=9");
    }
}
