//! Golden data for the ONNX tests: inputs and reference outputs made by
//! `tests/golden/reference.py` with the onnxruntime Python package.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use kiln_client::{DataType, InputTensor};
use serde_json::Value;

use crate::{cache_dir, model_repository, repo_root};

/// One tensor of a golden case.
pub struct Tensor {
    pub name: String,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

impl Tensor {
    /// As a request input.
    pub fn input(&self) -> InputTensor {
        InputTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: self.data.clone().into(),
        }
    }

    /// FP32 data as floats.
    pub fn floats(&self) -> Vec<f32> {
        bytemuck_f32(&self.data)
    }
}

/// Little-endian FP32 bytes as floats.
pub fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// One model call and what the reference gave.
pub struct Case {
    pub model: String,
    pub tag: String,
    pub inputs: Vec<Tensor>,
    pub outputs: Vec<Tensor>,
}

/// Everything `reference.py` produced.
pub struct Golden {
    pub cases: Vec<Case>,
}

impl Golden {
    /// The cases for `model`.
    pub fn cases_for<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a Case> + 'a {
        self.cases.iter().filter(move |c| c.model == model)
    }
}

fn python() -> PathBuf {
    let python = cache_dir().join("venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup-python",
        python.display()
    );
    python
}

fn tensor(dir: &Path, v: &Value) -> Tensor {
    Tensor {
        name: v["name"].as_str().unwrap_or_default().to_owned(),
        dtype: DataType::parse(v["datatype"].as_str().expect("datatype")).expect("known datatype"),
        shape: v["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_i64().expect("dim"))
            .collect(),
        data: std::fs::read(dir.join(v["file"].as_str().expect("file"))).expect("golden data file"),
    }
}

/// Runs the reference once per test process and loads what it wrote.
pub fn golden() -> &'static Golden {
    static GOLDEN: OnceLock<Golden> = OnceLock::new();
    GOLDEN.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kiln-golden-{}", std::process::id()));
        let status = Command::new(python())
            .arg(repo_root().join("tests/golden/reference.py"))
            .arg(&dir)
            .arg(model_repository())
            .status()
            .expect("run reference.py");
        assert!(status.success(), "reference.py failed");
        let manifest: Value =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).expect("manifest"))
                .expect("manifest JSON");
        let cases = manifest["cases"]
            .as_array()
            .expect("cases")
            .iter()
            .map(|c| Case {
                model: c["model"].as_str().expect("model").to_owned(),
                tag: c["tag"].as_str().expect("tag").to_owned(),
                inputs: c["inputs"]
                    .as_array()
                    .expect("inputs")
                    .iter()
                    .map(|t| tensor(&dir, t))
                    .collect(),
                outputs: c["outputs"]
                    .as_array()
                    .expect("outputs")
                    .iter()
                    .map(|t| tensor(&dir, t))
                    .collect(),
            })
            .collect();
        Golden { cases }
    })
}

/// Silero VAD streams and their reference probabilities from
/// `tests/golden/silero_reference.py`: each stream run alone, in order, with its
/// state carried from chunk to chunk.
pub struct SileroStreams {
    pub streams: usize,
    pub chunks: usize,
    /// Samples per call: the previous chunk's last 64 samples and 512 new ones.
    pub samples: usize,
    /// `[streams, chunks, samples]` FP32 model inputs.
    pub inputs: Vec<f32>,
    /// `[streams, chunks]` speech probabilities.
    pub probabilities: Vec<f32>,
    /// The largest change of a probability when the state is reset every chunk:
    /// how much carrying the state matters on this audio.
    pub reset_max_abs_diff: f64,
}

impl SileroStreams {
    /// The input of stream `s`'s chunk `c`.
    pub fn input(&self, s: usize, c: usize) -> &[f32] {
        let at = (s * self.chunks + c) * self.samples;
        &self.inputs[at..at + self.samples]
    }

    /// The reference probability of stream `s`'s chunk `c`.
    pub fn probability(&self, s: usize, c: usize) -> f32 {
        self.probabilities[s * self.chunks + c]
    }
}

/// Runs `silero_reference.py` for `streams` streams of `chunks` chunks (with the
/// 64-sample context Silero expects) and loads what it wrote.
pub fn silero_streams(streams: usize, chunks: usize) -> SileroStreams {
    let dir = std::env::temp_dir().join(format!(
        "kiln-silero-{}-{streams}x{chunks}",
        std::process::id()
    ));
    let status = Command::new(python())
        .arg(repo_root().join("tests/golden/silero_reference.py"))
        .arg(model_repository().join("silero-vad/1/model.onnx"))
        .arg(&dir)
        .args(["--streams", &streams.to_string()])
        .args(["--chunks", &chunks.to_string()])
        .args(["--seed", "7", "--context", "64"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run silero_reference.py");
    assert!(status.success(), "silero_reference.py failed");
    let read = |name: &str| bytemuck_f32(&std::fs::read(dir.join(name)).expect("reference file"));
    let meta: Value =
        serde_json::from_slice(&std::fs::read(dir.join("meta.json")).expect("meta.json"))
            .expect("meta JSON");
    SileroStreams {
        streams,
        chunks,
        samples: 512 + 64,
        inputs: read("inputs.f32"),
        probabilities: read("probs.f32"),
        reset_max_abs_diff: meta["stateful_vs_reset_max_abs_diff"]
            .as_f64()
            .expect("stateful_vs_reset_max_abs_diff"),
    }
}

/// Largest absolute difference between two float slices of equal length.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
