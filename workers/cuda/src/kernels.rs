//! The kernels, as CUDA C compiled at load time with NVRTC (to PTX, which the
//! driver compiles for the GPU at hand), and their launches.

use std::sync::Arc;

use kiln_buffers::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use kiln_buffers::cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use kiln_buffers::cuda::CudaError;

use crate::chunks::grid;
use crate::config::Kernel;

/// `invert`: 255 − v, which for a byte is v XOR 0xFF: whole 32-bit words by a
/// grid-stride loop, then the last 0–3 bytes. `matvec`: one warp per output row
/// (request b, row i): lanes stride over the columns, then a shuffle reduction.
const SOURCE: &str = r#"
extern "C" __global__ void invert(const unsigned char* __restrict__ in,
                                  unsigned char* __restrict__ out,
                                  unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long words = n / 4;
    const unsigned int* in4 = (const unsigned int*)in;
    unsigned int* out4 = (unsigned int*)out;
    for (unsigned long long i = first; i < words; i += stride) {
        out4[i] = ~in4[i];
    }
    for (unsigned long long i = words * 4 + first; i < n; i += stride) {
        out[i] = (unsigned char)(255 - in[i]);
    }
}

extern "C" __global__ void matvec(const float* __restrict__ a,
                                  const float* __restrict__ x,
                                  float* __restrict__ y,
                                  unsigned int total_rows,
                                  unsigned int rows,
                                  unsigned int cols) {
    unsigned int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    unsigned int lane = threadIdx.x % 32;
    if (warp >= total_rows) return;
    const float* row = a + (unsigned long long)warp * cols;
    const float* v = x + (unsigned long long)(warp / rows) * cols;
    float sum = 0.0f;
    for (unsigned int j = lane; j < cols; j += 32) sum += row[j] * v[j];
    for (int offset = 16; offset > 0; offset >>= 1)
        sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (lane == 0) y[warp] = sum;
}
"#;

/// Threads per block of both kernels.
const BLOCK: u32 = 256;
/// Most blocks of the grid-stride `invert` (beyond a few waves per SM, extra
/// blocks only add scheduling).
const MAX_BLOCKS: u32 = 4096;

/// A compiled kernel, ready to launch.
pub struct Compiled {
    function: CudaFunction,
    kernel: Kernel,
}

impl Compiled {
    /// Compiles the source with NVRTC and loads `kernel`'s function into `ctx`.
    pub fn new(ctx: &Arc<CudaContext>, kernel: Kernel) -> Result<Compiled, CudaError> {
        let options = CompileOptions {
            name: Some("kiln_cuda_worker.cu".to_owned()),
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(SOURCE, options)
            .map_err(|e| CudaError::Compile(e.to_string()))?;
        let module = ctx.load_module(ptx)?;
        let name = match kernel {
            Kernel::InvertImage => "invert",
            Kernel::Matvec => "matvec",
        };
        Ok(Compiled {
            function: module.load_function(name)?,
            kernel,
        })
    }

    /// Enqueues the inversion of `n` bytes from `input` to `output` (device addresses).
    pub fn invert(
        &self,
        stream: &CudaStream,
        input: u64,
        output: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        debug_assert_eq!(self.kernel, Kernel::InvertImage);
        let n = n as u64;
        let config = LaunchConfig {
            grid_dim: (grid(n.div_ceil(4) as usize, BLOCK, MAX_BLOCKS), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&self.function);
        launch.arg(&input).arg(&output).arg(&n);
        // SAFETY: the arguments match `invert`'s signature; both buffers hold `n`
        // bytes and live until the chunk's event completes.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    /// Enqueues `requests` products of a `rows`×`cols` matrix and a vector.
    pub fn matvec(
        &self,
        stream: &CudaStream,
        (a, x, y): (u64, u64, u64),
        requests: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        debug_assert_eq!(self.kernel, Kernel::Matvec);
        let total = requests * rows;
        let too_big = |what: &str| CudaError::Size(format!("{what} beyond 32 bits"));
        let total_rows = u32::try_from(total).map_err(|_| too_big("rows"))?;
        let rows = u32::try_from(rows).map_err(|_| too_big("rows"))?;
        let cols = u32::try_from(cols).map_err(|_| too_big("cols"))?;
        let warps_per_block = (BLOCK / 32) as usize;
        let config = LaunchConfig {
            grid_dim: (grid(total, warps_per_block as u32, u32::MAX), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&self.function);
        launch
            .arg(&a)
            .arg(&x)
            .arg(&y)
            .arg(&total_rows)
            .arg(&rows)
            .arg(&cols);
        // SAFETY: the arguments match `matvec`'s signature; the buffers hold the
        // chunk's matrices, vectors and products and live until its event.
        unsafe { launch.launch(config) }?;
        Ok(())
    }
}
