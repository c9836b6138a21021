//! Auto-completion, as Triton does it by default for ONNX models: what a
//! `config.pbtxt` leaves out (or the whole file) comes from the model.
//!
//! - no file at all: a model folder whose version folder holds `model.onnx` (or
//!   `model.py`) is an ONNX (python) model, as Triton infers the backend from the
//!   model file's name ([`backend_of_files`]);
//! - no `input`/`output`: the worker reads them from the model, and `/config`
//!   shows them (it is built from the loaded model);
//! - no `max_batch_size`: when every input and output has a dynamic first dim,
//!   [`DEFAULT_MAX_BATCH_SIZE`] (Triton's `default-max-batch-size`), with
//!   `dynamic_batching {}` when no scheduler is set (both in [`super::map`]);
//! - declared tensors are checked against the model once it is loaded
//!   ([`Declared::check`]); with auto-completion off, every tensor of the model
//!   must be declared, as Triton requires then ([`Declared::check_complete`]).
//!
//! It is on unless the operator turns it off (`Repository::with_auto_complete`,
//! Triton's `--disable-auto-complete-config`).

use std::path::Path;

use kiln_worker_sdk::{DataType, TensorSpec};

use crate::ensemble::config::TensorConfig;

/// Triton's `--backend-config=default-max-batch-size` default: the batch size an
/// auto-completed model that can batch gets.
pub const DEFAULT_MAX_BATCH_SIZE: i64 = 4;

/// The model files Triton infers a backend from, as kiln serves them.
const MODEL_FILES: &[(&str, &str)] = &[("model.onnx", "onnxruntime"), ("model.py", "python")];

/// The backend of the model in `folder` by its files: the first version folder
/// (numbered, ascending in `versions`) holding a file kiln knows.
pub fn backend_of_files(folder: &Path, versions: &[u64]) -> Option<&'static str> {
    versions.iter().find_map(|v| {
        MODEL_FILES
            .iter()
            .find(|(file, _)| folder.join(v.to_string()).join(file).is_file())
            .map(|(_, backend)| *backend)
    })
}

/// Tensors a `config.pbtxt` declares for a worker's model: checked against what
/// the worker reads from the model once it is loaded ([`Declared::check`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Declared {
    pub inputs: Vec<TensorConfig>,
    pub outputs: Vec<TensorConfig>,
    /// `sequence_batching`'s control and state inputs, with the data types the
    /// file gives them: the server fills them, so clients never see them.
    pub sequence_inputs: Vec<(String, DataType)>,
    /// Auto-completion on: the model's tensors the file leaves out are taken as
    /// they are; off: each must be declared ([`Declared::check_complete`]).
    pub complete: bool,
}

impl Declared {
    /// Checks the declared tensors against the model's, as clients see them
    /// (`inputs`, `outputs`: `dims` without the batch dimension; the model's -1
    /// accepts any size), and the sequence batcher's inputs against the worker's
    /// (`worker_inputs`).
    pub fn check(
        &self,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
        worker_inputs: &[TensorSpec],
    ) -> Result<(), String> {
        for (name, dtype) in &self.sequence_inputs {
            match worker_inputs.iter().find(|m| m.name.as_str() == name) {
                Some(m) if m.dtype == *dtype => {}
                Some(m) => {
                    return Err(format!(
                        "sequence_batching input `{name}`: the config declares {dtype:?}, \
                         the model has {:?}",
                        m.dtype
                    ))
                }
                None => {
                    return Err(format!(
                        "sequence_batching input `{name}` is not the model's"
                    ))
                }
            }
        }
        let side = |what: &str, declared: &[TensorConfig], model: &[TensorSpec]| {
            for d in declared {
                let m = model
                    .iter()
                    .find(|m| m.name.as_str() == d.name)
                    .ok_or_else(|| format!("{what} `{}` is not the model's", d.name))?;
                let dims_match = m.dims.len() == d.dims.len()
                    && m.dims.iter().zip(&d.dims).all(|(m, d)| *m == -1 || m == d);
                if m.dtype != d.data_type || !dims_match {
                    return Err(format!(
                        "{what} `{}`: the config declares {:?} {:?}, the model has {:?} {:?}",
                        d.name,
                        d.data_type,
                        d.dims,
                        m.dtype,
                        m.dims.to_vec()
                    ));
                }
            }
            Ok(())
        };
        side("input", &self.inputs, inputs)?;
        side("output", &self.outputs, outputs)
    }

    /// Checks that every tensor of the model is declared (what Triton requires
    /// when it does not complete a config from the model).
    pub fn check_complete(
        &self,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
    ) -> Result<(), String> {
        let side = |what: &str, declared: &[TensorConfig], model: &[TensorSpec]| match model
            .iter()
            .find(|m| !declared.iter().any(|d| m.name.as_str() == d.name))
        {
            Some(m) => Err(format!(
                "the config declares no {what} `{}`, which the model has",
                m.name.as_str()
            )),
            None => Ok(()),
        };
        side("input", &self.inputs, inputs)?;
        side("output", &self.outputs, outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::DataType;

    fn declared(complete: bool) -> Declared {
        Declared {
            inputs: vec![TensorConfig {
                name: "x".into(),
                data_type: DataType::Fp32,
                dims: vec![3, -1],
            }],
            outputs: Vec::new(),
            sequence_inputs: vec![("s".into(), DataType::Fp32)],
            complete,
        }
    }

    #[test]
    fn left_out_tensors_need_auto_completion() {
        let inputs = [TensorSpec::new("x", DataType::Fp32, &[3, -1])];
        let outputs = [TensorSpec::new("y", DataType::Fp32, &[2])];
        let worker = [
            inputs[0].clone(),
            TensorSpec::new("s", DataType::Fp32, &[4]),
        ];
        assert_eq!(declared(true).check(&inputs, &outputs, &worker), Ok(()));
        let e = declared(false)
            .check_complete(&inputs, &outputs)
            .unwrap_err();
        assert!(e.contains("declares no output `y`"), "{e}");
        let wrong = [TensorSpec::new("x", DataType::Int32, &[3, -1])];
        let e = declared(true).check(&wrong, &outputs, &worker).unwrap_err();
        assert!(e.contains("input `x`: the config declares"), "{e}");
        let state = [TensorSpec::new("s", DataType::Fp16, &[4])];
        let e = declared(true).check(&inputs, &outputs, &state).unwrap_err();
        assert!(e.contains("input `s`: the config declares Fp32"), "{e}");
        let e = declared(true)
            .check(&inputs, &outputs, &inputs)
            .unwrap_err();
        assert!(e.contains("input `s` is not the model's"), "{e}");
    }

    #[test]
    fn the_backend_comes_from_the_model_file() {
        let dir = std::env::temp_dir().join(format!("kiln-complete-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("2")).unwrap();
        assert_eq!(backend_of_files(&dir, &[2]), None);
        std::fs::write(dir.join("2/model.onnx"), b"").unwrap();
        assert_eq!(backend_of_files(&dir, &[1, 2]), Some("onnxruntime"));
        std::fs::write(dir.join("2/model.py"), b"").unwrap();
        assert_eq!(backend_of_files(&dir, &[2]), Some("onnxruntime"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
