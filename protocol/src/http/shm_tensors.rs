//! Triton's system shared-memory extension in KServe v2 JSON inference requests.
//!
//! A tensor whose `parameters` carry `shared_memory_region`,
//! `shared_memory_byte_size` and optionally `shared_memory_offset` has no `data`:
//! an input's bytes are copied out of the region when the request is decoded, an
//! output is written into it after inference and answered without data. The
//! regions are the server's ([`ShmRegions`], `kiln_core::memory::shared_memory`); where each output
//! goes is returned beside the protocol-free [`InferRequest`] as an
//! [`OutputPlacement`]; the protocol's keys never reach the worker.

use serde_json::{Map, Value};

use super::binary::{byte_count, BinaryOutputs, SizedTensor};
use crate::error::{ProtocolError, Result};
use crate::infer::{InferRequest, InferResponse};
use crate::shm_regions::{
    check_fits, in_tensor, ShmPlace, ShmRegions, ShmWindow, BYTE_SIZE, OFFSET, REGION,
};

/// The shared-memory place of tensor `name` (`kind`: "input" or "output") its
/// `parameters` give, if it names a region.
pub(super) fn shm_place<'a>(
    kind: &str,
    name: &str,
    params: Option<&'a Map<String, Value>>,
) -> Result<Option<ShmPlace<'a>>> {
    let Some(params) = params else {
        return Ok(None);
    };
    let context = || format!("{kind} `{name}`: ");
    let byte_size = byte_count(params, BYTE_SIZE, context)?;
    let offset = byte_count(params, OFFSET, context)?;
    let region = params.get(REGION).map(|region| match region {
        Value::String(region) => Ok(region.as_str()),
        other => Err(format!(", got {other}")),
    });
    ShmPlace::from_parameters(kind, name, region, byte_size, offset)
}

/// The window of an input in shared memory: `byte_size` must fit its shape and
/// datatype exactly. Its bytes are copied later, by [`ShmReads::read_into`].
pub(super) fn input_window<R: ShmRegions>(
    tensor: &SizedTensor<'_>,
    place: &ShmPlace<'_>,
    shm: Option<&R>,
) -> Result<R::Window> {
    tensor.check_size(place.byte_size)?;
    place.window(tensor.kind, tensor.name, shm)
}

/// The shared-memory inputs of a decoded request, still to be copied out of their
/// regions (decoding checks the windows; copying them is the costly part, done
/// where the caller chooses).
pub struct ShmReads<W>(Vec<PendingRead<W>>);

struct PendingRead<W> {
    /// The input's index in the request.
    input: usize,
    window: W,
    /// Elements of the input's shape.
    elements: usize,
}

impl<W> Default for ShmReads<W> {
    fn default() -> Self {
        ShmReads(Vec::new())
    }
}

impl<W: ShmWindow> ShmReads<W> {
    pub(super) fn push(&mut self, input: usize, window: W, elements: usize) {
        self.0.push(PendingRead {
            input,
            window,
            elements,
        });
    }

    /// The bytes to copy.
    pub fn bytes(&self) -> usize {
        self.0.iter().map(|r| r.window.len()).sum()
    }

    /// Copies each window into its input's data (a copy, read now: an object
    /// truncated meanwhile is a 400, and later changes of the region do not reach
    /// the request). BYTES elements must fill their window.
    pub fn read_into(self, request: &mut InferRequest) -> Result<()> {
        for read in self.0 {
            let input = request.inputs.get_mut(read.input).ok_or_else(|| {
                ProtocolError::Internal(format!("no input {} to read into", read.input))
            })?;
            let data = read
                .window
                .read()
                .map_err(|e| in_tensor(e, "input", &input.name))?;
            SizedTensor {
                kind: "input",
                name: &input.name,
                dtype: input.dtype,
                shape: &input.shape,
                elements: read.elements,
                param: BYTE_SIZE,
            }
            .check_bytes(&data)?;
            input.data = data;
        }
        Ok(())
    }
}

/// Where each output of a response goes: into a shared-memory region when the
/// request placed it there (a window `W` of a region), else binary or JSON as
/// [`BinaryOutputs`] says.
#[derive(Clone)]
pub struct OutputPlacement<W> {
    /// The binary tensor data choice, for outputs not in shared memory.
    pub binary: BinaryOutputs,
    /// Outputs to write into shared memory, by name, with the window checked (and
    /// held) when the request was decoded.
    shared_memory: Vec<(String, W)>,
}

impl<W> Default for OutputPlacement<W> {
    fn default() -> Self {
        OutputPlacement {
            binary: BinaryOutputs::default(),
            shared_memory: Vec::new(),
        }
    }
}

/// An output written into shared memory (the response leaves its data out).
pub(super) struct InShm<'a> {
    pub output: &'a str,
}

impl<W: ShmWindow> OutputPlacement<W> {
    /// Takes the protocol's keys (binary and shared-memory) out of the request
    /// parameters, so they never reach the worker.
    pub(super) fn from_request_parameters(params: &mut Map<String, Value>) -> Result<Self> {
        for key in [REGION, BYTE_SIZE, OFFSET] {
            params.remove(key);
        }
        Ok(OutputPlacement {
            binary: BinaryOutputs::from_request_parameters(params)?,
            shared_memory: Vec::new(),
        })
    }

    /// Records output `name`'s own choice: binary, or a window of `shm`.
    pub(super) fn set_from_output_parameters<R: ShmRegions<Window = W>>(
        &mut self,
        name: &str,
        params: Option<&Map<String, Value>>,
        shm: Option<&R>,
    ) -> Result<()> {
        self.binary.set_from_output_parameters(name, params)?;
        if let Some(place) = shm_place("output", name, params)? {
            let slice = place.window("output", name, shm)?;
            self.shared_memory.push((name.to_owned(), slice));
        }
        Ok(())
    }

    /// The outputs to write into shared memory, by name.
    pub fn shared_memory_outputs(&self) -> impl Iterator<Item = &str> {
        self.shared_memory.iter().map(|(name, _)| name.as_str())
    }

    /// The work of encoding `response`: its bytes to write as JSON, and those to
    /// write into shared memory (binary outputs are sent as they are).
    pub fn encoding_work(&self, response: &InferResponse) -> (usize, usize) {
        let (mut json, mut copy) = (0, 0);
        for output in &response.outputs {
            if self.shared_memory.iter().any(|(n, _)| *n == output.name) {
                copy += output.data.len();
            } else if !self.binary.is_binary(&output.name) {
                json += output.data.len();
            }
        }
        (json, copy)
    }

    /// Writes the outputs placed in shared memory; each must fit its window (else
    /// nothing is written).
    pub(super) fn write_outputs<'a>(
        &'a self,
        response: &'a InferResponse,
    ) -> Result<Vec<InShm<'a>>> {
        let mut placed = Vec::with_capacity(self.shared_memory.len());
        for output in &response.outputs {
            let Some((_, slice)) = self.shared_memory.iter().find(|(n, _)| *n == output.name)
            else {
                continue;
            };
            check_fits(output, slice)?;
            placed.push((slice, output));
        }
        placed
            .into_iter()
            .map(|(slice, output)| {
                slice
                    .write(&output.data)
                    .map_err(|e| in_tensor(e, "output", &output.name))?;
                Ok(InShm {
                    output: &output.name,
                })
            })
            .collect()
    }
}
