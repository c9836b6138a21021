//! Which load parameters anyone knows: the server's (read from its settings
//! type, [`super::schema`]), the repository's `model_dir`, and the worker's
//! declarations. An unknown one is refused with the closest known name.

use kiln_worker_sdk::{Param, ParamScope, ParamSpec};

use super::error::ParamError;
use super::schema::server_keys;
use super::scope::OPERATOR_ONLY;

/// Whether load parameter `key` takes a list: JSON's and TOML's `[4, 8]` arrive
/// as the text `"4,8"` (the server's list settings, [`server_keys`]).
pub fn takes_list(key: &str) -> bool {
    server_keys().iter().any(|k| k.list && k.matches(key))
}

/// Refuses the first parameter in `params` that neither the server (the names
/// [`LoadParams`](super::LoadParams) takes, [`server_keys`], and the
/// repository's [`OPERATOR_ONLY`]) nor the worker's load-time declarations
/// (`specs`) know, naming it, the closest known name and every known one.
/// Case-insensitive. What passes is either a server setting or the worker's own
/// (`LoadParams`' [`Rest`](super::Rest)).
pub fn check_known(subject: &str, specs: &[ParamSpec], params: &[Param]) -> Result<(), ParamError> {
    let load = || specs.iter().filter(|s| s.scope != ParamScope::Request);
    for param in params {
        let key = param.key.as_str();
        if server_keys().iter().any(|k| k.matches(key))
            || OPERATOR_ONLY.iter().any(|k| k.eq_ignore_ascii_case(key))
            || load().any(|s| s.matches(key))
        {
            continue;
        }
        if specs.iter().any(|s| s.matches(key)) {
            return Err(ParamError::RequestOnly {
                key: key.to_owned(),
                subject: subject.to_owned(),
            });
        }
        let mut known: Vec<&str> = server_keys()
            .iter()
            .map(|k| k.pattern.as_str())
            .chain(OPERATOR_ONLY.iter().copied())
            .chain(load().map(ParamSpec::name))
            .collect();
        known.sort_unstable();
        known.dedup();
        return Err(ParamError::Unknown {
            key: key.to_owned(),
            subject: subject.to_owned(),
            hint: closest(key, &known)
                .map(|name| format!(" (did you mean `{name}`?)"))
                .unwrap_or_default(),
            known: known.join(", "),
        });
    }
    Ok(())
}

/// The known name `key` most likely meant: one that ends in `.key`, else the
/// nearest within a small edit distance.
fn closest<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    let key = key.to_ascii_lowercase();
    let suffix = format!(".{key}");
    if let Some(name) = known.iter().copied().find(|n| n.ends_with(&suffix)) {
        return Some(name);
    }
    let limit = (key.len() / 3).clamp(1, 3);
    known
        .iter()
        .map(|n| (edit_distance(&key, n), *n))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, n)| n)
}

/// Levenshtein distance (by characters).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != *cb))
                .min(above + 1)
                .min(row[j] + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ServerError;
    use kiln_worker_sdk::{params_from_pairs, ParamKind};

    const ECHO: &[ParamSpec] = &[
        ParamSpec::load("max_batch_size", ParamKind::Int { min: 1, max: 256 }),
        ParamSpec::operator("runtime"),
        ParamSpec::load("batch_axis.*", ParamKind::Any),
        ParamSpec::request("increment", ParamKind::Any),
    ];

    fn unknown(pairs: &[(&str, &str)]) -> Option<String> {
        check_known("worker `echo`", ECHO, &params_from_pairs(pairs))
            .err()
            .map(|e| ServerError::from(e).to_string())
    }

    #[test]
    fn known_parameters_pass() {
        let fine = [
            ("Batch_Size", "4"),
            ("max_batch_size", "8"),
            ("runtime", "x"),
            ("batch_axis.state", "1"),
            ("default_queue_policy.allow_timeout_override", "true"),
            ("priority_queue_policy.2.timeout_action", "DELAY"),
            ("state.in.put", "out"),
            ("state_initial.in.put", "1"),
            ("control.corrid", "C"),
            ("max_candidate_sequences", "2"),
            ("model_dir", "/m"),
        ];
        assert_eq!(unknown(&fine), None);
    }

    #[test]
    fn unknown_parameters_are_named_with_the_known_ones() {
        let e = unknown(&[("batch_size", "4"), ("allow_timeout_override", "true")]).unwrap();
        assert!(
            e.starts_with(
                "unknown parameter `allow_timeout_override` for worker `echo` (did you mean \
                 `default_queue_policy.allow_timeout_override`?); known: batch_axis.*, batch_size, batcher,"
            ),
            "{e}"
        );
        assert!(
            e.contains("max_batch_size") && !e.contains("increment"),
            "{e}"
        );
        let e = unknown(&[("max_bath_size", "4")]).unwrap();
        assert!(e.contains("(did you mean `max_batch_size`?)"), "{e}");
        let e = unknown(&[("zzzzzz", "4")]).unwrap();
        assert!(e.contains("`zzzzzz`") && !e.contains("did you mean"), "{e}");
        for bad in [
            "priority_queue_policy.x.timeout_action",
            "priority_queue_policy.1.timeout",
            "state.",
            "control.begin",
            "batch_axis.",
        ] {
            assert!(unknown(&[(bad, "1")]).is_some(), "{bad}");
        }
        let e = unknown(&[("increment", "1")]).unwrap();
        assert!(
            e.contains("`increment`") && e.contains("request parameter"),
            "{e}"
        );
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("incremnet", "increment"), 2);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("timeout", "timeout"), 0);
    }

    #[test]
    fn lists_are_the_list_settings() {
        for key in [
            "preferred_batch_size",
            "Preferred_Batch_Size",
            "state_dims.in.put",
        ] {
            assert!(takes_list(key), "{key}");
        }
        for key in ["batch_size", "state_dims.", "state.in", "priority_levels"] {
            assert!(!takes_list(key), "{key}");
        }
    }
}
