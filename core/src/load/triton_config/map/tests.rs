use super::super::parse;
use super::*;

fn mapped(text: &str) -> Result<Mapped, String> {
    map("m", &parse(text).unwrap(), true)
}

fn params(text: &str) -> Vec<(String, String)> {
    match mapped(text).unwrap() {
        Mapped::Worker { params, .. } => params
            .into_iter()
            .map(|p| (p.key.to_string(), format!("{:?}", p.value)))
            .collect(),
        Mapped::Ensemble { .. } => panic!("not a worker"),
    }
}

#[test]
fn issue_example_maps_to_the_onnx_worker() {
    let p = params(
        r#"platform: "onnxruntime_onnx" max_batch_size: 16
           dynamic_batching { preferred_batch_size: [4, 8] }
           instance_group [{ count: 2, kind: KIND_CPU }]
           version_policy: { all {} }"#,
    );
    let get = |k: &str| p.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    assert_eq!(get("max_batch_size").as_deref(), Some("Int(16)"));
    assert_eq!(get("batch_size").as_deref(), Some("Int(16)"));
    assert!(get("batcher").unwrap().contains("dynamic"));
    assert!(get("preferred_batch_size").unwrap().contains("4,8"));
    assert_eq!(get("instances").as_deref(), Some("Int(2)"));
}

#[test]
fn backends_are_mapped_in_one_place_or_refused_by_name() {
    assert!(matches!(
        mapped("backend: \"onnxruntime\""),
        Ok(Mapped::Worker { worker: "onnx", .. })
    ));
    assert!(matches!(
        mapped("backend: \"python\""),
        Ok(Mapped::Worker {
            worker: "python",
            ..
        })
    ));
    let e = mapped("backend: \"tensorrt\"").unwrap_err();
    assert!(e.contains("`tensorrt`"), "{e}");
    let e = mapped("platform: \"tensorflow_savedmodel\"").unwrap_err();
    assert!(e.contains("`tensorflow_savedmodel`"), "{e}");
}

#[test]
fn fields_kiln_does_not_honour_are_refused_by_name() {
    for (text, field) in [
        (
            "backend: \"onnxruntime\" input [{ name: \"x\" optional: true }]",
            "input `x`: `optional: true` is not supported by kiln",
        ),
        (
            "platform: \"ensemble\" input [{ name: \"x\" reshape { shape: [ 1 ] } }]",
            "input.reshape.shape",
        ),
        (
            "backend: \"onnxruntime\" input [{ name: \"x\" is_shape_tensor: true }]",
            "input.is_shape_tensor",
        ),
        (
            "backend: \"onnxruntime\" sequence_batching { direct { minimum_slot_utilization: 0.5 } }",
            "sequence_batching.direct.minimum_slot_utilization",
        ),
        (
            "backend: \"onnxruntime\" sequence_batching { state [{ input_name: \"s\" \
             output_name: \"t\" initial_state [{ data_file: \"f\" }] }] }",
            "sequence_batching.state.initial_state.data_file",
        ),
        (
            "backend: \"onnxruntime\" response_cache { enable: true }",
            "response_cache.enable",
        ),
        (
            "backend: \"onnxruntime\" parameters { key: \"x\" value { string_value: \"1\" } }",
            "parameter `x`",
        ),
    ] {
        let e = mapped(text).unwrap_err();
        assert!(e.contains(field), "{text}: {e}");
    }
}

#[test]
fn declared_dims_and_reshapes_become_the_groups_and_the_model_sees_the_reshape() {
    let m = mapped(
        r#"backend: "onnxruntime" max_batch_size: 4
           input [{ name: "x" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape { shape: [ 4 ] } }]
           output [{ name: "y" data_type: TYPE_FP32 dims: [ 1 ] reshape { } },
                   { name: "z" data_type: TYPE_FP32 dims: [ 3 ] }]"#,
    )
    .unwrap();
    let Mapped::Worker {
        params, declared, ..
    } = m
    else {
        panic!("not a worker")
    };
    let get = |k: &str| {
        params
            .iter()
            .find(|p| p.key.as_str() == k)
            .map(|p| format!("{:?}", p.value))
    };
    assert!(get("dims.x").unwrap().contains("\"2,2\""));
    assert!(get("reshape.x").unwrap().contains("\"4\""));
    assert!(get("reshape.y").unwrap().contains("\"\""));
    assert!(get("dims.z").unwrap().contains("\"3\""));
    assert_eq!(get("reshape.z"), None);
    // Checked against the model: the shapes it sees.
    assert_eq!(declared.inputs[0].dims, vec![4]);
    assert_eq!(declared.outputs[0].dims, Vec::<i64>::new());
    assert_eq!(declared.outputs[1].dims, vec![3]);
}

#[test]
fn version_policies_pick_the_newest_they_allow() {
    let available = [1, 2, 3];
    assert_eq!(VersionPolicy::Latest(1).pick(&available, None), Some(3));
    assert_eq!(VersionPolicy::Latest(1).pick(&available, Some(2)), None);
    assert_eq!(VersionPolicy::Latest(2).pick(&available, Some(2)), Some(2));
    assert_eq!(VersionPolicy::All.pick(&available, Some(1)), Some(1));
    assert_eq!(
        VersionPolicy::Specific(vec![1, 2]).pick(&available, None),
        Some(2)
    );
    assert_eq!(
        VersionPolicy::Specific(vec![7]).pick(&available, None),
        None
    );
}

#[test]
fn ensembles_map_to_kiln_ensembles() {
    let m = mapped(
        r#"platform: "ensemble" max_batch_size: 0
           input [{ name: "IN" data_type: TYPE_UINT32 dims: [-1] }]
           output [{ name: "OUT" data_type: TYPE_UINT32 dims: [-1] }]
           ensemble_scheduling { step [{ model_name: "echo" model_version: -1
             input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } }] }"#,
    )
    .unwrap();
    let Mapped::Ensemble { config, .. } = m else {
        panic!("not an ensemble")
    };
    assert_eq!(config.steps[0].input_map["INPUT0"], "IN");
    assert_eq!(config.inputs[0].dims, vec![-1]);
}

#[test]
fn name_must_be_the_folder() {
    let e = mapped("name: \"other\" backend: \"onnxruntime\"").unwrap_err();
    assert!(e.contains("other"), "{e}");
}

#[test]
fn a_group_without_a_count_gets_tritons_default() {
    let instances = |text: &str| {
        params(text)
            .into_iter()
            .find(|(key, _)| key == "instances")
            .map(|(_, v)| v)
    };
    // ONNX Runtime on the CPU: 2, with no group, a CPU group, or an AUTO one without gpus.
    for text in [
        "backend: \"onnxruntime\"",
        "platform: \"onnxruntime_onnx\" instance_group [{ kind: KIND_CPU }]",
        "backend: \"onnxruntime\" instance_group [{ kind: KIND_AUTO }]",
    ] {
        assert_eq!(instances(text).as_deref(), Some("Int(2)"), "{text}");
    }
    // A count given, a GPU group, or another backend: as given, else 1.
    for (text, count) in [
        (
            "backend: \"onnxruntime\" instance_group [{ count: 3 kind: KIND_CPU }]",
            "Int(3)",
        ),
        (
            "backend: \"onnxruntime\" instance_group [{ kind: KIND_GPU }]",
            "Int(1)",
        ),
        ("backend: \"python\"", "Int(1)"),
        (
            "backend: \"python\" instance_group [{ kind: KIND_CPU }]",
            "Int(1)",
        ),
    ] {
        assert_eq!(instances(text).as_deref(), Some(count), "{text}");
    }
}
