//! The batch a worker runs: inputs that borrow the host's pooled batch memory, and
//! outputs the worker writes into host-owned buffers it sizes through a callback
//! (as Triton's `TRITONBACKEND_OutputBuffer`). The `*Ffi` types cross the ABI
//! boundary; [`Batch`], [`Input`] and [`Output`] are the safe views a worker uses.

// `#[sabi_trait]` expands to impls inside a const block.
#![allow(non_local_definitions)]

use abi_stable::sabi_trait;
use abi_stable::sabi_types::RMut;
use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut, RStr, RString};
use abi_stable::StableAbi;
use bytemuck::Pod;

use crate::error::{RequestError, WorkerError};
use crate::types::{DataType, Param, Params, Shape, TensorSpec};

/// A host-owned output buffer the worker may resize. Implemented by the host (the
/// server's pooled aligned buffers, or the SDK's test harness).
#[sabi_trait]
pub trait OutputBuffer {
    /// Resizes the buffer to `len` bytes and returns it, or an error when the
    /// memory cannot be had (never aborts). Contents are unspecified (stale data may
    /// remain): the worker must write every byte it reports.
    fn resize(&mut self, len: usize) -> RResult<RSliceMut<'_, u8>, RString>;
}

/// A borrowed, type-erased [`OutputBuffer`].
pub type OutputBufferRef<'a> = OutputBuffer_TO<'a, RMut<'a, ()>>;

/// One input of a batch, as it crosses the boundary.
#[repr(C)]
#[derive(StableAbi)]
pub struct InputFfi<'a> {
    pub name: RStr<'a>,
    pub dtype: DataType,
    /// Every request's tensor, back to back in request order.
    pub data: RSlice<'a, u8>,
    /// Each request's shape (with its batch dimension when the worker batches).
    pub shapes: RSlice<'a, Shape>,
}

/// One output of a batch, as it crosses the boundary.
#[repr(C)]
#[derive(StableAbi)]
pub struct OutputFfi<'a> {
    pub name: RStr<'a>,
    pub dtype: DataType,
    /// Each request's output shape, filled in by the worker.
    pub shapes: RSliceMut<'a, Shape>,
    /// Where the worker writes every request's output, back to back.
    pub buffer: OutputBufferRef<'a>,
    /// Bytes of `buffer` the worker wrote (set by [`Output::allocate`]).
    pub len: usize,
    /// Whether the worker produced this output.
    pub written: bool,
}

impl<'a> OutputFfi<'a> {
    /// Output `spec`, not yet written, whose per-request shapes the worker fills
    /// into `shapes` and whose bytes it writes into `buffer`.
    pub fn new<B: OutputBuffer + 'a>(
        spec: &'a TensorSpec,
        shapes: &'a mut [Shape],
        buffer: &'a mut B,
    ) -> Self {
        OutputFfi {
            name: RStr::from_str(spec.name.as_str()),
            dtype: spec.dtype,
            shapes: shapes.into(),
            buffer: OutputBuffer_TO::from_ptr(RMut::new(buffer), abi_stable::sabi_trait::TD_Opaque),
            len: 0,
            written: false,
        }
    }
}

/// Per-request metadata: the request's own parameters, and the slot where the
/// worker may fail this request alone ([`Batch::fail`]).
#[repr(C)]
#[derive(StableAbi)]
pub struct RequestFfi<'a> {
    pub params: RSlice<'a, Param>,
    /// Set by the worker: this request failed; the others of the batch stand.
    pub failure: ROption<RequestError>,
}

impl<'a> RequestFfi<'a> {
    /// A request with these parameters, not failed.
    pub fn new(params: &'a [Param]) -> Self {
        RequestFfi {
            params: params.into(),
            failure: ROption::RNone,
        }
    }
}

/// A batch as it crosses the boundary (`'s`: the slices, `'a`: what they point to).
#[repr(C)]
#[derive(StableAbi)]
pub struct BatchFfi<'s, 'a> {
    pub inputs: RSlice<'s, InputFfi<'a>>,
    pub outputs: RSliceMut<'s, OutputFfi<'a>>,
    pub requests: RSliceMut<'s, RequestFfi<'a>>,
}

/// The batch handed to [`crate::Worker::run`].
pub struct Batch<'b, 'a> {
    inputs: &'b [InputFfi<'a>],
    outputs: &'b mut [OutputFfi<'a>],
    requests: &'b mut [RequestFfi<'a>],
}

impl<'b, 'a> Batch<'b, 'a> {
    /// Wraps the boundary form.
    pub fn new(ffi: &'b mut BatchFfi<'_, 'a>) -> Self {
        Batch {
            inputs: ffi.inputs.as_slice(),
            requests: ffi.requests.as_mut_slice(),
            outputs: ffi.outputs.as_mut_slice(),
        }
    }

    /// Number of requests in the batch.
    pub fn request_count(&self) -> usize {
        self.requests.len()
    }

    /// Total rows (sum of the requests' batch dimensions) of the first input.
    pub fn rows(&self) -> usize {
        self.inputs
            .first()
            .map_or(0, |i| i.shapes.iter().map(Shape::rows).sum())
    }

    /// The parameters request `index` carried.
    pub fn params(&self, index: usize) -> Params<'a> {
        Params(
            self.requests
                .get(index)
                .map_or(&[], |r| r.params.as_slice()),
        )
    }

    /// Fails request `index` alone with `error`; the worker still writes its rows of
    /// every output (they keep their place in the batch, and nobody receives them).
    /// The other requests are answered normally. Failing it again replaces the error.
    pub fn fail(&mut self, index: usize, error: RequestError) -> Result<(), WorkerError> {
        let count = self.requests.len();
        let request = self.requests.get_mut(index).ok_or_else(|| {
            WorkerError::new(format!(
                "cannot fail request {index}: the batch has {count}"
            ))
        })?;
        request.failure = ROption::RSome(error);
        Ok(())
    }

    /// Whether request `index` was failed with [`Batch::fail`].
    pub fn is_failed(&self, index: usize) -> bool {
        self.requests
            .get(index)
            .is_some_and(|r| r.failure.is_some())
    }

    /// Number of inputs.
    pub fn input_count(&self) -> usize {
        self.inputs.len()
    }

    /// Input `index`, in the order the worker declared.
    pub fn input(&self, index: usize) -> Result<Input<'a>, WorkerError> {
        self.inputs
            .get(index)
            .map(|ffi| Input {
                name: ffi.name.as_str(),
                dtype: ffi.dtype,
                data: ffi.data.as_slice(),
                shapes: ffi.shapes.as_slice(),
            })
            .ok_or_else(|| WorkerError::new(format!("no input #{index}")))
    }

    /// The input called `name`.
    pub fn input_named(&self, name: &str) -> Result<Input<'a>, WorkerError> {
        let index = self
            .inputs
            .iter()
            .position(|i| i.name.as_str() == name)
            .ok_or_else(|| WorkerError::new(format!("no input `{name}`")))?;
        self.input(index)
    }

    /// Number of outputs.
    pub fn output_count(&self) -> usize {
        self.outputs.len()
    }

    /// Output `index`, in the order the worker declared.
    pub fn output(&mut self, index: usize) -> Result<Output<'_, 'a>, WorkerError> {
        self.outputs
            .get_mut(index)
            .map(|ffi| Output { ffi })
            .ok_or_else(|| WorkerError::new(format!("no output #{index}")))
    }

    /// The output called `name`.
    pub fn output_named(&mut self, name: &str) -> Result<Output<'_, 'a>, WorkerError> {
        let index = self
            .outputs
            .iter()
            .position(|o| o.name.as_str() == name)
            .ok_or_else(|| WorkerError::new(format!("no output `{name}`")))?;
        self.output(index)
    }
}

/// One input of a batch: every request's tensor, back to back.
#[derive(Clone, Copy)]
pub struct Input<'a> {
    name: &'a str,
    dtype: DataType,
    data: &'a [u8],
    shapes: &'a [Shape],
}

impl<'a> Input<'a> {
    /// The input's name.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The input's datatype.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// Raw bytes of every request's tensor, back to back.
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    /// Each request's shape.
    pub fn shapes(&self) -> &'a [Shape] {
        self.shapes
    }

    /// The data as elements of `T` (checks size and alignment; the host aligns
    /// batch memory to 64 bytes, so this fails only on a datatype mismatch).
    pub fn as_slice<T: Pod>(&self) -> Result<&'a [T], WorkerError> {
        bytemuck::try_cast_slice(self.data).map_err(|e| {
            WorkerError::new(format!(
                "input `{}` ({}) viewed as {}: {e}",
                self.name,
                self.dtype,
                std::any::type_name::<T>()
            ))
        })
    }
}

/// One output of a batch.
pub struct Output<'o, 'a> {
    ffi: &'o mut OutputFfi<'a>,
}

impl<'o, 'a> Output<'o, 'a> {
    /// The output's name.
    pub fn name(&self) -> &str {
        self.ffi.name.as_str()
    }

    /// The output's datatype.
    pub fn dtype(&self) -> DataType {
        self.ffi.dtype
    }

    /// Sets each request's output shape and returns the buffer to fill, sized for
    /// those shapes (fixed-size datatypes only; see [`Output::allocate_bytes`]).
    pub fn allocate(&mut self, shapes: &[Shape]) -> Result<&mut [u8], WorkerError> {
        let size = self.ffi.dtype.size().ok_or_else(|| {
            WorkerError::new(format!(
                "output `{}` is BYTES: use allocate_bytes",
                self.ffi.name
            ))
        })?;
        let len = shapes
            .iter()
            .try_fold(0usize, |sum, s| sum.checked_add(s.element_count()))
            .and_then(|elements| elements.checked_mul(size))
            .ok_or_else(|| {
                WorkerError::new(format!(
                    "output `{}`: the shapes' size overflows",
                    self.ffi.name
                ))
            })?;
        self.allocate_bytes(shapes, len)
    }

    /// Like [`Output::allocate`], typed.
    pub fn allocate_as<T: Pod>(&mut self, shapes: &[Shape]) -> Result<&mut [T], WorkerError> {
        let name = self.ffi.name.as_str().to_owned();
        let bytes = self.allocate(shapes)?;
        bytemuck::try_cast_slice_mut(bytes)
            .map_err(|e| WorkerError::new(format!("output `{name}` viewed as slice: {e}")))
    }

    /// Sets each request's output shape and returns a buffer of exactly `len` bytes
    /// (for BYTES outputs, whose size the shapes do not tell).
    pub fn allocate_bytes(
        &mut self,
        shapes: &[Shape],
        len: usize,
    ) -> Result<&mut [u8], WorkerError> {
        if shapes.len() != self.ffi.shapes.len() {
            return Err(WorkerError::new(format!(
                "output `{}`: {} shapes given for {} requests",
                self.ffi.name,
                shapes.len(),
                self.ffi.shapes.len()
            )));
        }
        self.ffi.shapes.as_mut_slice().copy_from_slice(shapes);
        self.ffi.len = len;
        self.ffi.written = true;
        let name = self.ffi.name;
        let buf = match self.ffi.buffer.resize(len) {
            RResult::ROk(buf) => buf.into_mut_slice(),
            RResult::RErr(e) => {
                self.ffi.written = false;
                return Err(WorkerError::new(format!("output `{name}`: {e}")));
            }
        };
        if buf.len() != len {
            return Err(WorkerError::new(format!(
                "output `{}`: host gave {} bytes for {len}",
                self.ffi.name,
                buf.len()
            )));
        }
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Harness, TestTensor};
    use crate::types::{BatcherKind, TensorSpec, WorkerInfo};
    use crate::worker::Worker;

    /// Asks for an output of the shape its input's values say (rows × cols).
    struct Sized;

    impl Worker for Sized {
        fn init(_: Params<'_>) -> Result<Self, WorkerError> {
            Ok(Sized)
        }

        fn info(&self) -> WorkerInfo {
            WorkerInfo {
                inputs: vec![TensorSpec::new("DIMS", DataType::Int64, &[2])].into(),
                outputs: vec![TensorSpec::new("OUT", DataType::Fp32, &[-1, -1])].into(),
                max_batch_size: 0,
                batcher: BatcherKind::Soft,
                allow_ragged_batch: false,
            }
        }

        fn run(&mut self, batch: &mut Batch<'_, '_>) -> Result<(), WorkerError> {
            let dims = batch.input(0)?.as_slice::<i64>()?.to_vec();
            let shape = Shape::new(&dims).ok_or("bad dims")?;
            let mut output = batch.output(0)?;
            output.allocate_as::<f32>(&[shape])?.fill(1.0);
            Ok(())
        }
    }

    fn run(dims: [i64; 2]) -> Result<Vec<f32>, WorkerError> {
        let mut h = Harness::start::<Sized>(&[])?;
        let input = TestTensor::new("DIMS", DataType::Int64, &[2], &dims);
        Ok(h.run(&[vec![input]])?[0][0].values::<f32>())
    }

    #[test]
    fn output_sizes_are_checked_not_wrapped_or_aborted() {
        assert_eq!(run([2, 3]).unwrap(), vec![1.0; 6]);
        // The element count saturates, and × 4 bytes overflows: an error, not a
        // panic (debug) or a wrapped, too small buffer (release).
        let err = run([i64::MAX, 4]).unwrap_err();
        assert!(err.0.contains("overflows"), "{err}");
        // A size that does not overflow but cannot be allocated: the harness's
        // buffer (as the server's) answers an error instead of aborting.
        let err = run([1 << 40, 1 << 20]).unwrap_err();
        assert!(err.0.contains("cannot allocate"), "{err}");
    }
}
