//! Data types, shapes, tensor specifications and load-time parameters: the vocabulary
//! shared by the server and its plugins. Every type here is `#[repr(C)]` + `StableAbi`.

use std::fmt;

use abi_stable::std_types::{RString, RVec};
use abi_stable::StableAbi;

use crate::coerce::{self, CoerceError};

/// The most dimensions a tensor may have.
pub const MAX_RANK: usize = 8;

/// A KServe v2 tensor datatype.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Bf16,
    Fp32,
    Fp64,
    /// Variable-length byte strings, serialized as a 4-byte little-endian length
    /// followed by the bytes, element after element (Triton's binary form).
    Bytes,
}

impl DataType {
    /// Every datatype, in declaration order.
    pub const ALL: [DataType; 14] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Bf16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
    ];

    /// Size of one element in bytes; `None` for `BYTES`.
    pub const fn size(self) -> Option<usize> {
        match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => Some(1),
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 | DataType::Bf16 => Some(2),
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => Some(4),
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => Some(8),
            DataType::Bytes => None,
        }
    }

    /// The protocol name (`"FP32"`, `"UINT8"`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Bf16 => "BF16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
        }
    }

    /// Parses a protocol name; case-sensitive, as the protocol is.
    pub fn parse(name: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.as_str() == name)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tensor shape of at most [`MAX_RANK`] dimensions, stored inline (no allocation).
#[repr(C)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    rank: u32,
    dims: [i64; MAX_RANK],
}

impl Shape {
    /// A shape from its dimensions; `None` when there are more than [`MAX_RANK`].
    pub fn new(dims: &[i64]) -> Option<Shape> {
        if dims.len() > MAX_RANK {
            return None;
        }
        let mut shape = Shape {
            rank: dims.len() as u32,
            dims: [0; MAX_RANK],
        };
        shape.dims[..dims.len()].copy_from_slice(dims);
        Some(shape)
    }

    /// The shape of a scalar (rank 0).
    pub const fn scalar() -> Shape {
        Shape {
            rank: 0,
            dims: [0; MAX_RANK],
        }
    }

    /// The dimensions.
    pub fn dims(&self) -> &[i64] {
        &self.dims[..self.rank as usize]
    }

    /// Number of elements (product of the dimensions; 1 for a scalar). Negative
    /// dimensions count as zero.
    pub fn element_count(&self) -> usize {
        self.dims()
            .iter()
            .fold(1usize, |acc, &d| acc.saturating_mul(d.max(0) as usize))
    }

    /// The first dimension (the batch dimension of a batched tensor), or 1 for a scalar.
    pub fn rows(&self) -> usize {
        self.dims().first().map_or(1, |&d| d.max(0) as usize)
    }

    /// The shape without its first dimension.
    pub fn inner(&self) -> Shape {
        let dims = self.dims();
        Shape::new(dims.get(1..).unwrap_or(&[])).unwrap_or(Shape::scalar())
    }

    /// This shape with `rows` prepended as a new first dimension.
    pub fn with_batch(&self, rows: usize) -> Option<Shape> {
        let mut dims = [0i64; MAX_RANK + 1];
        dims[0] = rows as i64;
        dims[1..=self.dims().len()].copy_from_slice(self.dims());
        Shape::new(&dims[..=self.dims().len()])
    }

    /// This shape with its first dimension replaced by `rows`.
    pub fn with_rows(&self, rows: usize) -> Shape {
        let mut shape = *self;
        if shape.rank > 0 {
            shape.dims[0] = rows as i64;
        }
        shape
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.dims()).finish()
    }
}

/// Declares one input or output of a worker. `dims` excludes the batch dimension when
/// the worker batches (`max_batch_size > 0`), as in Triton; `-1` marks a dynamic dim.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: RString,
    pub dtype: DataType,
    pub dims: RVec<i64>,
}

impl TensorSpec {
    /// A tensor spec.
    pub fn new(name: &str, dtype: DataType, dims: &[i64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            dims: dims.to_vec().into(),
        }
    }

    /// Whether `dims` (without the batch dimension) fits this spec.
    pub fn accepts(&self, dims: &[i64]) -> bool {
        dims.len() == self.dims.len()
            && dims
                .iter()
                .zip(self.dims.iter())
                .all(|(&got, &want)| want < 0 || got == want)
    }
}

/// The batching policy a worker prefers; a load-time parameter may override it.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatcherKind {
    /// Exactly `batch_size` rows per batch.
    Hard,
    /// Up to `batch_size` rows, or whatever arrived when the timeout expires.
    Soft,
    /// Triton's dynamic batcher: preferred sizes, queue delay, priorities, queue policy.
    Dynamic,
    /// Triton's sequence batcher, for stateful models: requests carry a sequence id,
    /// each sequence is pinned to one instance and runs in order.
    Sequence,
}

impl BatcherKind {
    /// The name used in parameters (`hard`, `soft`, `dynamic`, `sequence`).
    pub const fn as_str(self) -> &'static str {
        match self {
            BatcherKind::Hard => "hard",
            BatcherKind::Soft => "soft",
            BatcherKind::Dynamic => "dynamic",
            BatcherKind::Sequence => "sequence",
        }
    }
}

/// What a worker says about itself after `init`.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct WorkerInfo {
    pub inputs: RVec<TensorSpec>,
    pub outputs: RVec<TensorSpec>,
    /// Largest batch (in rows) the worker accepts; 0 means it does not batch and
    /// requests carry no batch dimension.
    pub max_batch_size: u32,
    /// The batcher the worker prefers.
    pub batcher: BatcherKind,
    /// Whether requests whose non-batch dimensions differ may share one batch
    /// (elementwise workers can; most models cannot).
    pub allow_ragged_batch: bool,
}

/// The value of a load-time or request parameter.
#[repr(C, u8)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub enum ParamValue {
    Bool(bool),
    /// Every integer that fits in an `i64`.
    Int(i64),
    Float(f64),
    Str(RString),
    /// An unsigned integer above `i64::MAX` (a protocol's uint64 value, such as a
    /// 64-bit `sequence_id`); smaller ones are always `Int`, so each integer has
    /// one form. Build one with [`ParamValue::from_u64`].
    Uint(u64),
}

impl ParamValue {
    /// `v` as `Int` when it fits, else as `Uint`.
    pub fn from_u64(v: u64) -> ParamValue {
        i64::try_from(v).map_or(ParamValue::Uint(v), ParamValue::Int)
    }
}

impl fmt::Display for ParamValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamValue::Bool(v) => write!(f, "{v}"),
            ParamValue::Int(v) => write!(f, "{v}"),
            ParamValue::Float(v) => write!(f, "{v}"),
            ParamValue::Str(v) => f.write_str(v),
            ParamValue::Uint(v) => write!(f, "{v}"),
        }
    }
}

/// One named parameter.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct Param {
    pub key: RString,
    pub value: ParamValue,
}

/// A read-only view of parameters with typed, coercing getters (a CLI gives strings).
#[derive(Debug, Clone, Copy)]
pub struct Params<'a>(pub &'a [Param]);

impl<'a> Params<'a> {
    /// The raw value of `key`, matched case-insensitively.
    pub fn get(&self, key: &str) -> Option<&'a ParamValue> {
        self.0
            .iter()
            .find(|p| p.key.as_str().eq_ignore_ascii_case(key))
            .map(|p| &p.value)
    }

    /// `key` as an integer: an `Int`, or a `Str` that parses as one
    /// ([`coerce::int`]).
    pub fn int(&self, key: &str) -> Result<Option<i64>, String> {
        self.coerced(key, coerce::int)
    }

    /// `key` as a boolean: a `Bool`, an `Int` 0/1, or `true`/`false`/`1`/`0` text
    /// ([`coerce::bool`]).
    pub fn bool(&self, key: &str) -> Result<Option<bool>, String> {
        self.coerced(key, coerce::bool)
    }

    /// `key` as a float: any number, or text that parses as one ([`coerce::float`]).
    pub fn float(&self, key: &str) -> Result<Option<f64>, String> {
        self.coerced(key, coerce::float)
    }

    fn coerced<T>(
        &self,
        key: &str,
        coerce: fn(&str, &ParamValue) -> Result<T, CoerceError>,
    ) -> Result<Option<T>, String> {
        self.get(key)
            .map(|v| coerce(key, v).map_err(|e| e.to_string()))
            .transpose()
    }

    /// `key` as text (any value is rendered).
    pub fn string(&self, key: &str) -> Option<String> {
        self.get(key).map(|v| v.to_string())
    }
}

/// Bytes taken by `elements` elements of `dtype` at the start of `data`. For BYTES this
/// walks the 4-byte length prefixes; an error says where the data falls short.
pub fn tensor_byte_len(dtype: DataType, elements: usize, data: &[u8]) -> Result<usize, String> {
    if let Some(size) = dtype.size() {
        return elements
            .checked_mul(size)
            .ok_or_else(|| "tensor size overflows".to_owned());
    }
    let mut offset = 0usize;
    for i in 0..elements {
        let prefix = data
            .get(offset..offset + 4)
            .ok_or_else(|| format!("BYTES element {i} has no length prefix"))?;
        let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
        offset += 4;
        if data.len() - offset < len {
            return Err(format!("BYTES element {i} is cut short"));
        }
        offset += len;
    }
    Ok(offset)
}

/// Serializes byte strings as a BYTES tensor's data: each element a 4-byte
/// little-endian length followed by its bytes. Elements longer than 4 GiB are cut.
pub fn encode_bytes<T: AsRef<[u8]>>(elements: &[T]) -> Vec<u8> {
    let total: usize = elements.iter().map(|e| 4 + e.as_ref().len()).sum();
    let mut out = Vec::with_capacity(total);
    for element in elements {
        let bytes = element.as_ref();
        let len = bytes.len().min(u32::MAX as usize);
        out.extend_from_slice(&(len as u32).to_le_bytes());
        out.extend_from_slice(&bytes[..len]);
    }
    out
}

/// Builds a parameter list from `(key, value)` text pairs.
pub fn params_from_pairs(pairs: &[(&str, &str)]) -> Vec<Param> {
    pairs
        .iter()
        .map(|(k, v)| Param {
            key: (*k).into(),
            value: ParamValue::Str((*v).into()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datatype_names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(DataType::parse(d.as_str()), Some(d));
        }
        assert_eq!(DataType::parse("fp32"), None);
        assert_eq!(DataType::Fp16.size(), Some(2));
        assert_eq!(DataType::Bytes.size(), None);
    }

    #[test]
    fn shape_helpers() {
        let s = Shape::new(&[3, 4, 5]).unwrap();
        assert_eq!(s.element_count(), 60);
        assert_eq!(s.rows(), 3);
        assert_eq!(s.inner().dims(), &[4, 5]);
        assert_eq!(s.inner().with_batch(7).unwrap().dims(), &[7, 4, 5]);
        assert_eq!(s.with_rows(2).dims(), &[2, 4, 5]);
        assert!(Shape::new(&[1; MAX_RANK + 1]).is_none());
        assert_eq!(Shape::scalar().element_count(), 1);
    }

    #[test]
    fn params_coerce() {
        let p = params_from_pairs(&[("Batch_Size", "8"), ("share", "false"), ("x", "1.5")]);
        let p = Params(&p);
        assert_eq!(p.int("batch_size").unwrap(), Some(8));
        assert_eq!(p.bool("share").unwrap(), Some(false));
        assert_eq!(p.float("x").unwrap(), Some(1.5));
        assert!(p.int("x").is_err());
        assert_eq!(p.int("missing").unwrap(), None);
    }

    #[test]
    fn bytes_length_walks_prefixes() {
        let data = encode_bytes(&["ab", "", "xyz"]);
        assert_eq!(&data[..6], &[2, 0, 0, 0, b'a', b'b']);
        assert_eq!(tensor_byte_len(DataType::Bytes, 3, &data), Ok(data.len()));
        assert_eq!(tensor_byte_len(DataType::Bytes, 2, &data), Ok(10));
        assert!(tensor_byte_len(DataType::Bytes, 4, &data).is_err());
        assert!(tensor_byte_len(DataType::Bytes, 3, &data[..data.len() - 1]).is_err());
        assert_eq!(tensor_byte_len(DataType::Fp64, 3, &[]), Ok(24));
    }

    #[test]
    fn spec_accepts_dynamic_dims() {
        let spec = TensorSpec::new("x", DataType::Fp32, &[-1, 3]);
        assert!(spec.accepts(&[10, 3]));
        assert!(!spec.accepts(&[10, 4]));
        assert!(!spec.accepts(&[3]));
    }
}
