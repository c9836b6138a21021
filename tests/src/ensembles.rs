//! What the ensemble tests share (`tests/tests/ensembles.rs`,
//! `tests/tests/ensemble_failures.rs`): reading a model's statistics, and building
//! an ensemble's `config.toml`.

use serde_json::Value;

use crate::Kiln;

/// `GET path`: its status and JSON body (`null` when it has none).
pub async fn get(kiln: &Kiln, path: &str) -> (u16, Value) {
    let response = reqwest::get(format!("{}{path}", kiln.url)).await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A model's `inference_stats` counts: (success, fail) and its execution count.
pub async fn counts(kiln: &Kiln, model: &str) -> (u64, u64, u64) {
    let (status, stats) = get(kiln, &format!("/v2/models/{model}/stats")).await;
    assert_eq!(status, 200, "{stats}");
    let s = &stats["model_stats"][0];
    (
        s["inference_stats"]["success"]["count"].as_u64().unwrap(),
        s["inference_stats"]["fail"]["count"].as_u64().unwrap(),
        s["execution_count"].as_u64().unwrap(),
    )
}

/// An ensemble's `config.toml`: `max_batch_size` 8, these tensors (TOML inline
/// tables, comma-separated) and `steps` (from [`step`]).
pub fn graph(inputs: &str, outputs: &str, steps: &str) -> String {
    format!(
        "platform = \"ensemble\"\nmax_batch_size = 8\ninput = [{inputs}]\noutput = [{outputs}]\n{steps}"
    )
}

/// One `[[ensemble_scheduling.step]]`; the maps as TOML inline-table bodies.
pub fn step(model: &str, inputs: &str, outputs: &str) -> String {
    format!(
        "[[ensemble_scheduling.step]]\nmodel_name = \"{model}\"\ninput_map = {{ {inputs} }}\n\
         output_map = {{ {outputs} }}\n"
    )
}

/// An ensemble input `IN`, UINT32 [-1].
pub const IN_U32: &str = r#"{ name = "IN", data_type = "TYPE_UINT32", dims = [-1] }"#;
/// An ensemble output `OUT`, UINT32 [-1].
pub const OUT_U32: &str = r#"{ name = "OUT", data_type = "TYPE_UINT32", dims = [-1] }"#;
