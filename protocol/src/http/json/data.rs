//! Tensor data as KServe v2 JSON arrays, both ways: a (nested or flat) array of
//! values parsed straight into little-endian bytes of the tensor's datatype, and
//! bytes written back as a flat array ([`DataJson`]).

use std::fmt;

use bytes::Bytes;
use half::{bf16, f16};
use kiln_types::DataType;
use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;

pub(super) fn decode_data(
    dtype: DataType,
    elements: usize,
    raw: &RawValue,
) -> Result<Bytes, String> {
    let mut out = Vec::with_capacity(reserve(dtype, elements, raw.get().len()));
    let mut count = 0usize;
    let mut de = serde_json::Deserializer::from_str(raw.get());
    Flat {
        dtype,
        out: &mut out,
        count: &mut count,
        limit: elements,
    }
    .deserialize(&mut de)
    .map_err(|e| e.to_string())?;
    if count != elements {
        return Err(format!(
            "the shape holds {elements} elements but data has {count}"
        ));
    }
    Ok(Bytes::from(out))
}

/// The bytes to reserve for `elements` values of `dtype` written as `json_len` bytes
/// of JSON: what the shape declares, but never more than that JSON can hold (the
/// shape is not yet checked against the model, and `[16777216]` with three values
/// must not reserve 16 MiB). Each value takes at least one character and a
/// separator; BYTES values, of unknown size, get the JSON's length and grow.
pub(super) fn reserve(dtype: DataType, elements: usize, json_len: usize) -> usize {
    match dtype.size() {
        Some(size) => size.saturating_mul(elements.min(json_len / 2 + 1)),
        None => json_len,
    }
}

/// Flattens nested JSON arrays of scalars into little-endian bytes of `dtype`.
struct Flat<'o> {
    dtype: DataType,
    out: &'o mut Vec<u8>,
    count: &'o mut usize,
    limit: usize,
}

impl Flat<'_> {
    fn reborrow(&mut self) -> Flat<'_> {
        Flat {
            dtype: self.dtype,
            out: self.out,
            count: self.count,
            limit: self.limit,
        }
    }

    fn element<E: de::Error>(&mut self) -> Result<(), E> {
        *self.count += 1;
        if *self.count > self.limit {
            return Err(E::custom(format!(
                "data has more elements than the shape's {}",
                self.limit
            )));
        }
        Ok(())
    }

    fn int<E: de::Error>(&mut self, v: i128) -> Result<(), E> {
        self.element()?;
        let range = || E::custom(format!("{v} is out of range for {}", self.dtype));
        let out = &mut *self.out;
        match self.dtype {
            DataType::Uint8 => out.push(u8::try_from(v).map_err(|_| range())?),
            DataType::Uint16 => out.extend(u16::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Uint32 => out.extend(u32::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Uint64 => out.extend(u64::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Int8 => out.extend(i8::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Int16 => out.extend(i16::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Int32 => out.extend(i32::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Int64 => out.extend(i64::try_from(v).map_err(|_| range())?.to_le_bytes()),
            DataType::Fp16 | DataType::Bf16 | DataType::Fp32 | DataType::Fp64 => {
                return self.float_value(v as f64)
            }
            DataType::Bool => match v {
                0 | 1 => out.push(v as u8),
                _ => return Err(E::custom(format!("{v} is not a boolean"))),
            },
            DataType::Bytes => return Err(E::custom("expected a string, got a number")),
        }
        Ok(())
    }

    fn float_value<E: de::Error>(&mut self, v: f64) -> Result<(), E> {
        let out = &mut *self.out;
        match self.dtype {
            DataType::Fp16 => out.extend(f16::from_f64(v).to_le_bytes()),
            DataType::Bf16 => out.extend(bf16::from_f64(v).to_le_bytes()),
            DataType::Fp32 => out.extend((v as f32).to_le_bytes()),
            DataType::Fp64 => out.extend(v.to_le_bytes()),
            other => {
                return Err(E::custom(format!(
                    "expected an integer for {other}, got {v}"
                )))
            }
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Flat<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Flat<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an array of {} values", self.dtype)
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self.reborrow())?.is_some() {}
        Ok(())
    }

    fn visit_u64<E: de::Error>(mut self, v: u64) -> Result<(), E> {
        self.int(i128::from(v))
    }

    fn visit_i64<E: de::Error>(mut self, v: i64) -> Result<(), E> {
        self.int(i128::from(v))
    }

    fn visit_f64<E: de::Error>(mut self, v: f64) -> Result<(), E> {
        self.element()?;
        self.float_value(v)
    }

    fn visit_bool<E: de::Error>(mut self, v: bool) -> Result<(), E> {
        if self.dtype != DataType::Bool {
            return Err(E::custom(format!(
                "expected {} values, got a boolean",
                self.dtype
            )));
        }
        self.element()?;
        self.out.push(u8::from(v));
        Ok(())
    }

    fn visit_str<E: de::Error>(mut self, v: &str) -> Result<(), E> {
        if self.dtype != DataType::Bytes {
            return Err(E::custom(format!(
                "expected {} values, got a string",
                self.dtype
            )));
        }
        self.element()?;
        let len = u32::try_from(v.len()).map_err(|_| E::custom("string longer than 4 GiB"))?;
        self.out.extend(len.to_le_bytes());
        self.out.extend_from_slice(v.as_bytes());
        Ok(())
    }
}

/// Tensor bytes written as a flat JSON array of their datatype's values (KServe's
/// `data`; the WebSocket stream's results use it too).
pub struct DataJson<'a> {
    pub dtype: DataType,
    pub bytes: &'a [u8],
}

macro_rules! seq_of {
    ($seq:ident, $bytes:expr, $t:ty, $n:literal, $map:expr) => {
        for chunk in $bytes.chunks_exact($n) {
            let mut word = [0u8; $n];
            word.copy_from_slice(chunk);
            $seq.serialize_element(&$map(<$t>::from_le_bytes(word)))?;
        }
    };
}

impl Serialize for DataJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.bytes;
        let mut seq = s.serialize_seq(None)?;
        match self.dtype {
            DataType::Bool => seq_of!(seq, b, u8, 1, |v: u8| v != 0),
            DataType::Uint8 => seq_of!(seq, b, u8, 1, |v| v),
            DataType::Uint16 => seq_of!(seq, b, u16, 2, |v| v),
            DataType::Uint32 => seq_of!(seq, b, u32, 4, |v| v),
            DataType::Uint64 => seq_of!(seq, b, u64, 8, |v| v),
            DataType::Int8 => seq_of!(seq, b, i8, 1, |v| v),
            DataType::Int16 => seq_of!(seq, b, i16, 2, |v| v),
            DataType::Int32 => seq_of!(seq, b, i32, 4, |v| v),
            DataType::Int64 => seq_of!(seq, b, i64, 8, |v| v),
            DataType::Fp16 => seq_of!(seq, b, u16, 2, |v| f16::from_bits(v).to_f32()),
            DataType::Bf16 => seq_of!(seq, b, u16, 2, |v| bf16::from_bits(v).to_f32()),
            DataType::Fp32 => seq_of!(seq, b, f32, 4, |v| v),
            DataType::Fp64 => seq_of!(seq, b, f64, 8, |v| v),
            DataType::Bytes => {
                let mut rest = b;
                while let Some((len, tail)) = rest.split_first_chunk::<4>() {
                    let len = (u32::from_le_bytes(*len) as usize).min(tail.len());
                    let (item, tail) = tail.split_at(len);
                    seq.serialize_element(&String::from_utf8_lossy(item))?;
                    rest = tail;
                }
            }
        }
        seq.end()
    }
}
