//! Triton's model configuration: a model folder's `config.pbtxt`, read as Triton
//! reads it and mapped onto kiln's loading.
//!
//! - [`parse`]: the protobuf text format of Triton's `ModelConfig`
//!   (`proto/model_config.proto`, vendored from triton-inference-server/common),
//!   read by prost-reflect against the compiled descriptor into the typed
//!   [`proto::ModelConfig`] that prost-build generates;
//! - [`fields`]: every field the file sets, as dotted paths (`dynamic_batching.
//!   preferred_batch_size`), so that [`map`] can refuse, by name, each one kiln
//!   does not honour instead of ignoring it;
//! - [`map`]: the typed config → what kiln loads (a worker and its load
//!   parameters, or an ensemble), with [`sequence`] for `sequence_batching` and
//!   [`accelerators`] for `optimization.execution_accelerators` ([`warmup`]
//!   reads `model_warmup`'s requests);
//! - [`autocomplete`]: Triton's auto-completion (what the file leaves out comes from
//!   the model) and the check of declared tensors against the model;
//! - [`folder`]: a model folder (its `config.pbtxt`, or none) → what the
//!   repository loads;
//! - [`complete`]: a loaded model's config as Triton answers it (`/config`).

pub mod accelerators;
pub mod autocomplete;
pub mod complete;
pub mod data_type;
pub mod folder;
pub mod map;
pub mod sequence;
pub mod warmup;

use std::sync::OnceLock;

use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, Value};

/// The messages of `proto/model_config.proto` (package `inference`).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/inference.rs"));
}

/// The descriptor set of `proto/model_config.proto`, compiled by `build.rs`.
const DESCRIPTOR: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/model_config_descriptor.bin"));

fn descriptor() -> &'static MessageDescriptor {
    static MESSAGE: OnceLock<MessageDescriptor> = OnceLock::new();
    MESSAGE.get_or_init(|| {
        // Compiled from the vendored file by build.rs: it always decodes and holds
        // the message (a test checks), so this cannot fail at run time.
        #[allow(clippy::expect_used)]
        let pool = DescriptorPool::decode(DESCRIPTOR).expect("model_config descriptor decodes");
        #[allow(clippy::expect_used)]
        pool.get_message_by_name("inference.ModelConfig")
            .expect("model_config.proto declares inference.ModelConfig")
    })
}

/// A parsed `config.pbtxt`: the typed config and the paths of the fields it sets.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub config: proto::ModelConfig,
    /// Every field set to something other than its default, as a dotted path
    /// (repeated and nested messages contribute their fields' paths; a map such as
    /// `parameters` is one path, its keys are the mapper's to check).
    pub fields: Vec<String>,
}

/// Reads `text`, a `config.pbtxt`. The error is the text-format parser's
/// (line and column, the unknown field or the bad value).
pub fn parse(text: &str) -> Result<Parsed, String> {
    let text = colon_before_lists(text);
    let message = DynamicMessage::parse_text_format(descriptor().clone(), &text)
        .map_err(|e| format!("not a Triton model configuration: {e}"))?;
    let config = message
        .transcode_to::<proto::ModelConfig>()
        .map_err(|e| format!("not a Triton model configuration: {e}"))?;
    let mut fields = Vec::new();
    walk(&message, "", &mut fields);
    fields.sort();
    fields.dedup();
    Ok(Parsed { config, fields })
}

/// protobuf's C++ text parser (Triton's) takes `input [ { … } ]`, a list of
/// messages with no `:` after the field name, and Triton's documentation writes
/// configs that way; prost-reflect 0.16 requires the `:` there. This adds it: a
/// field name followed (across blanks and `#` comments) by `[`, outside strings.
/// Nothing else of the text changes, so the parser's line and column stay right.
fn colon_before_lists(text: &str) -> std::borrow::Cow<'_, str> {
    let bytes = text.as_bytes();
    let mut inserts = Vec::new();
    let mut i = 0;
    let mut last_ident_end = None;
    while i < bytes.len() {
        match bytes[i] {
            q @ (b'"' | b'\'') => {
                i += 1;
                while i < bytes.len() && bytes[i] != q {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                last_ident_end = None;
            }
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            c if c.is_ascii_whitespace() => i += 1,
            c if c.is_ascii_alphabetic() || c == b'_' => {
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                last_ident_end = Some(i);
            }
            b'[' => {
                if let Some(end) = last_ident_end.take() {
                    inserts.push(end);
                }
                i += 1;
            }
            _ => {
                last_ident_end = None;
                i += 1;
            }
        }
    }
    if inserts.is_empty() {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + inserts.len());
    let mut from = 0;
    for at in inserts {
        out.push_str(&text[from..at]);
        out.push(':');
        from = at;
    }
    out.push_str(&text[from..]);
    std::borrow::Cow::Owned(out)
}

/// The config as a reflective message: what renders it in protobuf's JSON
/// mapping (prost-reflect's serde), as Triton answers `/config`.
pub fn to_message(config: &proto::ModelConfig) -> Result<DynamicMessage, String> {
    let mut message = DynamicMessage::new(descriptor().clone());
    message.transcode_from(config).map_err(|e| e.to_string())?;
    Ok(message)
}

/// The config as protobuf text (what kiln read, for logs and tests).
pub fn to_text(config: &proto::ModelConfig) -> String {
    let mut message = DynamicMessage::new(descriptor().clone());
    // Same descriptor as the generated type: transcoding cannot fail.
    match message.transcode_from(config) {
        Ok(()) => message.to_text_format(),
        Err(e) => format!("<{e}>"),
    }
}

fn walk(message: &DynamicMessage, prefix: &str, out: &mut Vec<String>) {
    for (field, value) in message.fields() {
        let path = if prefix.is_empty() {
            field.name().to_owned()
        } else {
            format!("{prefix}.{}", field.name())
        };
        match value {
            Value::Message(inner) => {
                let before = out.len();
                walk(inner, &path, out);
                // An empty message that is set means something (`all {}`).
                if out.len() == before {
                    out.push(path);
                }
            }
            Value::List(items) if items.iter().any(|i| matches!(i, Value::Message(_))) => {
                for item in items {
                    if let Value::Message(inner) = item {
                        let before = out.len();
                        walk(inner, &path, out);
                        if out.len() == before {
                            out.push(path.clone());
                        }
                    }
                }
            }
            _ => out.push(path),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triton_text_format_parses_into_typed_messages() {
        let parsed = parse(
            r#"
name: "ocr_cls"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 48, 192 ] } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] }
instance_group [{ count: 1, kind: KIND_CPU }]
version_policy: { all {} }
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
"#,
        )
        .unwrap();
        let c = &parsed.config;
        assert_eq!(c.name, "ocr_cls");
        assert_eq!(c.max_batch_size, 16);
        assert_eq!(c.input[0].dims, vec![3, 48, 192]);
        assert_eq!(
            c.input[0].data_type(),
            proto::DataType::TypeFp32,
            "enum names are read as Triton's"
        );
        assert_eq!(
            match &c.scheduling_choice {
                Some(proto::model_config::SchedulingChoice::DynamicBatching(d)) =>
                    d.preferred_batch_size.clone(),
                _ => Vec::new(),
            },
            vec![4, 8]
        );
        assert_eq!(c.parameters["intra_op_thread_count"].string_value, "2");
        assert_eq!(
            parsed.fields,
            vec![
                "dynamic_batching.preferred_batch_size",
                "input.data_type",
                "input.dims",
                "input.name",
                "instance_group.count",
                "instance_group.kind",
                "max_batch_size",
                "name",
                "parameters",
                "platform",
                "version_policy.all",
            ]
        );
    }

    #[test]
    fn unknown_fields_and_bad_values_name_the_place() {
        let e = parse("name: \"m\"\nmax_batch_sizes: 4\n").unwrap_err();
        assert!(e.contains("max_batch_sizes"), "{e}");
        let e = parse("input [{ name: \"x\" data_type: TYPE_FLOAT }]").unwrap_err();
        assert!(e.contains("TYPE_FLOAT"), "{e}");
    }

    #[test]
    fn lists_without_colon_parse_as_triton_reads_them() {
        let parsed =
            parse("input [ { name: \"a[0]\" dims: [ 1 ] } ] # out [x]\noutput: [{ name: \"b\" }]")
                .unwrap();
        assert_eq!(parsed.config.input[0].name, "a[0]");
        assert_eq!(parsed.config.output[0].name, "b");
    }

    #[test]
    fn text_round_trips() {
        let parsed = parse("name: \"m\" max_batch_size: 4").unwrap();
        let again = parse(&to_text(&parsed.config)).unwrap();
        assert_eq!(again.config, parsed.config);
    }
}
