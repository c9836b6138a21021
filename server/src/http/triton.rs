//! Triton's REST extensions that its clients (`perf_analyzer`, `tritonclient`) rely
//! on: the model configuration (`GET /v2/models/{m}[/versions/{v}]/config`) and
//! the statistics (`GET /v2/models[/{m}[/versions/{v}]]/stats`), both generated
//! from the loaded group: its worker's `WorkerInfo`, its resolved settings and the
//! measurements of its instances.

use actix_web::{web, HttpRequest, HttpResponse};
use kiln_worker_sdk::{BatcherKind, DataType, WorkerInfo};
use serde_json::{json, Value};

use super::routes::{lookup, State};
use super::HttpError;
use crate::group::{GroupSettings, WorkerGroup};

/// Triton's `DataType` enum name for `dtype` (`BYTES` is `TYPE_STRING`).
pub fn triton_type(dtype: DataType) -> &'static str {
    match dtype {
        DataType::Bool => "TYPE_BOOL",
        DataType::Uint8 => "TYPE_UINT8",
        DataType::Uint16 => "TYPE_UINT16",
        DataType::Uint32 => "TYPE_UINT32",
        DataType::Uint64 => "TYPE_UINT64",
        DataType::Int8 => "TYPE_INT8",
        DataType::Int16 => "TYPE_INT16",
        DataType::Int32 => "TYPE_INT32",
        DataType::Int64 => "TYPE_INT64",
        DataType::Fp16 => "TYPE_FP16",
        DataType::Bf16 => "TYPE_BF16",
        DataType::Fp32 => "TYPE_FP32",
        DataType::Fp64 => "TYPE_FP64",
        DataType::Bytes => "TYPE_STRING",
    }
}

/// A group's configuration as Triton's `ModelConfig` rendered to JSON (64-bit
/// fields as numbers, as Triton serves it).
///
/// The hard and soft batchers are described with Triton's `dynamic_batching`:
/// `preferred_batch_size` is `[batch_size]`; `max_queue_delay_microseconds` is the
/// soft batcher's timeout (0: it sends what has already arrived), and for the hard
/// batcher, which waits without limit for a full batch, `u64::MAX`. The queue's
/// bound is `default_queue_policy.max_queue_size` (a full queue rejects). kiln's own
/// settings are in `parameters`.
pub fn model_config(
    name: &str,
    worker: &str,
    version: &str,
    info: &WorkerInfo,
    settings: &GroupSettings,
    instances: usize,
) -> Value {
    let input: Vec<Value> = info
        .inputs
        .iter()
        .map(|s| {
            json!({
                "name": s.name.as_str(),
                "data_type": triton_type(s.dtype),
                "format": "FORMAT_NONE",
                "dims": s.dims.as_slice(),
                "is_shape_tensor": false,
                "allow_ragged_batch": info.allow_ragged_batch,
                "optional": false,
            })
        })
        .collect();
    let output: Vec<Value> = info
        .outputs
        .iter()
        .map(|s| {
            json!({
                "name": s.name.as_str(),
                "data_type": triton_type(s.dtype),
                "dims": s.dims.as_slice(),
                "label_filename": "",
                "is_shape_tensor": false,
            })
        })
        .collect();
    let version_policy = match version.parse::<i64>() {
        Ok(v) => json!({"specific": {"versions": [v]}}),
        Err(_) => json!({"latest": {"num_versions": 1}}),
    };
    let string = |v: String| json!({ "string_value": v });
    let mut config = json!({
        "name": name,
        "platform": format!("kiln_{worker}"),
        "backend": worker,
        "version_policy": version_policy,
        "max_batch_size": info.max_batch_size,
        "input": input,
        "output": output,
        "batch_input": [],
        "batch_output": [],
        "instance_group": [{
            "name": format!("{name}_0"),
            "kind": "KIND_CPU",
            "count": instances,
            "gpus": [],
            "secondary_devices": [],
            "profile": [],
            "passive": false,
            "host_policy": "",
        }],
        "parameters": {
            "batcher": string(settings.batcher.as_str().to_owned()),
            "batch_size": string(settings.batch_size.to_string()),
            "timeout_ms": string(settings.timeout.as_millis().to_string()),
            "batchers": string(settings.batchers.to_string()),
            "max_buffers": string(settings.max_buffers.to_string()),
            "queue_size": string(settings.queue_size.to_string()),
        },
    });
    if info.max_batch_size > 0 {
        let delay = match settings.batcher {
            BatcherKind::Soft => u64::try_from(settings.timeout.as_micros()).unwrap_or(u64::MAX),
            BatcherKind::Hard => u64::MAX,
            BatcherKind::Dynamic => {
                u64::try_from(settings.dynamic.max_queue_delay.as_micros()).unwrap_or(u64::MAX)
            }
        };
        config["dynamic_batching"] = json!({
            "preferred_batch_size": [settings.batch_size],
            "max_queue_delay_microseconds": delay,
            "preserve_ordering": false,
            "priority_levels": 0,
            "default_priority_level": 0,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": 0,
                "allow_timeout_override": false,
                "max_queue_size": settings.queue_size,
            },
            "priority_queue_policy": {},
        });
    }
    config
}

fn group_config(group: &WorkerGroup) -> Value {
    model_config(
        &group.endpoint,
        &group.worker,
        &group.version,
        &group.info,
        &group.settings,
        group.instance_count(),
    )
}

/// `GET /v2/models/{m}[/versions/{v}]/config`.
pub async fn config(state: web::Data<State>, req: HttpRequest) -> Result<HttpResponse, HttpError> {
    let group = lookup(&state, &req)?;
    Ok(HttpResponse::Ok().json(group_config(&group)))
}

fn stats_of(group: &WorkerGroup) -> Value {
    group.stats().to_json(&group.endpoint, &group.version)
}

/// `GET /v2/models/{m}[/versions/{v}]/stats`.
pub async fn model_stats(
    state: web::Data<State>,
    req: HttpRequest,
) -> Result<HttpResponse, HttpError> {
    let group = lookup(&state, &req)?;
    Ok(HttpResponse::Ok().json(json!({ "model_stats": [stats_of(&group)] })))
}

/// `GET /v2/models/stats`: every loaded model.
pub async fn all_stats(state: web::Data<State>) -> HttpResponse {
    let stats: Vec<Value> = state.server.models().iter().map(|g| stats_of(g)).collect();
    HttpResponse::Ok().json(json!({ "model_stats": stats }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kiln_worker_sdk::TensorSpec;

    use super::*;

    fn settings(batcher: BatcherKind, batch_size: usize, timeout_ms: u64) -> GroupSettings {
        GroupSettings {
            batch_size,
            batcher,
            timeout: Duration::from_millis(timeout_ms),
            batchers: 1,
            max_buffers: 5,
            queue_size: 4096,
            dynamic: Default::default(),
        }
    }

    fn info(max_batch_size: u32, inputs: Vec<TensorSpec>, outputs: Vec<TensorSpec>) -> WorkerInfo {
        WorkerInfo {
            inputs: inputs.into(),
            outputs: outputs.into(),
            max_batch_size,
            batcher: BatcherKind::Soft,
            allow_ragged_batch: true,
        }
    }

    #[test]
    fn every_datatype_has_triton_name() {
        for d in DataType::ALL {
            let name = triton_type(d);
            let expected = match d {
                DataType::Bytes => "TYPE_STRING".to_owned(),
                _ => format!("TYPE_{}", d.as_str()),
            };
            assert_eq!(name, expected);
        }
    }

    #[test]
    fn batching_worker_renders_dynamic_batching_and_parameters() {
        let info = info(
            256,
            vec![TensorSpec::new("INPUT0", DataType::Uint32, &[-1])],
            vec![TensorSpec::new("OUTPUT0", DataType::Bytes, &[-1, 3])],
        );
        let c = model_config(
            "echo",
            "echo",
            "1",
            &info,
            &settings(BatcherKind::Soft, 8, 20),
            2,
        );
        assert_eq!(c["name"], "echo");
        assert_eq!(c["platform"], "kiln_echo");
        assert_eq!(c["backend"], "echo");
        assert_eq!(c["max_batch_size"], 256);
        assert_eq!(c["version_policy"], json!({"specific": {"versions": [1]}}));
        assert_eq!(c["input"][0]["name"], "INPUT0");
        assert_eq!(c["input"][0]["data_type"], "TYPE_UINT32");
        assert_eq!(c["input"][0]["dims"], json!([-1]));
        assert_eq!(c["input"][0]["allow_ragged_batch"], true);
        assert_eq!(c["output"][0]["data_type"], "TYPE_STRING");
        assert_eq!(c["output"][0]["dims"], json!([-1, 3]));
        assert_eq!(c["instance_group"][0]["kind"], "KIND_CPU");
        assert_eq!(c["instance_group"][0]["count"], 2);
        assert_eq!(c["instance_group"][0]["name"], "echo_0");
        let db = &c["dynamic_batching"];
        assert_eq!(db["preferred_batch_size"], json!([8]));
        assert_eq!(db["max_queue_delay_microseconds"], 20_000);
        assert_eq!(db["default_queue_policy"]["max_queue_size"], 4096);
        let p = &c["parameters"];
        for (key, value) in [
            ("batcher", "soft"),
            ("batch_size", "8"),
            ("timeout_ms", "20"),
            ("batchers", "1"),
            ("max_buffers", "5"),
            ("queue_size", "4096"),
        ] {
            assert_eq!(p[key], json!({ "string_value": value }), "{key}");
        }
    }

    #[test]
    fn hard_batcher_waits_without_limit() {
        let info = info(
            64,
            vec![TensorSpec::new("x", DataType::Fp32, &[4])],
            vec![TensorSpec::new("y", DataType::Fp32, &[4])],
        );
        let c = model_config("m", "w", "3", &info, &settings(BatcherKind::Hard, 16, 0), 1);
        assert_eq!(
            c["dynamic_batching"]["max_queue_delay_microseconds"],
            u64::MAX
        );
        assert_eq!(c["parameters"]["batcher"]["string_value"], "hard");
        assert_eq!(c["version_policy"]["specific"]["versions"], json!([3]));
    }

    #[test]
    fn non_batching_worker_has_no_dynamic_batching() {
        let info = info(
            0,
            vec![TensorSpec::new("image", DataType::Uint8, &[-1, -1, 3])],
            vec![TensorSpec::new("inverted", DataType::Uint8, &[-1, -1, 3])],
        );
        let c = model_config(
            "invert-image",
            "invert-image",
            "1",
            &info,
            &settings(BatcherKind::Soft, 1, 0),
            1,
        );
        assert_eq!(c["max_batch_size"], 0);
        assert_eq!(c["input"][0]["dims"], json!([-1, -1, 3]));
        assert!(c.get("dynamic_batching").is_none());
        assert_eq!(c["parameters"]["batch_size"]["string_value"], "1");
    }
}
