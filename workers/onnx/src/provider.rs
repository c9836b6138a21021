//! The execution provider a session runs on: ONNX Runtime's CPU provider (the
//! default) or its CUDA provider (`execution_provider = "cuda"`, `cuda_device`).
//!
//! The CUDA provider lives in the GPU build of ONNX Runtime (the `onnxruntime-gpu`
//! wheel's `libonnxruntime.so` with `libonnxruntime_providers_cuda.so` beside it),
//! which the operator names with `runtime`; it needs an NVIDIA driver and the CUDA
//! and cuDNN libraries that build was made for. Whatever is missing, the load fails
//! naming it: the provider is registered with `error_on_failure`, never the silent
//! fall-back to CPU that ONNX Runtime does by default.

use kiln_worker_sdk::{Params, WorkerError};
use ort::ep::{ExecutionProvider, CUDA};
use ort::session::builder::SessionBuilder;

/// Where a session runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    Cpu,
    Cuda { device: i32 },
}

impl Provider {
    /// From `execution_provider` (`cpu` or `cuda`, default `cpu`) and `cuda_device`
    /// (default 0).
    pub fn from_params(params: &Params<'_>) -> Result<Provider, WorkerError> {
        let name = params
            .string("execution_provider")
            .map(|s| s.to_ascii_lowercase());
        let device = params.int("cuda_device")?;
        match name.as_deref() {
            None | Some("cpu") => {
                if device.is_some() {
                    return Err(WorkerError::new(
                        "`cuda_device` is set but `execution_provider` is not `cuda`",
                    ));
                }
                Ok(Provider::Cpu)
            }
            Some("cuda") => {
                let device = device.unwrap_or(0);
                let device = i32::try_from(device)
                    .ok()
                    .filter(|d| *d >= 0)
                    .ok_or_else(|| format!("`cuda_device` must be 0 or more, got {device}"))?;
                Ok(Provider::Cuda { device })
            }
            Some(other) => Err(WorkerError::new(format!(
                "`execution_provider` must be `cpu` or `cuda`, got `{other}`"
            ))),
        }
    }

    /// Adds the provider to a session being built (nothing for CPU).
    pub fn register(self, builder: SessionBuilder) -> Result<SessionBuilder, WorkerError> {
        let Provider::Cuda { device } = self else {
            return Ok(builder);
        };
        let unavailable = |why: String| {
            WorkerError::new(format!(
                "execution_provider cuda: ONNX Runtime's CUDA provider is not available: {why}"
            ))
        };
        match CUDA::is_available() {
            Ok(true) => {}
            Ok(false) => {
                return Err(unavailable(
                    "this ONNX Runtime build has no CUDA provider (set `runtime` to the \
                     libonnxruntime.so of the onnxruntime-gpu build)"
                        .into(),
                ))
            }
            Err(e) => return Err(unavailable(e.to_string())),
        }
        let cuda = CUDA::default()
            .with_device_id(device)
            .build()
            .error_on_failure();
        builder
            .with_execution_providers([cuda])
            .map_err(|e| unavailable(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::types::params_from_pairs;

    fn parse(pairs: &[(&str, &str)]) -> Result<Provider, WorkerError> {
        let params = params_from_pairs(pairs);
        Provider::from_params(&Params(&params))
    }

    #[test]
    fn names_and_devices() {
        assert_eq!(parse(&[]).unwrap(), Provider::Cpu);
        assert_eq!(
            parse(&[("execution_provider", "CPU")]).unwrap(),
            Provider::Cpu
        );
        assert_eq!(
            parse(&[("execution_provider", "cuda"), ("cuda_device", "1")]).unwrap(),
            Provider::Cuda { device: 1 }
        );
        for (pairs, needle) in [
            (
                &[("execution_provider", "tensorrt")][..],
                "must be `cpu` or `cuda`",
            ),
            (&[("cuda_device", "0")][..], "not `cuda`"),
            (
                &[("execution_provider", "cuda"), ("cuda_device", "-1")][..],
                "0 or more",
            ),
        ] {
            let e = parse(pairs).unwrap_err().to_string();
            assert!(e.contains(needle), "{pairs:?}: {e}");
        }
    }
}
