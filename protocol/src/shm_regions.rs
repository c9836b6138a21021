//! What the codecs need of shared memory (Triton's system shared-memory
//! extension): the server's registry of regions, seen through two small traits.
//! A tensor's `shared_memory_region`, `shared_memory_byte_size` and
//! `shared_memory_offset` parameters are parsed by the codecs; the window they name
//! is looked up with [`ShmRegions::window`] while the request is decoded (so errors
//! come in the order the request names things), and read or written through
//! [`ShmWindow`]. A decoder without a registry (a client's) passes
//! [`NoSharedMemory`], and shared-memory tensors are refused.

use bytes::Bytes;

use crate::error::{ProtocolError, Result};
#[cfg(any(feature = "http", feature = "grpc"))]
use crate::infer::OutputTensor;

/// The parameter naming a tensor's shared-memory region.
pub const REGION: &str = "shared_memory_region";
/// The parameter giving the size of a tensor's window.
pub const BYTE_SIZE: &str = "shared_memory_byte_size";
/// The parameter giving the start of a tensor's window in its region.
pub const OFFSET: &str = "shared_memory_offset";

/// A tensor's place in shared memory, from its parameters (borrowed from the
/// message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmPlace<'a> {
    /// The region's name.
    pub region: &'a str,
    /// The window's size in bytes.
    pub byte_size: usize,
    /// The window's start in the region.
    pub offset: usize,
}

impl<'a> ShmPlace<'a> {
    /// The place of tensor `name` (`kind`: "input" or "output"), from its
    /// parameters as the message carried them: `region` the
    /// `shared_memory_region` (`Err(got)`: not a string, `got` ends the message),
    /// `byte_size` and `offset` the other two. `None` when it names no region.
    pub fn from_parameters(
        kind: &str,
        name: &str,
        region: Option<Result<&'a str, String>>,
        byte_size: Option<usize>,
        offset: Option<usize>,
    ) -> Result<Option<ShmPlace<'a>>> {
        let region = match region {
            None if byte_size.is_none() && offset.is_none() => return Ok(None),
            None => {
                return Err(ProtocolError::invalid(format!(
                    "{kind} `{name}`: `{BYTE_SIZE}` or `{OFFSET}` without `{REGION}`"
                )))
            }
            Some(Ok(region)) => region,
            Some(Err(got)) => {
                return Err(ProtocolError::invalid(format!(
                    "{kind} `{name}`: `{REGION}` must be a string{got}"
                )))
            }
        };
        let byte_size = byte_size.ok_or_else(|| {
            ProtocolError::invalid(format!("{kind} `{name}`: `{REGION}` needs `{BYTE_SIZE}`"))
        })?;
        Ok(Some(ShmPlace {
            region,
            byte_size,
            offset: offset.unwrap_or(0),
        }))
    }

    /// The window this place names in `shm` (`None`: shared memory is refused).
    /// As Triton answers an inference naming an unregistered region with 400, an
    /// unknown region is an invalid request here.
    pub fn window<R: ShmRegions>(
        &self,
        kind: &str,
        name: &str,
        shm: Option<&R>,
    ) -> Result<R::Window> {
        let shm = shm.ok_or_else(|| {
            ProtocolError::invalid(format!(
                "{kind} `{name}`: shared memory is not available here"
            ))
        })?;
        shm.window(self.region, self.offset, self.byte_size)
            .map_err(|e| match e {
                ProtocolError::NotFound(message) => {
                    ProtocolError::invalid(format!("{kind} `{name}`: {message}"))
                }
                other => in_tensor(other, kind, name),
            })
    }
}

/// `output` must fit its `window` (each output placed in shared memory is checked
/// before any is written, so that a refused answer writes nothing). Used by the
/// codecs only.
#[cfg(any(feature = "http", feature = "grpc"))]
pub(crate) fn check_fits<W: ShmWindow>(output: &OutputTensor, window: &W) -> Result<()> {
    if output.data.len() > window.len() {
        return Err(ProtocolError::invalid(format!(
            "output `{}` needs {} bytes but its {BYTE_SIZE} is {}",
            output.name,
            output.data.len(),
            window.len()
        )));
    }
    Ok(())
}

/// `e`, its message beginning with the tensor it concerns.
pub(crate) fn in_tensor(e: ProtocolError, kind: &str, name: &str) -> ProtocolError {
    let prefixed = |message: String| format!("{kind} `{name}`: {message}");
    match e {
        ProtocolError::InvalidRequest(m) => ProtocolError::InvalidRequest(prefixed(m)),
        ProtocolError::TooLarge(m) => ProtocolError::TooLarge(prefixed(m)),
        ProtocolError::Exhausted(m) => ProtocolError::Exhausted(prefixed(m)),
        other => other,
    }
}

/// Registered shared-memory regions.
pub trait ShmRegions {
    /// A window of a region, checked against it when it was looked up.
    type Window: ShmWindow;

    /// The window of `byte_size` bytes at `offset` of region `region`. An unknown
    /// region is [`ProtocolError::NotFound`]; the codecs prefix messages with the
    /// tensor they concern.
    fn window(&self, region: &str, offset: usize, byte_size: usize) -> Result<Self::Window>;
}

/// A window of a registered region.
pub trait ShmWindow {
    /// The region's name.
    fn region(&self) -> &str;

    /// The window's length in bytes.
    fn len(&self) -> usize;

    /// Whether the window is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the window's bytes, read now.
    fn read(&self) -> Result<Bytes>;

    /// Writes `data` at the window's start (at most [`ShmWindow::len`] bytes).
    fn write(&self, data: &[u8]) -> Result<()>;
}

/// No shared memory: the registry of a decoder that refuses shared-memory tensors
/// (no value of it exists; pass `None::<&NoSharedMemory>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoSharedMemory {}

impl ShmRegions for NoSharedMemory {
    type Window = NoSharedMemory;

    fn window(&self, _: &str, _: usize, _: usize) -> Result<NoSharedMemory> {
        match *self {}
    }
}

impl ShmWindow for NoSharedMemory {
    fn region(&self) -> &str {
        match *self {}
    }

    fn len(&self) -> usize {
        match *self {}
    }

    fn read(&self) -> Result<Bytes> {
        match *self {}
    }

    fn write(&self, _: &[u8]) -> Result<()> {
        match *self {}
    }
}
