//! Constant inputs (`input.<name>` = value): inputs the worker feeds itself on every
//! run, a tensor of the model's static shape filled with one value.

use kiln_worker_sdk::{DataType, Param, Params, WorkerError};

use crate::axes::AlignedBytes;

/// The largest constant input, in bytes.
const MAX_CONSTANT_BYTES: usize = 1 << 30;

/// A constant input, ready to feed.
pub struct Constant {
    /// The model input's name.
    pub name: String,
    /// Its element type.
    pub dtype: DataType,
    /// Its (static) shape; empty for a scalar.
    pub dims: Vec<i64>,
    /// Every element, native (little-endian) bytes.
    pub data: AlignedBytes,
}

impl Constant {
    /// The constant for model input `name` of `dtype` and model dims `dims`, filled with
    /// the value of parameter `param`.
    pub fn new(
        name: &str,
        dtype: DataType,
        dims: &[i64],
        param: &Param,
    ) -> Result<Constant, WorkerError> {
        let key = param.key.as_str();
        let count = element_count(dims).ok_or_else(|| {
            WorkerError::new(format!(
                "`{key}`: the model's `{name}` has shape {dims:?}; a constant input needs a \
                 fixed shape (no dynamic dims)"
            ))
        })?;
        let element =
            element_bytes(dtype, Params(std::slice::from_ref(param)), key).map_err(|e| {
                WorkerError::new(format!("`{key}` (the model's `{name}` is {dtype}): {e}"))
            })?;
        let len = count
            .checked_mul(element.len())
            .filter(|&n| n <= MAX_CONSTANT_BYTES)
            .ok_or_else(|| {
                WorkerError::new(format!(
                    "`{key}`: the model's `{name}` of shape {dims:?} is too large for a \
                     constant input (1 GiB at most)"
                ))
            })?;
        let mut data = AlignedBytes::default();
        let bytes = data.resize(len);
        if !element.is_empty() {
            for chunk in bytes.chunks_exact_mut(element.len()) {
                chunk.copy_from_slice(&element);
            }
        }
        Ok(Constant {
            name: name.to_owned(),
            dtype,
            dims: dims.to_vec(),
            data,
        })
    }
}

/// The number of elements of a static shape; `None` when a dim is dynamic (or the
/// count overflows).
fn element_count(dims: &[i64]) -> Option<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
}

/// One element of `dtype` holding the value of `key`.
fn element_bytes(dtype: DataType, params: Params<'_>, key: &str) -> Result<Vec<u8>, String> {
    let integer = || {
        params
            .int(key)?
            .ok_or_else(|| format!("no value for `{key}`"))
    };
    let float = || {
        params
            .float(key)?
            .ok_or_else(|| format!("no value for `{key}`"))
    };
    Ok(match dtype {
        DataType::Bool => {
            let v = params
                .bool(key)?
                .ok_or_else(|| format!("no value for `{key}`"))?;
            vec![u8::from(v)]
        }
        DataType::Uint8 => int_bytes::<u8>(integer()?)?,
        DataType::Uint16 => int_bytes::<u16>(integer()?)?,
        DataType::Uint32 => int_bytes::<u32>(integer()?)?,
        DataType::Uint64 => int_bytes::<u64>(integer()?)?,
        DataType::Int8 => int_bytes::<i8>(integer()?)?,
        DataType::Int16 => int_bytes::<i16>(integer()?)?,
        DataType::Int32 => int_bytes::<i32>(integer()?)?,
        DataType::Int64 => int_bytes::<i64>(integer()?)?,
        DataType::Fp16 => float_bytes(float()?, half::f16::from_f64, |h| h.is_finite())?,
        DataType::Bf16 => float_bytes(float()?, half::bf16::from_f64, |h| h.is_finite())?,
        DataType::Fp32 => float_bytes(float()?, |v| v as f32, |f| f.is_finite())?,
        DataType::Fp64 => float_bytes(float()?, |v| v, |f| f.is_finite())?,
        DataType::Bytes => return Err("BYTES constant inputs are not supported".to_owned()),
    })
}

/// An integer as an element of `T`, refusing a value out of `T`'s range.
fn int_bytes<T>(value: i64) -> Result<Vec<u8>, String>
where
    T: TryFrom<i64> + bytemuck::Pod,
{
    let v = T::try_from(value)
        .map_err(|_| format!("{value} is out of range for {}", std::any::type_name::<T>()))?;
    Ok(bytemuck::bytes_of(&v).to_vec())
}

/// A number as a float element, refusing a finite value the type cannot hold.
fn float_bytes<T: bytemuck::Pod>(
    value: f64,
    convert: impl Fn(f64) -> T,
    finite: impl Fn(T) -> bool,
) -> Result<Vec<u8>, String> {
    let v = convert(value);
    if value.is_finite() && !finite(v) {
        return Err(format!(
            "{value} is out of range for {}",
            std::any::type_name::<T>()
        ));
    }
    Ok(bytemuck::bytes_of(&v).to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::{params_from_pairs, ParamValue};

    fn param(key: &str, value: ParamValue) -> Param {
        Param {
            key: key.into(),
            value,
        }
    }

    #[test]
    fn scalar_and_filled_tensors() {
        let sr = Constant::new(
            "sr",
            DataType::Int64,
            &[],
            &param("input.sr", ParamValue::Int(16000)),
        )
        .unwrap();
        assert_eq!(sr.data.as_slice(), &16000i64.to_le_bytes());
        let text = params_from_pairs(&[("input.scale", "0.5")]);
        let scale = Constant::new("scale", DataType::Fp32, &[2, 3], &text[0]).unwrap();
        assert_eq!(
            bytemuck::pod_collect_to_vec::<u8, f32>(scale.data.as_slice()),
            vec![0.5; 6]
        );
        let flag = Constant::new(
            "f",
            DataType::Bool,
            &[2],
            &param("input.f", ParamValue::Bool(true)),
        )
        .unwrap();
        assert_eq!(flag.data.as_slice(), &[1, 1]);
        let half = Constant::new(
            "h",
            DataType::Fp16,
            &[1],
            &param("input.h", ParamValue::Int(2)),
        )
        .unwrap();
        assert_eq!(
            half.data.as_slice(),
            &half::f16::from_f32(2.0).to_le_bytes()
        );
    }

    #[test]
    fn refuses_bad_values_and_shapes() {
        let bad = |dtype, dims: &[i64], value| {
            Constant::new("x", dtype, dims, &param("input.x", value))
                .err()
                .map(|e| e.0)
                .unwrap_or_default()
        };
        let e = bad(DataType::Int64, &[], ParamValue::Str("16k".into()));
        assert!(
            e.contains("`input.x`") && e.contains("INT64") && e.contains("16k"),
            "{e}"
        );
        let e = bad(DataType::Int64, &[], ParamValue::Float(1.5));
        assert!(e.contains("integer"), "{e}");
        let e = bad(DataType::Uint8, &[], ParamValue::Int(300));
        assert!(e.contains("out of range"), "{e}");
        let e = bad(DataType::Int32, &[], ParamValue::Int(-1 << 40));
        assert!(e.contains("out of range"), "{e}");
        let e = bad(DataType::Fp16, &[], ParamValue::Float(1e6));
        assert!(e.contains("out of range"), "{e}");
        let e = bad(DataType::Bool, &[], ParamValue::Int(2));
        assert!(e.contains("boolean"), "{e}");
        let e = bad(DataType::Fp32, &[-1, 3], ParamValue::Int(1));
        assert!(e.contains("fixed shape") && e.contains("[-1, 3]"), "{e}");
        let e = bad(DataType::Fp32, &[1 << 20, 1 << 20], ParamValue::Int(1));
        assert!(e.contains("too large"), "{e}");
    }
}
