//! Triton's REST extensions that its clients (`perf_analyzer`, `tritonclient`) rely
//! on: the model configuration (`GET /v2/models/{m}[/versions/{v}]/config`) and
//! the statistics (`GET /v2/models[/{m}[/versions/{v}]]/stats`), both generated
//! from the loaded group (`kiln_core::triton::ModelConfig`, `kiln_core::observe::stats`) and
//! rendered as JSON here; gRPC renders the same as protobuf.

use actix_web::{web, HttpResponse};
use serde_json::{json, Map, Value};

use super::State;
use kiln_core::models::{Model, Served};
use kiln_core::observe::stats::{StatDuration, StatsSnapshot};
use kiln_core::triton::{triton_type, ModelConfig};

/// A group's configuration ([`ModelConfig`]: how kiln's batchers and settings
/// appear in Triton's schema) rendered to JSON, 64-bit fields as numbers, as Triton
/// serves it.
pub fn config_json(c: &ModelConfig) -> Value {
    let input: Vec<Value> = c
        .inputs
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "data_type": triton_type(t.dtype),
                "format": "FORMAT_NONE",
                "dims": t.dims,
                "is_shape_tensor": false,
                "allow_ragged_batch": c.allow_ragged_batch,
                "optional": false,
            })
        })
        .collect();
    let output: Vec<Value> = c
        .outputs
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "data_type": triton_type(t.dtype),
                "dims": t.dims,
                "label_filename": "",
                "is_shape_tensor": false,
            })
        })
        .collect();
    let version_policy = match c.version {
        Some(v) => json!({"specific": {"versions": [v]}}),
        None => json!({"latest": {"num_versions": 1}}),
    };
    let parameters: Map<String, Value> = c
        .parameters
        .iter()
        .map(|(key, value)| ((*key).to_owned(), json!({ "string_value": value })))
        .collect();
    let instance_group: Vec<Value> = c
        .instance_group
        .iter()
        .map(|(group_name, count)| {
            json!({
                "name": group_name,
                "kind": "KIND_CPU",
                "count": count,
                "gpus": [],
                "secondary_devices": [],
                "profile": [],
                "passive": false,
                "host_policy": "",
            })
        })
        .collect();
    let mut config = json!({
        "name": c.name,
        "platform": c.platform,
        "backend": c.backend,
        "version_policy": version_policy,
        "max_batch_size": c.max_batch_size,
        "input": input,
        "output": output,
        "batch_input": [],
        "batch_output": [],
        "instance_group": instance_group,
        "parameters": parameters,
    });
    if let Some(steps) = &c.ensemble_scheduling {
        let step: Vec<Value> = steps
            .iter()
            .map(|s| {
                json!({
                    "model_name": s.model_name,
                    "model_version": s.model_version,
                    "input_map": s.input_map,
                    "output_map": s.output_map,
                    "model_namespace": "",
                })
            })
            .collect();
        config["ensemble_scheduling"] = json!({ "step": step });
    }
    if let Some(d) = &c.dynamic_batching {
        let policy = |p: &kiln_core::triton::QueuePolicyView| {
            json!({
                "timeout_action": if p.delay { "DELAY" } else { "REJECT" },
                "default_timeout_microseconds": p.default_timeout_microseconds,
                "allow_timeout_override": p.allow_timeout_override,
                "max_queue_size": p.max_queue_size,
            })
        };
        let per_level: serde_json::Map<String, Value> = d
            .priority_queue_policy
            .iter()
            .map(|(level, p)| (level.to_string(), policy(p)))
            .collect();
        config["dynamic_batching"] = json!({
            "preferred_batch_size": d.preferred_batch_sizes,
            "max_queue_delay_microseconds": d.max_queue_delay_microseconds,
            "preserve_ordering": d.preserve_ordering,
            "priority_levels": d.priority_levels,
            "default_priority_level": d.default_priority_level,
            "default_queue_policy": policy(&d.default_queue_policy),
            "priority_queue_policy": per_level,
        });
    }
    if let Some(q) = &c.sequence_batching {
        config["sequence_batching"] = sequence_json(q);
    }
    config
}

/// Triton's JSON form of `sequence_batching`.
fn sequence_json(q: &kiln_core::triton::SequenceBatching) -> Value {
    use kiln_batchers::sequence::{Control, Strategy};
    let controls: Vec<Value> = q
        .controls
        .iter()
        .map(|c| {
            let mut control = json!({ "kind": c.kind.triton_kind() });
            match (c.kind, c.dtype) {
                (Control::CorrId, dtype) => control["data_type"] = json!(triton_type(dtype)),
                (_, kiln_worker_sdk::DataType::Fp32) => control["fp32_false_true"] = json!([0, 1]),
                (_, kiln_worker_sdk::DataType::Bool) => {
                    control["bool_false_true"] = json!([false, true])
                }
                _ => control["int32_false_true"] = json!([0, 1]),
            }
            json!({ "name": c.name, "control": [control] })
        })
        .collect();
    let states: Vec<Value> = q
        .states
        .iter()
        .map(|s| {
            json!({
                "input_name": s.input_name,
                "output_name": s.output_name,
                "data_type": triton_type(s.dtype),
                "dims": s.dims,
                "initial_state": [],
                "use_same_buffer_for_input_output": false,
                "use_growable_memory": false,
            })
        })
        .collect();
    let mut out = json!({
        "max_sequence_idle_microseconds": q.max_sequence_idle_microseconds,
        "control_input": controls,
        "state": states,
        "iterative_sequence": false,
    });
    match q.strategy {
        Strategy::Direct => {
            out["direct"] = json!({
                "max_queue_delay_microseconds": q.max_queue_delay_microseconds,
                "minimum_slot_utilization": 0.0,
            })
        }
        Strategy::Oldest => {
            out["oldest"] = json!({
                "max_candidate_sequences": q.max_candidate_sequences,
                "preferred_batch_size": q.preferred_batch_sizes,
                "max_queue_delay_microseconds": q.max_queue_delay_microseconds,
                "preserve_ordering": false,
            })
        }
    }
    out
}

fn group_config(served: &Served) -> Value {
    config_json(&ModelConfig::of(served))
}

/// `GET /v2/models/{m}[/versions/{v}]/config`: a model loaded from a
/// `config.pbtxt` answers that config as Triton does (completed, in protobuf's
/// JSON mapping with every field and proto field names, 64-bit integers as
/// numbers); any other answers what it runs, in the same schema.
pub fn config(
    server: &kiln_core::Server,
    served: &Served,
) -> Result<HttpResponse, super::error::HttpError> {
    let Some(pbtxt) = server.triton_config(served) else {
        return Ok(HttpResponse::Ok().json(group_config(served)));
    };
    let json = kiln_core::load::triton_config::to_message(&pbtxt)
        .and_then(|m| pbtxt_json(&m))
        .map_err(|e| {
            kiln_core::error::ServerError::Internal(format!(
                "model `{}`: its config cannot be rendered: {e}",
                served.endpoint()
            ))
        })?;
    Ok(HttpResponse::Ok().json(json))
}

/// Protobuf's JSON mapping as Triton prints it (`ModelConfigToJson`).
fn pbtxt_json(message: &prost_reflect::DynamicMessage) -> Result<Value, String> {
    let options = prost_reflect::SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(false)
        .stringify_64_bit_integers(false);
    message
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|e| e.to_string())
}

fn stats_of(model: &dyn Model) -> Value {
    stats_json(&model.stats().snapshot(), model.endpoint(), model.version())
}

/// A count and a cumulative duration, Triton's `StatisticDuration`.
fn duration_json(d: StatDuration) -> Value {
    json!({"count": d.count, "ns": d.ns})
}

/// One entry of Triton's `model_stats` array.
fn stats_json(s: &StatsSnapshot, name: &str, version: &str) -> Value {
    let batch_stats: Vec<Value> = s
        .batches
        .iter()
        .map(|b| {
            json!({
                "batch_size": b.batch_size,
                "compute_input": duration_json(b.compute_input),
                "compute_infer": duration_json(b.compute_infer),
                "compute_output": duration_json(b.compute_output),
            })
        })
        .collect();
    // kiln has no response cache; Triton's clients read these fields anyway.
    let zero = duration_json(StatDuration::default());
    json!({
        "name": name,
        "version": version,
        "last_inference": s.last_inference,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "inference_stats": {
            "success": duration_json(s.success),
            "fail": duration_json(s.fail),
            "queue": duration_json(s.queue),
            "compute_input": duration_json(s.compute_input),
            "compute_infer": duration_json(s.compute_infer),
            "compute_output": duration_json(s.compute_output),
            "cache_hit": zero,
            "cache_miss": zero,
        },
        "response_stats": {},
        "batch_stats": batch_stats,
        "memory_usage": [],
    })
}

/// `GET /v2/models/{m}[/versions/{v}]/stats`.
pub fn model_stats(model: &dyn Model) -> HttpResponse {
    HttpResponse::Ok().json(json!({ "model_stats": [stats_of(model)] }))
}

/// `GET /v2/models/stats`: every loaded model.
pub async fn all_stats(state: web::Data<State>) -> HttpResponse {
    let stats: Vec<Value> = state
        .server
        .models()
        .iter()
        .map(|s| stats_of(&**s))
        .collect();
    HttpResponse::Ok().json(json!({ "model_stats": stats }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kiln_worker_sdk::{BatcherKind, DataType, TensorSpec, WorkerInfo};

    use super::*;
    use kiln_core::group::GroupSettings;
    use kiln_core::observe::stats::{BatchTiming, ModelStats};

    fn settings(batcher: BatcherKind, batch_size: usize, timeout_ms: u64) -> GroupSettings {
        GroupSettings {
            batch_size,
            batcher,
            timeout: Duration::from_millis(timeout_ms),
            gather: true,
            batchers: 1,
            max_buffers: 5,
            buffer_capacity: 5,
            max_outstanding: None,
            queue_size: 4096,
            dynamic: kiln_batchers::dynamic::DynamicConfig::new(batch_size, Duration::ZERO),
            sequence: Default::default(),
            shapes: Default::default(),
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
    fn batching_worker_renders_dynamic_batching_and_parameters() {
        let info = info(
            256,
            vec![TensorSpec::new("INPUT0", DataType::Uint32, &[-1])],
            vec![TensorSpec::new("OUTPUT0", DataType::Bytes, &[-1, 3])],
        );
        let c = config_json(&ModelConfig::new(
            "echo",
            "echo",
            "1",
            &info,
            &settings(BatcherKind::Soft, 8, 20),
            2,
        ));
        assert_eq!(c["name"], "echo");
        assert_eq!(c["platform"], "kiln_echo");
        assert_eq!(c["backend"], "echo");
        // The group's batch size (8), not the worker's 256: what infer enforces.
        assert_eq!(c["max_batch_size"], 8);
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
        let c = config_json(&ModelConfig::new(
            "m",
            "w",
            "3",
            &info,
            &settings(BatcherKind::Hard, 16, 0),
            1,
        ));
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
        let c = config_json(&ModelConfig::new(
            "invert-image",
            "invert-image",
            "1",
            &info,
            &settings(BatcherKind::Soft, 1, 0),
            1,
        ));
        assert_eq!(c["max_batch_size"], 0);
        assert_eq!(c["input"][0]["dims"], json!([-1, -1, 3]));
        assert!(c.get("dynamic_batching").is_none());
        assert_eq!(c["parameters"]["batch_size"]["string_value"], "1");
    }

    fn timing(input_us: u64, infer_us: u64, output_us: u64) -> BatchTiming {
        BatchTiming {
            input: Duration::from_micros(input_us),
            infer: Duration::from_micros(infer_us),
            output: Duration::from_micros(output_us),
        }
    }

    #[test]
    fn empty_stats_render_triton_schema() {
        let v = stats_json(&ModelStats::default().snapshot(), "echo", "1");
        assert_eq!(v["name"], "echo");
        assert_eq!(v["version"], "1");
        assert_eq!(v["last_inference"], 0);
        assert_eq!(v["inference_count"], 0);
        assert_eq!(v["execution_count"], 0);
        for stage in [
            "success",
            "fail",
            "queue",
            "compute_input",
            "compute_infer",
            "compute_output",
            "cache_hit",
            "cache_miss",
        ] {
            assert_eq!(
                v["inference_stats"][stage],
                json!({"count": 0, "ns": 0}),
                "{stage}"
            );
        }
        assert_eq!(v["batch_stats"], json!([]));
    }

    #[test]
    fn batches_are_charged_per_request_and_per_size() {
        let stats = ModelStats::default();
        // 3 requests, 4 rows: 1 µs building, 10 µs run, 2 µs answering.
        stats.record_success(3, 4, 900, timing(1, 10, 2));
        stats.record_success(1, 1, 100, timing(1, 10, 2));
        stats.record_success(2, 4, 0, timing(3, 30, 6));
        stats.record_failure(2, 5_000);
        let v = stats_json(&stats.snapshot(), "echo", "1");
        assert_eq!(v["inference_count"], 9);
        assert_eq!(v["execution_count"], 3);
        let s = &v["inference_stats"];
        assert_eq!(s["queue"], json!({"count": 6, "ns": 1000}));
        assert_eq!(
            s["compute_input"],
            json!({"count": 6, "ns": 3 * 1000 + 1000 + 2 * 3000})
        );
        assert_eq!(
            s["compute_infer"],
            json!({"count": 6, "ns": 3 * 10_000 + 10_000 + 2 * 30_000})
        );
        assert_eq!(
            s["compute_output"],
            json!({"count": 6, "ns": 3 * 2000 + 2000 + 2 * 6000})
        );
        // success = queue + every compute stage.
        assert_eq!(
            s["success"],
            json!({"count": 6, "ns": 1000 + 10_000 + 100_000 + 20_000})
        );
        assert_eq!(s["fail"], json!({"count": 2, "ns": 5000}));
        assert!(v["last_inference"].as_u64().unwrap() > 0);
        assert_eq!(
            v["batch_stats"],
            json!([
                {
                    "batch_size": 1,
                    "compute_input": {"count": 1, "ns": 1000},
                    "compute_infer": {"count": 1, "ns": 10_000},
                    "compute_output": {"count": 1, "ns": 2000},
                },
                {
                    "batch_size": 4,
                    "compute_input": {"count": 2, "ns": 4000},
                    "compute_infer": {"count": 2, "ns": 40_000},
                    "compute_output": {"count": 2, "ns": 8000},
                },
            ])
        );
    }
}
