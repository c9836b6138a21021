//! Tensor datatypes, shapes, and the byte layout of tensor data (BYTES elements
//! with their 4-byte length prefixes).

use std::fmt;

/// The most dimensions a tensor may have.
pub const MAX_RANK: usize = 8;

/// A KServe v2 tensor datatype.
#[repr(u8)]
#[cfg_attr(feature = "abi", derive(abi_stable::StableAbi))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
#[cfg_attr(feature = "abi", derive(abi_stable::StableAbi))]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
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
    fn bytes_length_walks_prefixes() {
        let data = encode_bytes(&["ab", "", "xyz"]);
        assert_eq!(&data[..6], &[2, 0, 0, 0, b'a', b'b']);
        assert_eq!(tensor_byte_len(DataType::Bytes, 3, &data), Ok(data.len()));
        assert_eq!(tensor_byte_len(DataType::Bytes, 2, &data), Ok(10));
        assert!(tensor_byte_len(DataType::Bytes, 4, &data).is_err());
        assert!(tensor_byte_len(DataType::Bytes, 3, &data[..data.len() - 1]).is_err());
        assert_eq!(tensor_byte_len(DataType::Fp64, 3, &[]), Ok(24));
    }
}
