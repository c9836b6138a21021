//! Protocol-free inference requests and responses: what every codec decodes into
//! and encodes from. (Their validation against a worker is the server's.)

use bytes::Bytes;
use kiln_types::{DataType, Param};

/// One input tensor as a client sent it. `data` is row-major, little-endian; BYTES
/// elements carry 4-byte length prefixes.
#[derive(Debug, Clone, PartialEq)]
pub struct InputTensor {
    pub name: String,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    pub data: Bytes,
}

impl InputTensor {
    /// An input from typed elements.
    pub fn from_slice<T: bytemuck::Pod>(
        name: &str,
        dtype: DataType,
        shape: &[i64],
        data: &[T],
    ) -> Self {
        InputTensor {
            name: name.to_owned(),
            dtype,
            shape: shape.to_vec(),
            data: Bytes::copy_from_slice(bytemuck::cast_slice(data)),
        }
    }
}

/// An inference request for one model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InferRequest {
    pub model: String,
    /// Echoed back in the response.
    pub id: Option<String>,
    pub inputs: Vec<InputTensor>,
    /// Outputs to return; all when `None`.
    pub outputs: Option<Vec<String>>,
    /// Request parameters, handed to the worker.
    pub parameters: Vec<Param>,
}

/// One output tensor of a response.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputTensor {
    pub name: String,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    pub data: Bytes,
}

impl OutputTensor {
    /// The data as elements of `T` (copied, so alignment does not matter).
    pub fn values<T: bytemuck::Pod>(&self) -> Vec<T> {
        bytemuck::pod_collect_to_vec(&self.data)
    }
}

/// The answer to an [`InferRequest`].
#[derive(Debug, Clone, PartialEq)]
pub struct InferResponse {
    pub model_name: String,
    pub model_version: String,
    pub id: Option<String>,
    pub outputs: Vec<OutputTensor>,
}
