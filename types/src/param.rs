//! Load-time and request parameters: a key and a typed value. (Reading them with
//! coercion is the SDK's `Params`.)

use std::fmt;

use crate::Text;

/// The value of a load-time or request parameter.
#[repr(C, u8)]
#[cfg_attr(feature = "abi", derive(abi_stable::StableAbi))]
#[derive(Debug, Clone, PartialEq)]
pub enum ParamValue {
    Bool(bool),
    /// Every integer that fits in an `i64`.
    Int(i64),
    Float(f64),
    Str(Text),
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
#[cfg_attr(feature = "abi", derive(abi_stable::StableAbi))]
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub key: Text,
    pub value: ParamValue,
}
