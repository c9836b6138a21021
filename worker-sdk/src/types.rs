//! Tensor specifications, worker information and the parameters' typed view: the
//! vocabulary of the plugin contract. Every type here is `#[repr(C)]` + `StableAbi`.
//! Datatypes, shapes and parameters themselves are kiln-types' (re-exported here),
//! shared with the protocol and clients, which have no plugin ABI.

use abi_stable::std_types::{RString, RVec};
use abi_stable::StableAbi;

pub use kiln_types::{encode_bytes, tensor_byte_len, DataType, Param, ParamValue, Shape, MAX_RANK};

use crate::coerce::{self, CoerceError};

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
    fn spec_accepts_dynamic_dims() {
        let spec = TensorSpec::new("x", DataType::Fp32, &[-1, 3]);
        assert!(spec.accepts(&[10, 3]));
        assert!(!spec.accepts(&[10, 4]));
        assert!(!spec.accepts(&[3]));
    }
}
