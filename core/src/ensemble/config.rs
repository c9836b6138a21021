//! An ensemble's `config.toml`, in the names of Triton's model configuration:
//!
//! ```toml
//! platform = "ensemble"
//! max_batch_size = 0                 # default: the ensemble's tensors carry no batch dim
//!
//! [[input]]
//! name = "IN"
//! data_type = "TYPE_UINT32"          # Triton's name, or the protocol's ("UINT32")
//! dims = [-1]
//!
//! [[output]]
//! name = "OUT"
//! data_type = "TYPE_UINT32"
//! dims = [-1]
//!
//! [[ensemble_scheduling.step]]
//! model_name = "echo"
//! model_version = -1                 # default: the loaded version, whichever it is
//! input_map = { INPUT0 = "IN" }      # the step model's input = the ensemble tensor it reads
//! output_map = { OUTPUT0 = "OUT" }   # the step model's output = the ensemble tensor it writes
//! ```

use std::collections::BTreeMap;

use kiln_worker_sdk::DataType;
use serde::{Deserialize, Deserializer};

/// One declared tensor of the ensemble (Triton's `ModelInput` / `ModelOutput`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorConfig {
    pub name: String,
    #[serde(deserialize_with = "data_type")]
    pub data_type: DataType,
    /// Without the batch dimension when `max_batch_size > 0`; -1: any size.
    pub dims: Vec<i64>,
}

/// Triton's `ensemble_scheduling`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnsembleScheduling {
    pub step: Vec<StepConfig>,
}

/// One step (Triton's `ModelEnsembling.Step`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepConfig {
    pub model_name: String,
    /// -1 (the default): whichever version is loaded; else that version only.
    #[serde(default = "latest")]
    pub model_version: i64,
    /// The step model's input → the ensemble tensor it reads.
    #[serde(default)]
    pub input_map: BTreeMap<String, String>,
    /// The step model's output → the ensemble tensor it writes.
    #[serde(default)]
    pub output_map: BTreeMap<String, String>,
}

fn latest() -> i64 {
    -1
}

/// What a repository model declares when it is an ensemble.
#[derive(Debug, Clone, PartialEq)]
pub struct EnsembleConfig {
    /// 0: the ensemble's tensors have no batch dimension of their own.
    pub max_batch_size: u32,
    pub inputs: Vec<TensorConfig>,
    pub outputs: Vec<TensorConfig>,
    pub steps: Vec<StepConfig>,
}

/// Triton's `TYPE_FP32` (`TYPE_STRING` for BYTES) or the protocol's `FP32`.
fn data_type<'de, D: Deserializer<'de>>(de: D) -> Result<DataType, D::Error> {
    let name = String::deserialize(de)?;
    parse_data_type(&name).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "unknown data_type `{name}` (Triton's names, e.g. TYPE_FP32, TYPE_STRING, \
             or the protocol's, e.g. FP32, BYTES)"
        ))
    })
}

/// A datatype by Triton's or the protocol's name.
pub fn parse_data_type(name: &str) -> Option<DataType> {
    match name.strip_prefix("TYPE_") {
        Some("STRING") => Some(DataType::Bytes),
        Some(rest) => DataType::parse(rest),
        None => DataType::parse(name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_types_by_either_name() {
        assert_eq!(parse_data_type("TYPE_FP32"), Some(DataType::Fp32));
        assert_eq!(parse_data_type("TYPE_STRING"), Some(DataType::Bytes));
        assert_eq!(parse_data_type("BYTES"), Some(DataType::Bytes));
        assert_eq!(parse_data_type("UINT8"), Some(DataType::Uint8));
        assert_eq!(parse_data_type("TYPE_BYTES"), Some(DataType::Bytes));
        assert_eq!(parse_data_type("float"), None);
    }
}
