//! Triton's names for kiln's data types: a leaf both the config mapping and the
//! Triton views (`crate::triton`) use, so neither imports the other.

use kiln_worker_sdk::DataType;

/// Triton's `DataType` enum name for `dtype` (`BYTES` is `TYPE_STRING`).
pub fn triton_type(dtype: DataType) -> &'static str {
    match dtype {
        DataType::Bool => "TYPE_BOOL",
        DataType::Uint8 => "TYPE_UINT8",
        DataType::Uint16 => "TYPE_UINT16",
        DataType::Uint32 => "TYPE_UINT32",
        DataType::Uint64 => "TYPE_UINT64",
        DataType::Int8 => "TYPE_INT8",
        DataType::Int16 => "TYPE_INT16",
        DataType::Int32 => "TYPE_INT32",
        DataType::Int64 => "TYPE_INT64",
        DataType::Fp16 => "TYPE_FP16",
        DataType::Bf16 => "TYPE_BF16",
        DataType::Fp32 => "TYPE_FP32",
        DataType::Fp64 => "TYPE_FP64",
        DataType::Bytes => "TYPE_STRING",
    }
}
