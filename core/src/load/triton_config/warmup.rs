//! `model_warmup`: requests a model runs before it serves, as Triton's.
//!
//! [`samples`] reads them from the config when the model is resolved (a
//! sample's `input_data_file` lies in the model folder's `warmup/`, as Triton
//! requires); the Manager [`run`]s each on every group it builds, before the
//! group takes the model's name, so no client request reaches an unwarmed
//! group, and a sample that fails fails the load (a reload keeps the group
//! serving before it).
//!
//! | `model_warmup` field          | kiln                                              |
//! |-------------------------------|---------------------------------------------------|
//! | `name`                        | named in the load error of a failed sample        |
//! | `batch_size`                  | the request's batch dimension (1 for a model that does not batch) |
//! | `count`                       | runs (0: once, as Triton)                         |
//! | `inputs` `data_type`, `dims`  | the tensor's type and shape (without the batch dimension) |
//! | `zero_data`                   | zeros                                             |
//! | `random_data`                 | random values (floats in [1, 2), booleans 0 or 1) |
//! | `input_data_file`             | the raw bytes of `<model>/warmup/<file>`          |

use std::path::{Component, Path};
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;
use kiln_worker_sdk::DataType;

use super::proto::{model_warmup::input::InputDataType, ModelConfig};
use crate::ensemble::config::parse_data_type;
use crate::error::{Result, ServerError};
use crate::group::WorkerGroup;
use crate::models::Served;
use crate::observe::trace::Trace;
use crate::request::infer::{InferRequest, InputTensor};

/// The fields of `model_warmup` kiln honours.
pub const HONOURED: &[&str] = &[
    "model_warmup.name",
    "model_warmup.batch_size",
    "model_warmup.inputs",
    "model_warmup.count",
];

/// The most bytes a model's warmup samples take, all inputs of all samples
/// together, checked before each is allocated: a typo in the operator's dims (or
/// many samples) must fail the load, not abort the server on an allocation.
const MAX_WARMUP_BYTES: u64 = 1 << 30;

/// One warmup request and how many times it runs.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub runs: u32,
    pub inputs: Vec<InputTensor>,
}

/// The warmup samples of `config`, the model in `folder`; the error names the
/// sample and the input.
pub fn samples(config: &ModelConfig, folder: &Path) -> std::result::Result<Vec<Sample>, String> {
    let batching = config.max_batch_size > 0;
    // What the samples read so far hold: every input counts against one bound.
    let mut held = 0u64;
    config
        .model_warmup
        .iter()
        .map(|w| {
            let at = |m: String| format!("`model_warmup` `{}`: {m}", w.name);
            let rows = match (batching, w.batch_size) {
                (_, 0) => return Err(at("`batch_size` must be 1 or more".into())),
                (false, n) if n > 1 => {
                    return Err(at(
                        "a model that does not batch takes `batch_size: 1`".into()
                    ))
                }
                (_, n) => i64::from(n),
            };
            let mut inputs: Vec<InputTensor> = w
                .inputs
                .iter()
                .map(
                    |(name, input)| -> std::result::Result<InputTensor, String> {
                        let at = |m: String| at(format!("input `{name}`: {m}"));
                        let dtype = proto_type(input.data_type)
                            .filter(|t| t.size().is_some())
                            .ok_or_else(|| at("its data_type is not supported in warmup".into()))?;
                        if input.dims.iter().any(|d| *d < 0) {
                            return Err(at("`dims` must be fixed (no -1)".into()));
                        }
                        let mut shape = input.dims.clone();
                        if batching {
                            shape.insert(0, rows);
                        }
                        let size = byte_size(&shape, dtype)
                            .filter(|size| held + *size as u64 <= MAX_WARMUP_BYTES)
                            .ok_or_else(|| {
                                at(format!(
                                    "{shape:?} takes the model's warmup samples over 1 GiB in all"
                                ))
                            })?;
                        held += size as u64;
                        let data = match &input.input_data_type {
                            Some(InputDataType::ZeroData(_)) | None => vec![0; size],
                            Some(InputDataType::RandomData(_)) => random(dtype, size),
                            Some(InputDataType::InputDataFile(file)) => {
                                from_file(folder, file, size).map_err(at)?
                            }
                        };
                        Ok(InputTensor {
                            name: name.clone(),
                            dtype,
                            shape,
                            data: Bytes::from(data),
                        })
                    },
                )
                .collect::<std::result::Result<_, String>>()?;
            // A map in the file: sorted, so a failure names the same input each time.
            inputs.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(Sample {
                name: w.name.clone(),
                runs: w.count.max(1),
                inputs,
            })
        })
        .collect()
}

/// Runs every sample on `group`, which no client reaches yet, waiting for each
/// answer on this thread (the Manager's): the first failure is the error.
pub fn run(group: &Arc<WorkerGroup>, samples: &[Sample]) -> Result<()> {
    let served = Served::Group(Arc::clone(group));
    for sample in samples {
        for _ in 0..sample.runs {
            let request = InferRequest {
                model: group.endpoint.clone(),
                id: None,
                inputs: sample.inputs.clone(),
                outputs: None,
                parameters: Vec::new(),
            };
            let answer =
                crate::request::serve::submit(&served, Ok((request, ())), &mut Trace::default())
                    .and_then(|(pending, ())| wait(pending));
            answer.map_err(|e| {
                ServerError::invalid(format!(
                    "model `{}` version {}: `model_warmup` `{}` failed: {e}",
                    group.endpoint, group.version, sample.name
                ))
            })?;
        }
    }
    Ok(())
}

/// Polls `future` to its end on this thread, parked between wake-ups.
fn wait<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

fn proto_type(value: i32) -> Option<DataType> {
    let name = super::proto::DataType::try_from(value).ok()?;
    parse_data_type(name.as_str_name())
}

fn byte_size(shape: &[i64], dtype: DataType) -> Option<usize> {
    let mut bytes = dtype.size()? as u64;
    for d in shape {
        bytes = bytes.checked_mul(u64::try_from(*d).ok()?)?;
    }
    (bytes <= MAX_WARMUP_BYTES)
        .then(|| usize::try_from(bytes).ok())
        .flatten()
}

/// `size` bytes of random values of `dtype`: floats in [1, 2) (a random
/// mantissa; random bits could be NaN), booleans 0 or 1, integers any.
fn random(dtype: DataType, size: usize) -> Vec<u8> {
    // xorshift64: warmup needs varied data, not a cryptographic generator.
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let element = dtype.size().unwrap_or(1);
    let mut out = Vec::with_capacity(size);
    for _ in 0..size / element {
        let r = next();
        match dtype {
            DataType::Fp32 => {
                out.extend_from_slice(&(0x3F80_0000 | (r as u32 & 0x007F_FFFF)).to_le_bytes())
            }
            DataType::Fp64 => {
                out.extend_from_slice(&(0x3FF0_0000_0000_0000 | (r >> 12)).to_le_bytes())
            }
            DataType::Fp16 => out.extend_from_slice(&(0x3C00 | (r as u16 & 0x03FF)).to_le_bytes()),
            DataType::Bf16 => out.extend_from_slice(&(0x3F80 | (r as u16 & 0x007F)).to_le_bytes()),
            DataType::Bool => out.push((r & 1) as u8),
            _ => out.extend_from_slice(&r.to_le_bytes()[..element]),
        }
    }
    out
}

/// The raw content of `<folder>/warmup/<file>`, which must be `size` bytes.
fn from_file(folder: &Path, file: &str, size: usize) -> std::result::Result<Vec<u8>, String> {
    let relative = Path::new(file);
    if !relative
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        return Err(format!(
            "`input_data_file` `{file}` must name a file inside the model's `warmup/` folder"
        ));
    }
    let path = folder.join("warmup").join(relative);
    let len = std::fs::metadata(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len != size as u64 {
        return Err(format!(
            "{} holds {len} bytes; the input takes {size}",
            path.display()
        ));
    }
    std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> ModelConfig {
        super::super::parse(text).unwrap().config
    }

    #[test]
    fn samples_take_zeros_random_values_and_files_from_the_warmup_folder() {
        let dir = std::env::temp_dir().join(format!("kiln-warmup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("warmup")).unwrap();
        std::fs::write(dir.join("warmup/x.bin"), [7u8; 2 * 3 * 4]).unwrap();
        let config = parsed(
            r#"max_batch_size: 8
               model_warmup [
                 { name: "zeros" batch_size: 2 count: 3
                   inputs { key: "a" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } },
                 { name: "random" batch_size: 1
                   inputs { key: "a" value: { data_type: TYPE_FP32 dims: [ 3 ] random_data: true } } },
                 { name: "file" batch_size: 2
                   inputs { key: "a" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "x.bin" } } }
               ]"#,
        );
        let s = samples(&config, &dir).unwrap();
        assert_eq!((s[0].runs, s[1].runs), (3, 1));
        assert_eq!(s[0].inputs[0].shape, vec![2, 3]);
        assert!(s[0].inputs[0].data.iter().all(|b| *b == 0));
        let values: Vec<f32> = bytemuck::pod_collect_to_vec(&s[1].inputs[0].data);
        assert!(values.iter().all(|v| (1.0..2.0).contains(v)), "{values:?}");
        assert!(s[2].inputs[0].data.iter().all(|b| *b == 7));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_samples_are_load_errors_naming_them() {
        let dir = std::env::temp_dir();
        for (text, named) in [
            (
                r#"max_batch_size: 8 model_warmup [{ name: "w" batch_size: 1
                   inputs { key: "a" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "../x" } } }]"#,
                "inside the model's `warmup/`",
            ),
            (
                r#"max_batch_size: 8 model_warmup [{ name: "w" batch_size: 1
                   inputs { key: "a" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "missing.bin" } } }]"#,
                "missing.bin",
            ),
            (
                r#"max_batch_size: 8 model_warmup [{ name: "w" batch_size: 1
                   inputs { key: "a" value: { data_type: TYPE_FP32 dims: [ -1 ] zero_data: true } } }]"#,
                "no -1",
            ),
            (
                r#"max_batch_size: 8 model_warmup [{ name: "w" batch_size: 1
                   inputs { key: "a" value: { data_type: TYPE_FP32 dims: [ 100000, 100000 ] zero_data: true } } }]"#,
                "over 1 GiB in all",
            ),
            (
                // 600 MiB twice: each fits, both do not (nothing is allocated).
                r#"max_batch_size: 8 model_warmup [
                   { name: "v" batch_size: 1 inputs { key: "a" value: { data_type: TYPE_UINT8
                     dims: [ 629145600 ] zero_data: true } } },
                   { name: "w" batch_size: 1 inputs { key: "a" value: { data_type: TYPE_UINT8
                     dims: [ 629145600 ] zero_data: true } } } ]"#,
                "over 1 GiB in all",
            ),
            (
                r#"max_batch_size: 0 model_warmup [{ name: "w" batch_size: 2 }]"#,
                "does not batch",
            ),
            (
                r#"max_batch_size: 8 model_warmup [{ name: "w" batch_size: 1
                   inputs { key: "a" value: { data_type: TYPE_STRING dims: [ 1 ] zero_data: true } } }]"#,
                "data_type",
            ),
        ] {
            // Not `unwrap_err`: it would print the samples read, a GiB of bytes.
            let e = match samples(&parsed(text), &dir) {
                Err(e) => e,
                Ok(read) => panic!("{text}: {} samples read", read.len()),
            };
            assert!(e.contains(named) && e.contains("`w`"), "{text}: {e}");
        }
    }
}
