//! What a name serves (issue #28, item 3): a worker group or an ensemble, as a
//! `Served`, with what they share (name, version, tensors, readiness,
//! statistics) read alike and what only a group has refused for an ensemble.
//! In process: `fake` (IN + 1) compiled in, and an ensemble `twice` in the
//! repository whose two steps run `fake` one after the other (IN + 2).

// Test support: a failed step should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kiln_core::models::Served;
use kiln_core::triton::{ModelConfig, ModelMetadata};
use kiln_core::ServerError;
use support::{request, Repository};

/// `twice`: `fake` run on the ensemble's input, then on the first step's output.
const TWICE: &str = r#"platform = "ensemble"
max_batch_size = 1
input = [{ name = "IN", data_type = "TYPE_UINT32", dims = [-1] }]
output = [{ name = "OUT", data_type = "TYPE_UINT32", dims = [-1] }]

[[ensemble_scheduling.step]]
model_name = "fake"
model_version = -1
input_map = { IN = "IN" }
output_map = { OUT = "mid" }

[[ensemble_scheduling.step]]
model_name = "fake"
model_version = -1
input_map = { IN = "mid" }
output_map = { OUT = "OUT" }
"#;

fn repository(name: &str) -> Repository {
    let repo = Repository::new(name);
    std::fs::create_dir_all(repo.0.join("twice")).unwrap();
    std::fs::write(repo.0.join("twice/config.toml"), TWICE).unwrap();
    repo
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_and_an_ensemble_are_served_alike_where_they_share() {
    let repo = repository("served-alike");
    let server = repo.server();
    // Loading the ensemble loads its step model from the repository too.
    server.load_model("twice", None, Vec::new()).await.unwrap();
    let fake = server.lookup("fake", None).unwrap();
    let twice = server.lookup("TWICE", None).unwrap();
    assert!(matches!(fake, Served::Group(_)));
    assert!(matches!(twice, Served::Ensemble(_)));

    // The shared part: name, version, tensors, readiness.
    assert_eq!((fake.endpoint(), fake.version()), ("fake", "2"));
    assert_eq!((twice.endpoint(), twice.version()), ("twice", "1"));
    assert_eq!(twice.info().inputs[0].name.as_str(), "IN");
    assert!(fake.is_ready() && twice.is_ready());

    // Both answer through the one inference path.
    let answer = server.infer(request("twice", &[40])).await.unwrap();
    assert_eq!(answer.outputs[0].values::<u32>(), vec![42]);
    assert_eq!(
        (answer.model_name.as_str(), answer.model_version.as_str()),
        ("twice", "1")
    );
    let answer = server.infer(request("fake", &[40])).await.unwrap();
    assert_eq!(answer.outputs[0].values::<u32>(), vec![41]);

    // Statistics: one ensemble request; its two steps and the direct request are
    // the group's.
    assert_eq!(twice.stats().snapshot().success.count, 1);
    assert_eq!(fake.stats().snapshot().success.count, 3);

    // Metadata and configuration from what each is: an ensemble has no batcher
    // or instances; a group has both.
    let (group_meta, ensemble_meta) = (ModelMetadata::of(&fake), ModelMetadata::of(&twice));
    assert_eq!(ensemble_meta.platform, "ensemble");
    assert!(ensemble_meta.group.is_none());
    assert_eq!(group_meta.group.map(|g| g.instances), Some(1));
    let config = ModelConfig::of(&twice);
    assert!(config.instance_group.is_none());
    assert_eq!(config.ensemble_scheduling.map(|s| s.len()), Some(2));
    assert!(ModelConfig::of(&fake).instance_group.is_some());

    // The repository index lists both as ready.
    let index = kiln_core::triton::repository_index(&server, false).unwrap();
    let states: Vec<(&str, &str)> = index.iter().map(|e| (e.name.as_str(), e.state)).collect();
    assert_eq!(states, [("fake", "READY"), ("twice", "READY")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ensemble_cannot_be_scaled_and_waits_for_its_steps_model() {
    let repo = repository("served-ensemble");
    let server = repo.server();
    server.load_model("twice", None, Vec::new()).await.unwrap();
    let twice = server.lookup("twice", None).unwrap();

    // What only a group has is refused for an ensemble, with a clear 400.
    let refused = server.scale("twice", 2).await.unwrap_err();
    assert!(
        matches!(refused, ServerError::InvalidRequest(_)),
        "{refused}"
    );
    assert!(refused.to_string().contains("is an ensemble"), "{refused}");
    assert!(twice.scalable().is_err());
    assert!(server.lookup("fake", None).unwrap().scalable().is_ok());

    // Its step's model unloaded: the ensemble stays, unavailable, and says why.
    server.unload("fake").await.unwrap();
    assert!(!twice.is_ready());
    let index = kiln_core::triton::repository_index(&server, true).unwrap();
    assert!(index.is_empty(), "nothing is ready: {index:?}");
    let failed = server.infer(request("twice", &[1])).await.unwrap_err();
    assert!(matches!(failed, ServerError::Unavailable(_)), "{failed}");

    // Loaded again: the Manager binds the steps again and the ensemble serves.
    server
        .load_model("fake", Some(1), Vec::new())
        .await
        .unwrap();
    assert!(twice.is_ready());
    let answer = server.infer(request("twice", &[1])).await.unwrap();
    assert_eq!(answer.outputs[0].values::<u32>(), vec![3]);

    // Unloaded, it is gone; its step model serves on.
    server.unload("twice").await.unwrap();
    assert!(matches!(
        server.lookup("twice", None),
        Err(ServerError::NotFound(_))
    ));
    assert!(server.lookup("fake", None).unwrap().is_ready());
}
