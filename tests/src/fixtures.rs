//! What the end-to-end tests share: temporary model repositories, POSIX
//! shared-memory objects, the echo-multi request with its expected answer, and
//! gzip/deflate bodies.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A model repository in a fresh temporary directory, removed on drop.
pub struct TempRepository {
    path: PathBuf,
}

impl TempRepository {
    /// A repository holding `models`: each a name, its `config.toml` text and its
    /// version folders (empty: workers like echo need no model file).
    pub fn new(models: &[(&str, &str, &[u64])]) -> TempRepository {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "kiln-repo-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        for (name, config, versions) in models {
            let dir = path.join(name);
            std::fs::create_dir_all(&dir).expect("create model folder");
            std::fs::write(dir.join("config.toml"), config).expect("write config.toml");
            for v in *versions {
                std::fs::create_dir_all(dir.join(v.to_string())).expect("create version folder");
            }
        }
        TempRepository { path }
    }

    /// Its directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes model `model` as Triton's repository holds it: its `config.pbtxt`,
    /// and each of `versions` a folder holding the fetched PP-OCR classifier
    /// (`model.onnx`), or empty for an ensemble.
    pub fn write_triton(&self, model: &str, config: &str, versions: &[u64]) {
        let dir = self.path.join(model);
        std::fs::create_dir_all(&dir).expect("create model folder");
        std::fs::write(dir.join("config.pbtxt"), config).expect("write config.pbtxt");
        let onnx = crate::model_repository().join("ocr-cls/1/model.onnx");
        for v in versions {
            std::fs::create_dir_all(dir.join(v.to_string())).expect("create version folder");
            if !config.contains("\"ensemble\"") {
                std::fs::copy(&onnx, dir.join(format!("{v}/model.onnx"))).expect("copy model");
            }
        }
    }

    /// Its directory as a command-line argument.
    pub fn arg(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }
}

impl Drop for TempRepository {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A POSIX shared-memory object (`/dev/shm/<name>`) made as a client would with
/// `shm_open`; removed on drop.
pub struct ShmObject {
    /// The key to register it under (`/<name>`).
    pub key: String,
    path: PathBuf,
}

impl ShmObject {
    /// A zeroed object of `size` bytes.
    pub fn new(size: usize) -> ShmObject {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("kiln-e2e-{}-{n}", std::process::id());
        let path = PathBuf::from("/dev/shm").join(&name);
        std::fs::write(&path, vec![0u8; size]).expect("create shared-memory object");
        ShmObject {
            key: format!("/{name}"),
            path,
        }
    }

    /// Writes `values` (little-endian) at `offset`.
    pub fn write_u32(&self, offset: usize, values: &[u32]) {
        let mut contents = std::fs::read(&self.path).expect("read shared-memory object");
        for (i, v) in values.iter().enumerate() {
            contents[offset + 4 * i..offset + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        std::fs::write(&self.path, contents).expect("write shared-memory object");
    }

    /// Reads `count` little-endian values at `offset`.
    pub fn read_u32(&self, offset: usize, count: usize) -> Vec<u32> {
        let contents = std::fs::read(&self.path).expect("read shared-memory object");
        contents[offset..offset + 4 * count]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

impl Drop for ShmObject {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A request for echo-multi covering three datatypes: UINT32 [1, 3], FP32 [1, 2]
/// and BYTES [1, 2] with an empty string.
pub fn echo_multi_request(id: &str) -> kiln_client::InferRequest {
    use kiln_client::{DataType, InputTensor};
    kiln_client::InferRequest {
        model: "echo-multi".into(),
        id: Some(id.into()),
        inputs: vec![
            InputTensor::from_slice("INPUT0", DataType::Uint32, &[1, 3], &[1u32, 2, 3]),
            InputTensor::from_slice("INPUT1", DataType::Fp32, &[1, 2], &[0.5f32, -1.0]),
            InputTensor::from_slice(
                "INPUT2",
                DataType::Bytes,
                &[1, 2],
                &kiln_worker_sdk::encode_bytes(&["kiln", ""]),
            ),
        ],
        ..Default::default()
    }
}

/// Checks echo-multi's answer to [`echo_multi_request`]: input + 1, input × 2 as
/// FP64, each string reversed.
pub fn check_echo_multi(r: &kiln_client::InferResponse) {
    use kiln_client::DataType;
    assert_eq!(r.outputs.len(), 3);
    assert_eq!(r.outputs[0].name, "OUTPUT0");
    assert_eq!(r.outputs[0].dtype, DataType::Uint32);
    assert_eq!(r.outputs[0].values::<u32>(), vec![2, 3, 4]);
    assert_eq!(r.outputs[1].dtype, DataType::Fp64);
    assert_eq!(r.outputs[1].shape, vec![1, 2]);
    assert_eq!(r.outputs[1].values::<f64>(), vec![1.0, -2.0]);
    assert_eq!(r.outputs[2].dtype, DataType::Bytes);
    assert_eq!(
        r.outputs[2].data.as_ref(),
        kiln_worker_sdk::encode_bytes(&["nlik", ""]).as_slice()
    );
}

/// `data` compressed as HTTP and gRPC name it: `gzip`, or `deflate` (zlib), at
/// the best level.
pub fn compress(encoding: &str, data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let level = flate2::Compression::best();
    let written = if encoding == "gzip" {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), level);
        e.write_all(data).and_then(|()| e.finish())
    } else {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), level);
        e.write_all(data).and_then(|()| e.finish())
    };
    written.expect("compressing into memory cannot fail")
}

/// `data` inflated from `encoding` (`gzip` or `deflate`).
pub fn inflate(encoding: &str, data: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    match encoding {
        "gzip" => flate2::read::GzDecoder::new(data).read_to_end(&mut out),
        "deflate" => flate2::read::ZlibDecoder::new(data).read_to_end(&mut out),
        other => panic!("unexpected Content-Encoding {other}"),
    }
    .expect("a valid compressed body");
    out
}

/// The gRPC parameters placing a tensor in the system shared-memory region
/// `region`, its first `byte_size` bytes.
pub fn shm_params(
    region: &str,
    byte_size: i64,
) -> std::collections::HashMap<String, kiln_server::grpc::proto::InferParameter> {
    use kiln_server::grpc::proto::{infer_parameter::ParameterChoice, InferParameter};
    let param = |choice| InferParameter {
        parameter_choice: Some(choice),
    };
    std::collections::HashMap::from([
        (
            "shared_memory_region".to_owned(),
            param(ParameterChoice::StringParam(region.into())),
        ),
        (
            "shared_memory_byte_size".to_owned(),
            param(ParameterChoice::Int64Param(byte_size)),
        ),
    ])
}

/// `pipe`, in Triton's text: an ensemble of one step over `ocr-cls` (as
/// [`TempRepository::write_triton`] writes it), taking images `IMAGE` and
/// answering the direction probabilities `PROBS`.
pub fn triton_pipe(max_batch_size: u32) -> String {
    format!(
        r#"
platform: "ensemble"
max_batch_size: {max_batch_size}
input [ {{ name: "IMAGE" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] }} ]
output [ {{ name: "PROBS" data_type: TYPE_FP32 dims: [ 2 ] }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "ocr-cls"
      model_version: -1
      input_map {{ key: "x" value: "IMAGE" }}
      output_map {{ key: "save_infer_model/scale_0.tmp_1" value: "PROBS" }}
    }}
  ]
}}
"#
    )
}
