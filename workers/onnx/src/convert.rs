//! Between kiln tensors (bytes, datatypes) and ONNX Runtime values.

use kiln_worker_sdk::{DataType, WorkerError};
use ort::session::SessionInputValue;
use ort::value::{DynValue, TensorElementType, TensorRef, ValueType};

/// The kiln datatype of an ONNX tensor element type, if kiln has one.
pub fn datatype(ty: TensorElementType) -> Option<DataType> {
    Some(match ty {
        TensorElementType::Bool => DataType::Bool,
        TensorElementType::Uint8 => DataType::Uint8,
        TensorElementType::Uint16 => DataType::Uint16,
        TensorElementType::Uint32 => DataType::Uint32,
        TensorElementType::Uint64 => DataType::Uint64,
        TensorElementType::Int8 => DataType::Int8,
        TensorElementType::Int16 => DataType::Int16,
        TensorElementType::Int32 => DataType::Int32,
        TensorElementType::Int64 => DataType::Int64,
        TensorElementType::Float16 => DataType::Fp16,
        TensorElementType::Bfloat16 => DataType::Bf16,
        TensorElementType::Float32 => DataType::Fp32,
        TensorElementType::Float64 => DataType::Fp64,
        _ => return None,
    })
}

/// The element type and dims (-1: dynamic) of a tensor value type.
pub fn tensor_type(name: &str, value: &ValueType) -> Result<(DataType, Vec<i64>), WorkerError> {
    match value {
        ValueType::Tensor { ty, shape, .. } => {
            let dtype = datatype(*ty).ok_or_else(|| {
                WorkerError::new(format!(
                    "`{name}` has element type {ty:?}, which kiln does not serve"
                ))
            })?;
            Ok((dtype, shape.iter().copied().collect()))
        }
        other => Err(WorkerError::new(format!(
            "`{name}` is {other:?}; kiln serves tensors only"
        ))),
    }
}

fn view<'a, T>(shape: &[i64], bytes: &'a [u8]) -> Result<SessionInputValue<'a>, WorkerError>
where
    T: ort::value::PrimitiveTensorElementType + bytemuck::Pod + std::fmt::Debug,
{
    let data: &'a [T] = bytemuck::try_cast_slice(bytes).map_err(|e| {
        WorkerError::new(format!("input data as {}: {e}", std::any::type_name::<T>()))
    })?;
    let tensor = TensorRef::from_array_view((shape.to_vec(), data))
        .map_err(|e| WorkerError::new(e.to_string()))?;
    Ok(tensor.into())
}

/// A borrowed ONNX tensor over kiln's batch memory: no copy.
pub fn input_value<'a>(
    dtype: DataType,
    shape: &[i64],
    bytes: &'a [u8],
) -> Result<SessionInputValue<'a>, WorkerError> {
    match dtype {
        DataType::Bool => {
            // ONNX booleans are one byte each, 0 or 1: the same bytes as kiln's BOOL.
            let data: &'a [bool] = bytes_as_bools(bytes)?;
            TensorRef::from_array_view((shape.to_vec(), data))
                .map(Into::into)
                .map_err(|e| WorkerError::new(e.to_string()))
        }
        DataType::Uint8 => view::<u8>(shape, bytes),
        DataType::Uint16 => view::<u16>(shape, bytes),
        DataType::Uint32 => view::<u32>(shape, bytes),
        DataType::Uint64 => view::<u64>(shape, bytes),
        DataType::Int8 => view::<i8>(shape, bytes),
        DataType::Int16 => view::<i16>(shape, bytes),
        DataType::Int32 => view::<i32>(shape, bytes),
        DataType::Int64 => view::<i64>(shape, bytes),
        DataType::Fp16 => view::<half::f16>(shape, bytes),
        DataType::Bf16 => view::<half::bf16>(shape, bytes),
        DataType::Fp32 => view::<f32>(shape, bytes),
        DataType::Fp64 => view::<f64>(shape, bytes),
        DataType::Bytes => Err(WorkerError::new(
            "BYTES inputs are not supported by the onnx worker",
        )),
    }
}

fn bytes_as_bools(bytes: &[u8]) -> Result<&[bool], WorkerError> {
    if bytes.iter().any(|&b| b > 1) {
        return Err(WorkerError::new(
            "BOOL input holds a byte other than 0 or 1",
        ));
    }
    // SAFETY: every byte is 0 or 1, the valid bit patterns of `bool`, which has the
    // size and alignment of `u8`.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<bool>(), bytes.len()) })
}

fn extract<T>(value: &DynValue) -> Result<(Vec<i64>, &[u8]), WorkerError>
where
    T: ort::value::PrimitiveTensorElementType + bytemuck::Pod + std::fmt::Debug,
{
    let (shape, data) = value
        .try_extract_tensor::<T>()
        .map_err(|e| WorkerError::new(e.to_string()))?;
    Ok((shape.iter().copied().collect(), bytemuck::cast_slice(data)))
}

/// An output's shape and raw little-endian bytes.
pub fn output_bytes(dtype: DataType, value: &DynValue) -> Result<(Vec<i64>, &[u8]), WorkerError> {
    match dtype {
        DataType::Bool => {
            let (shape, data) = value
                .try_extract_tensor::<bool>()
                .map_err(|e| WorkerError::new(e.to_string()))?;
            // SAFETY: `bool` is one byte, 0 or 1.
            let bytes =
                unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), data.len()) };
            Ok((shape.iter().copied().collect(), bytes))
        }
        DataType::Uint8 => extract::<u8>(value),
        DataType::Uint16 => extract::<u16>(value),
        DataType::Uint32 => extract::<u32>(value),
        DataType::Uint64 => extract::<u64>(value),
        DataType::Int8 => extract::<i8>(value),
        DataType::Int16 => extract::<i16>(value),
        DataType::Int32 => extract::<i32>(value),
        DataType::Int64 => extract::<i64>(value),
        DataType::Fp16 => extract::<half::f16>(value),
        DataType::Bf16 => extract::<half::bf16>(value),
        DataType::Fp32 => extract::<f32>(value),
        DataType::Fp64 => extract::<f64>(value),
        DataType::Bytes => Err(WorkerError::new(
            "BYTES outputs are not supported by the onnx worker",
        )),
    }
}
