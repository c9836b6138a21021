//! The model's signature and its Triton model config, from the load parameters.
//!
//! A python model declares its tensors in `config.toml` (`"input.INPUT0" =
//! "UINT32 [-1]"`, `"output.OUTPUT0" = ...`, `max_batch_size`, `"parameters.k" =
//! "v"`), and `initialize(args)` gets them back as Triton's model config JSON
//! (`args["model_config"]`). [`Signature::model_config`] builds that JSON; a
//! `model_config` load parameter (the JSON itself, e.g. from a `config.pbtxt`)
//! replaces it as it is. A model's `auto_complete_config` may add to it
//! ([`Signature::complete`]).

use kiln_worker_sdk::{DataType, Params, TensorSpec, MAX_RANK};
use serde_json::{json, Map, Value};

/// What `config.toml` says about the model's tensors.
pub struct Signature {
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    pub max_batch_size: u32,
    /// `parameters.<key>` values, in Triton's `{"string_value": ...}` form.
    parameters: Map<String, Value>,
    /// A `model_config` parameter's JSON, used as it is.
    config: Option<String>,
}

impl Signature {
    /// Reads `input.*`, `output.*`, `max_batch_size`, `parameters.*`, `model_config`.
    pub fn from_params(params: Params<'_>) -> Result<Signature, String> {
        let mut signature = Signature {
            inputs: Vec::new(),
            outputs: Vec::new(),
            max_batch_size: 0,
            parameters: Map::new(),
            config: params.string("model_config"),
        };
        if let Some(n) = params.int("max_batch_size")? {
            signature.max_batch_size =
                u32::try_from(n).map_err(|_| format!("max_batch_size {n} is out of range"))?;
        }
        for param in params.0 {
            let key = param.key.as_str();
            let text = Params(std::slice::from_ref(param))
                .string(key)
                .unwrap_or_default();
            if let Some(name) = strip_prefix(key, "input.") {
                signature.inputs.push(tensor(key, name, &text)?);
            } else if let Some(name) = strip_prefix(key, "output.") {
                signature.outputs.push(tensor(key, name, &text)?);
            } else if let Some(name) = strip_prefix(key, "parameters.") {
                signature
                    .parameters
                    .insert(name.to_owned(), json!({ "string_value": text }));
            }
        }
        Ok(signature)
    }

    /// Takes the tensors and max batch size of a completed config (Triton's JSON,
    /// from the model's `auto_complete_config`), which `initialize` then gets.
    pub fn complete(&mut self, config: &str) -> Result<(), String> {
        let bad = |why: String| format!("auto_complete_config: {why}");
        let value: Value = serde_json::from_str(config).map_err(|e| bad(e.to_string()))?;
        let read = |kind: &str| -> Result<Vec<TensorSpec>, String> {
            let entries = value.get(kind).and_then(Value::as_array);
            entries
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|t| {
                    let name = t["name"].as_str().unwrap_or_default();
                    let dtype = t["data_type"].as_str().unwrap_or_default();
                    let dims: Vec<String> = t["dims"]
                        .as_array()
                        .map(Vec::as_slice)
                        .unwrap_or_default()
                        .iter()
                        .map(|d| d.as_str().map_or_else(|| d.to_string(), str::to_owned))
                        .collect();
                    let text = format!("{dtype} [{}]", dims.join(", "));
                    tensor(&format!("{kind} `{name}`"), name, &text).map_err(bad)
                })
                .collect()
        };
        self.inputs = read("input")?;
        self.outputs = read("output")?;
        self.max_batch_size = match &value["max_batch_size"] {
            Value::Null => 0,
            n => n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad(format!("max_batch_size {n} is out of range")))?,
        };
        self.config = Some(config.to_owned());
        Ok(())
    }

    /// Whether the model can be served: it has outputs.
    pub fn check(&self) -> Result<(), String> {
        if self.outputs.is_empty() {
            return Err("a python model declares its outputs: \
                 \"output.<name>\" = \"<DATATYPE> [dims]\" in config.toml's [parameters], \
                 or add_output in its auto_complete_config"
                .into());
        }
        Ok(())
    }

    /// Triton's model config as JSON, as the python backend hands it to
    /// `initialize` (`args["model_config"]`).
    pub fn model_config(&self, name: &str, instances: i64) -> String {
        if let Some(config) = &self.config {
            return config.clone();
        }
        let tensors = |specs: &[TensorSpec]| -> Vec<Value> {
            specs
                .iter()
                .map(|t| {
                    json!({
                        "name": t.name.as_str(),
                        "data_type": format!("TYPE_{}", triton_name(t.dtype)),
                        "dims": t.dims.as_slice(),
                    })
                })
                .collect()
        };
        let mut config = json!({
            "name": name,
            "backend": "python",
            "max_batch_size": self.max_batch_size,
            "input": tensors(&self.inputs),
            "output": tensors(&self.outputs),
            "instance_group": [{ "name": name, "kind": "KIND_CPU", "count": instances }],
            "parameters": self.parameters,
        });
        if self.max_batch_size > 0 {
            config["dynamic_batching"] = json!({});
        }
        config.to_string()
    }
}

/// `key` without `prefix` (matched ignoring case, as parameter keys are).
fn strip_prefix<'k>(key: &'k str, prefix: &str) -> Option<&'k str> {
    let head = key.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &key[prefix.len()..])
        .filter(|name| !name.is_empty())
}

/// Triton's config name of a datatype (`TYPE_` + this): BYTES is `STRING`.
fn triton_name(dtype: DataType) -> &'static str {
    match dtype {
        DataType::Bytes => "STRING",
        other => other.as_str(),
    }
}

/// `"FP32 [3, 48, 192]"` (or Triton's `TYPE_FP32`, `TYPE_STRING`) as a tensor.
fn tensor(key: &str, name: &str, text: &str) -> Result<TensorSpec, String> {
    let bad = |why: &str| {
        format!(
            "`{key}` = \"{text}\": {why}; expected \"<DATATYPE> [dims]\", e.g. \"FP32 [-1, 3]\""
        )
    };
    let (dtype, dims) = text
        .split_once('[')
        .ok_or_else(|| bad("no dims in brackets"))?;
    let dtype = dtype.trim();
    let dtype = dtype.strip_prefix("TYPE_").unwrap_or(dtype);
    let dtype = match dtype {
        "STRING" => DataType::Bytes,
        other => DataType::parse(other).ok_or_else(|| bad("unknown datatype"))?,
    };
    let dims = dims
        .trim_end()
        .strip_suffix(']')
        .ok_or_else(|| bad("no closing bracket"))?;
    let dims: Vec<i64> = dims
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| match d.parse::<i64>() {
            Ok(n) if n >= -1 => Ok(n),
            _ => Err(bad("dims are integers, -1 for any size")),
        })
        .collect::<Result<_, _>>()?;
    if dims.len() >= MAX_RANK {
        return Err(bad("too many dims"));
    }
    Ok(TensorSpec::new(name, dtype, &dims))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::params_from_pairs;

    #[test]
    fn reads_tensors_and_builds_tritons_config() {
        let params = params_from_pairs(&[
            ("max_batch_size", "8"),
            ("input.x", "TYPE_FP32 [3, 48, 192]"),
            ("output.save_infer_model/scale_0.tmp_1", "FP32 [2]"),
            ("parameters.intra_op_num_threads", "2"),
        ]);
        let s = Signature::from_params(Params(&params)).unwrap();
        let config: Value = serde_json::from_str(&s.model_config("cls", 1)).unwrap();
        assert_eq!(config["max_batch_size"], 8);
        assert_eq!(config["input"][0]["dims"], json!([3, 48, 192]));
        assert_eq!(config["input"][0]["data_type"], "TYPE_FP32");
        assert_eq!(
            config["output"][0]["name"],
            "save_infer_model/scale_0.tmp_1"
        );
        assert_eq!(
            config["parameters"]["intra_op_num_threads"]["string_value"],
            "2"
        );
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        for bad in ["FP32", "FLOAT [1]", "FP32 [a]", "FP32 [-2]", "FP32 [1"] {
            let params = params_from_pairs(&[("output.y", bad)]);
            let e = Signature::from_params(Params(&params)).err().unwrap();
            assert!(e.contains("output.y"), "{e}");
        }
        let e = Signature::from_params(Params(&[]))
            .unwrap()
            .check()
            .err()
            .unwrap();
        assert!(e.contains("declares its outputs"), "{e}");
    }
}
