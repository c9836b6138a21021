//! The repository's tests: configs read, versions picked, errors named.

use super::*;

fn repo(files: &[(&str, &str)]) -> (Repository, PathBuf) {
    let root = std::env::temp_dir().join(format!(
        "kiln-repo-{}-{}",
        std::process::id(),
        files.len() + files.first().map_or(0, |f| f.1.len())
    ));
    let _ = std::fs::remove_dir_all(&root);
    for (path, text) in files {
        let p = root.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    (Repository::new(root.clone()), root)
}

#[test]
fn resolves_latest_version_and_overrides() {
    let (r, root) = repo(&[
        (
            "m/config.toml",
            "worker = \"echo\"\n[parameters]\nbatch_size = 4\nscale = 1.5\n",
        ),
        ("m/1/model.onnx", ""),
        ("m/3/model.onnx", ""),
        ("other/readme", ""),
    ]);
    assert_eq!(
        r.index().unwrap(),
        vec![Entry {
            name: "m".into(),
            versions: vec![1, 3]
        }]
    );
    let m = r
        .resolve(
            "m",
            None,
            vec![Param {
                key: "batch_size".into(),
                value: ParamValue::Int(8),
            }],
        )
        .unwrap();
    assert_eq!((m.worker.as_str(), m.version), ("echo", 3));
    let p = kiln_worker_sdk::Params(&m.params);
    assert_eq!(p.int("batch_size").unwrap(), Some(8));
    assert_eq!(p.float("scale").unwrap(), Some(1.5));
    assert!(p.string("model_dir").unwrap().ends_with("m/3"));
    assert_eq!(r.resolve("m", Some(1), vec![]).unwrap().version, 1);
    assert!(matches!(
        r.resolve("m", Some(2), vec![]),
        Err(ServerError::NotFound(_))
    ));
    assert!(matches!(
        r.resolve("nope", None, vec![]),
        Err(ServerError::NotFound(_))
    ));
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn nested_tables_and_quoted_keys_are_dotted_parameters() {
    let (r, root) = repo(&[
        (
            "s/config.toml",
            "worker = \"accumulate\"\n[parameters]\n\"input.sr\" = 16000\n\
             control.start = \"START\"\n[parameters.state]\nSTATE = \"STATE_OUT\"\n",
        ),
        ("s/1/x", ""),
    ]);
    let m = r.resolve("s", None, vec![]).unwrap();
    let p = kiln_worker_sdk::Params(&m.params);
    assert_eq!(p.int("input.sr").unwrap(), Some(16000));
    assert_eq!(p.string("control.start").as_deref(), Some("START"));
    assert_eq!(p.string("state.STATE").as_deref(), Some("STATE_OUT"));
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn lists_are_comma_separated_text() {
    let (r, root) = repo(&[
        (
            "l/config.toml",
            "worker = \"echo\"\n[parameters]\npreferred_batch_size = [4, \"8\"]\n",
        ),
        ("l/1/x", ""),
    ]);
    let m = r.resolve("l", None, vec![]).unwrap();
    let p = kiln_worker_sdk::Params(&m.params);
    assert_eq!(p.string("preferred_batch_size").as_deref(), Some("4,8"));
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn invalid_config_names_file_and_field() {
    let (r, root) = repo(&[
        ("bad/config.toml", "worker = \"echo\"\nbatchsize = 4\n"),
        ("bad/1/x", ""),
        (
            "arr/config.toml",
            "worker = \"echo\"\n[parameters]\nsizes = [1, 2]\n",
        ),
        ("arr/1/x", ""),
    ]);
    let e = r.resolve("bad", None, vec![]).unwrap_err().to_string();
    assert!(
        e.contains("bad/config.toml") && e.contains("batchsize"),
        "{e}"
    );
    let e = r.resolve("arr", None, vec![]).unwrap_err().to_string();
    assert!(
        e.contains("arr/config.toml") && e.contains("parameters.sizes"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn an_ensemble_declares_steps_instead_of_a_worker() {
    let ensemble = "platform = \"ensemble\"\nmax_batch_size = 4\n\
         input = [{ name = \"IN\", data_type = \"TYPE_STRING\", dims = [-1] }]\n\
         output = [{ name = \"OUT\", data_type = \"UINT32\", dims = [2] }]\n\
         [[ensemble_scheduling.step]]\nmodel_name = \"m\"\nmodel_version = 3\n\
         input_map = { INPUT0 = \"IN\" }\noutput_map = { OUTPUT0 = \"OUT\" }\n";
    let (r, root) = repo(&[
        ("e/config.toml", ensemble),
        (
            "both/config.toml",
            "worker = \"echo\"\nplatform = \"ensemble\"\n",
        ),
        ("neither/config.toml", "[parameters]\nx = 1\n"),
        ("tensors/config.toml", "worker = \"echo\"\nmax_batch_size = 4\n"),
        ("other/config.toml", "platform = \"onnxruntime_onnx\"\n"),
        (
            "dtype/config.toml",
            "platform = \"ensemble\"\ninput = [{ name = \"A\", data_type = \"TYPE_FLOAT\", dims = [] }]\n",
        ),
    ]);
    let e = r.resolve("e", None, vec![]).unwrap();
    // No version folder: version 1.
    assert_eq!((e.worker.as_str(), e.version), ("ensemble", 1));
    let Serving::Ensemble(config) = e.serving else {
        panic!("not an ensemble");
    };
    assert_eq!(config.max_batch_size, 4);
    assert_eq!(config.inputs[0].data_type, kiln_worker_sdk::DataType::Bytes);
    assert_eq!(config.outputs[0].dims, vec![2]);
    assert_eq!(config.steps[0].model_version, 3);
    assert_eq!(config.steps[0].input_map["INPUT0"], "IN");
    let overridden = vec![Param {
        key: "batch_size".into(),
        value: ParamValue::Int(8),
    }];
    assert!(r.resolve("e", None, overridden).is_err());
    for (name, wanted) in [
        ("both", "exclude each other"),
        ("neither", "set `worker`"),
        ("tensors", "an ensemble's"),
        ("other", "platform `onnxruntime_onnx` is not known"),
        ("dtype", "unknown data_type `TYPE_FLOAT`"),
    ] {
        let e = r.resolve(name, None, vec![]).unwrap_err().to_string();
        assert!(
            e.contains(wanted) && e.contains("config.toml"),
            "{name}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn the_version_policy_picks_the_versions_served() {
    let (r, root) = repo(&[
        ("one/config.toml", "worker = \"echo\"\n"),
        ("one/1/x", ""),
        ("one/2/x", ""),
        ("one/3/x", ""),
        (
            "two/config.toml",
            "worker = \"echo\"\nversion_policy = { latest = 2 }\n",
        ),
        ("two/1/x", ""),
        ("two/2/x", ""),
        ("two/3/x", ""),
        (
            "all/config.toml",
            "worker = \"echo\"\nversion_policy = \"all\"\n",
        ),
        ("all/1/x", ""),
        ("all/2/x", ""),
        (
            "some/config.toml",
            "worker = \"echo\"\nversion_policy = { specific = [1, 3, 9] }\n",
        ),
        ("some/1/x", ""),
        ("some/2/x", ""),
        ("some/3/x", ""),
        (
            "none/config.toml",
            "worker = \"echo\"\nversion_policy = { specific = [9] }\n",
        ),
        ("none/1/x", ""),
        (
            "zero/config.toml",
            "worker = \"echo\"\nversion_policy = { latest = 0 }\n",
        ),
        ("zero/1/x", ""),
        (
            "odd/config.toml",
            "worker = \"echo\"\nversion_policy = \"newest\"\n",
        ),
        ("odd/1/x", ""),
    ]);
    let served = |name: &str| -> Vec<u64> {
        let m = r.resolve(name, None, vec![]).unwrap();
        for (v, params) in &m.versions {
            let dir = kiln_worker_sdk::Params(params).string("model_dir").unwrap();
            assert!(dir.ends_with(&format!("{name}/{v}")), "{dir}");
        }
        assert_eq!(Some(m.version), m.versions.last().map(|(v, _)| *v));
        m.versions.iter().map(|(v, _)| *v).collect()
    };
    assert_eq!(served("one"), [3]);
    assert_eq!(served("two"), [2, 3]);
    assert_eq!(served("all"), [1, 2]);
    assert_eq!(served("some"), [1, 3]);
    // A load naming a version serves it alone, whatever the policy.
    let m = r.resolve("two", Some(1), vec![]).unwrap();
    assert_eq!(m.versions.iter().map(|(v, _)| *v).collect::<Vec<_>>(), [1]);
    let e = r.resolve("none", None, vec![]).unwrap_err().to_string();
    assert!(
        e.contains(
            "at least one version must be available under the version policy of model 'none'"
        ),
        "{e}"
    );
    for bad in ["zero", "odd"] {
        let e = r.resolve(bad, None, vec![]).unwrap_err().to_string();
        assert!(
            e.contains("version_policy") && e.contains("config.toml"),
            "{bad}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(root);
}
