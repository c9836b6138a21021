//! The worker's load parameters, checked before any CUDA call (a bad value is
//! refused the same way with or without a GPU).

use std::path::PathBuf;

use kiln_worker_sdk::{ParamKind, ParamSpec, Params, WorkerError};

/// Which kernel an instance runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// UINT8 `image` [H, W, C] → `inverted` = 255 − v (`invert-image`'s contract).
    InvertImage,
    /// FP32 `matrix` [rows, cols] × `vector` [cols] → `product` [rows], per request.
    Matvec,
}

impl Kernel {
    /// The names the `kernel` parameter takes.
    pub const NAMES: &'static str = "`invert-image` or `matvec`";

    fn parse(name: &str) -> Option<Kernel> {
        match name {
            "invert-image" => Some(Kernel::InvertImage),
            "matvec" => Some(Kernel::Matvec),
            _ => None,
        }
    }
}

/// Largest `rows` / `cols` of the matvec kernel (a 16384² FP32 matrix is 1 GiB).
pub const MAX_DIM: i64 = 16384;
/// Largest batch (requests) of the matvec kernel.
pub const MAX_BATCH: i64 = 4096;
/// Most staging memory of one instance: every set of its pool, each a buffer per
/// input and output of one chunk (pinned, and as much on the device). Load
/// parameters cannot make an instance pin more.
pub const MAX_STAGING_BYTES: usize = 4 << 30;

/// The declared parameters (`Worker::PARAMETERS`).
pub const PARAMETERS: &[ParamSpec] = &[
    ParamSpec::load("kernel", ParamKind::Any),
    ParamSpec::load("device", ParamKind::Int { min: 0, max: 63 }),
    ParamSpec::load("streams", ParamKind::Int { min: 1, max: 8 }),
    ParamSpec::load(
        "chunk_bytes",
        ParamKind::Int {
            min: 4096,
            max: 1 << 30,
        },
    ),
    ParamSpec::load(
        "chunk_rows",
        ParamKind::Int {
            min: 1,
            max: MAX_BATCH,
        },
    ),
    ParamSpec::load(
        "rows",
        ParamKind::Int {
            min: 1,
            max: MAX_DIM,
        },
    ),
    ParamSpec::load(
        "cols",
        ParamKind::Int {
            min: 1,
            max: MAX_DIM,
        },
    ),
    ParamSpec::load(
        "max_batch_size",
        ParamKind::Int {
            min: 1,
            max: MAX_BATCH,
        },
    ),
    // Names a folder to open libcuda.so.1 / libnvrtc.so.13 from: the operator's.
    ParamSpec::operator("cuda_library_dir"),
];

/// The checked configuration of one instance.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub kernel: Kernel,
    pub device: usize,
    /// Streams the chunks of a batch are spread over.
    pub streams: usize,
    /// Image inversion: bytes per chunk (a multiple of 4).
    pub chunk_bytes: usize,
    /// Matvec: requests per chunk.
    pub chunk_rows: usize,
    pub rows: usize,
    pub cols: usize,
    pub max_batch_size: usize,
    pub library_dir: Option<PathBuf>,
}

impl Config {
    /// Reads and checks the parameters.
    pub fn from_params(params: Params<'_>) -> Result<Config, WorkerError> {
        let kernel = match params.string("kernel") {
            None => {
                return Err(format!("the `kernel` parameter is required: {}", Kernel::NAMES).into())
            }
            Some(name) => Kernel::parse(&name).ok_or_else(|| {
                WorkerError::new(format!("kernel `{name}` is unknown: {}", Kernel::NAMES))
            })?,
        };
        let get = |name: &str, default: i64| -> Result<usize, WorkerError> {
            let spec = PARAMETERS.iter().find(|s| s.name() == name);
            if let Some(spec) = spec {
                spec.check(params)?;
            }
            let value = params.int(name)?.unwrap_or(default);
            usize::try_from(value).map_err(|_| format!("{name} must not be negative").into())
        };
        let config = Config {
            kernel,
            device: get("device", 0)?,
            streams: get("streams", 2)?,
            // Whole 32-bit words: the kernel inverts 4 bytes per load.
            chunk_bytes: get("chunk_bytes", 1 << 20)? / 4 * 4,
            chunk_rows: get("chunk_rows", 16)?,
            rows: get("rows", 256)?,
            cols: get("cols", 256)?,
            max_batch_size: get("max_batch_size", 64)?,
            library_dir: params.string("cuda_library_dir").map(PathBuf::from),
        };
        let (inputs, outputs) = config.chunk_sizes();
        let per_set: usize = inputs.iter().chain(&outputs).sum();
        let staging = config.staging_sets() * per_set;
        if staging > MAX_STAGING_BYTES {
            return Err(format!(
                "{} staging sets of {per_set} bytes ({staging} pinned bytes) are over \
                 {MAX_STAGING_BYTES}: lower chunk_rows, chunk_bytes or streams",
                config.staging_sets()
            )
            .into());
        }
        Ok(config)
    }

    /// Staging sets per instance: two per stream, so that the CPU fills one while
    /// the other's copies and kernel run.
    pub fn staging_sets(&self) -> usize {
        2 * self.streams
    }

    /// Bytes of each input and of the output for one chunk (the staging sizes).
    pub fn chunk_sizes(&self) -> (Vec<usize>, Vec<usize>) {
        match self.kernel {
            Kernel::InvertImage => (vec![self.chunk_bytes], vec![self.chunk_bytes]),
            Kernel::Matvec => {
                let f = std::mem::size_of::<f32>();
                (
                    vec![
                        self.chunk_rows * self.rows * self.cols * f,
                        self.chunk_rows * self.cols * f,
                    ],
                    vec![self.chunk_rows * self.rows * f],
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::types::params_from_pairs;

    fn config(pairs: &[(&str, &str)]) -> Result<Config, WorkerError> {
        let params = params_from_pairs(pairs);
        Config::from_params(Params(&params))
    }

    #[test]
    fn defaults_and_derived_sizes() {
        let c = config(&[("kernel", "matvec")]).unwrap();
        assert_eq!((c.streams, c.chunk_rows, c.rows, c.cols), (2, 16, 256, 256));
        assert_eq!(c.staging_sets(), 4);
        assert_eq!(
            c.chunk_sizes(),
            (vec![16 * 256 * 256 * 4, 16 * 256 * 4], vec![16 * 256 * 4])
        );
        let c = config(&[("kernel", "invert-image"), ("chunk_bytes", "10001")]).unwrap();
        assert_eq!(c.chunk_bytes, 10000);
        assert_eq!(c.chunk_sizes(), (vec![10000], vec![10000]));
        assert_eq!(c.library_dir, None);
    }

    #[test]
    fn bad_values_are_refused_naming_the_parameter() {
        let e = config(&[]).unwrap_err().to_string();
        assert!(e.contains("`kernel` parameter is required"), "{e}");
        let e = config(&[("kernel", "fft")]).unwrap_err().to_string();
        assert!(e.contains("kernel `fft` is unknown"), "{e}");
        for (key, value) in [
            ("streams", "0"),
            ("streams", "9"),
            ("chunk_bytes", "100"),
            ("rows", "16385"),
            ("cols", "x"),
            ("device", "-1"),
        ] {
            let e = config(&[("kernel", "matvec"), (key, value)])
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{key}={value}: {e}");
        }
        // 4096 matrices of 512x256 FP32 a chunk: 2 GiB a set, 8 GiB for 4 sets.
        let e = config(&[
            ("kernel", "matvec"),
            ("chunk_rows", "4096"),
            ("rows", "512"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("lower chunk_rows"), "{e}");
        let e = config(&[
            ("kernel", "invert-image"),
            ("chunk_bytes", "1073741824"),
            ("streams", "2"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("4 staging sets of 2147483648 bytes"), "{e}");
        assert!(config(&[("kernel", "invert-image"), ("chunk_bytes", "268435456")]).is_ok());
    }

    #[test]
    fn the_library_folder_is_operator_only() {
        let spec = PARAMETERS
            .iter()
            .find(|s| s.name() == "cuda_library_dir")
            .unwrap();
        assert_eq!(spec.scope, kiln_worker_sdk::ParamScope::Operator);
    }
}
