//! Moving a batched tensor's batch axis between kiln's layout and the model's.
//!
//! kiln always holds a batched tensor batch first: `[rows, d0, d1, …]`. A model whose
//! batch axis is `k` holds the same tensor as `[d0, …, d(k-1), rows, dk, …]`. Seen as
//! three blocks, kiln's layout is `[rows, outer, inner]` and the model's
//! `[outer, rows, inner]`, where `outer` is the product of the dims before the batch
//! axis and `inner` that of the dims after it: moving the axis swaps the first two.

use kiln_worker_sdk::{DataType, WorkerError};

/// Growable bytes aligned for any fixed-size element (8 bytes), reused from batch to
/// batch: once it has grown to the largest batch, resizing allocates nothing.
#[derive(Default)]
pub struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// Resizes to `len` bytes and returns them (contents unspecified).
    pub fn resize(&mut self, len: usize) -> &mut [u8] {
        self.words.resize(len.div_ceil(8), 0);
        self.len = len;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..len]
    }
}

/// A batched tensor around its batch axis: `outer` elements' worth of blocks before
/// the axis, `rows`, and blocks of `inner_bytes` after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Product of the dims before the batch axis.
    pub outer: usize,
    /// The batch axis's size.
    pub rows: usize,
    /// Bytes of the dims after the batch axis.
    pub inner_bytes: usize,
}

impl Split {
    /// The split of a tensor of `dtype` whose model shape is `shape`, batched on `axis`.
    /// BYTES (elements of no fixed size) cannot be moved.
    pub fn new(
        name: &str,
        dtype: DataType,
        shape: &[i64],
        axis: usize,
    ) -> Result<Split, WorkerError> {
        let element = element_size(name, dtype)?;
        let rows = *shape.get(axis).ok_or_else(|| {
            WorkerError::new(format!(
                "`{name}`: batch axis {axis} is out of range for shape {shape:?}"
            ))
        })?;
        let product = |dims: &[i64]| -> Option<usize> {
            dims.iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
        };
        let overflow = || WorkerError::new(format!("`{name}`: shape {shape:?} is too large"));
        Ok(Split {
            outer: product(&shape[..axis]).ok_or_else(overflow)?,
            rows: usize::try_from(rows).map_err(|_| overflow())?,
            inner_bytes: product(&shape[axis + 1..])
                .and_then(|n| n.checked_mul(element))
                .ok_or_else(overflow)?,
        })
    }

    /// The tensor's size in bytes.
    pub fn len(&self) -> Option<usize> {
        self.outer
            .checked_mul(self.rows)?
            .checked_mul(self.inner_bytes)
    }

    /// kiln's `[rows, outer, inner]` into the model's `[outer, rows, inner]`.
    pub fn kiln_to_model(&self, kiln: &[u8], model: &mut [u8]) -> Result<(), WorkerError> {
        swap_leading(kiln, model, self.rows, self.outer, self.inner_bytes)
    }

    /// The model's `[outer, rows, inner]` into kiln's `[rows, outer, inner]`.
    pub fn model_to_kiln(&self, model: &[u8], kiln: &mut [u8]) -> Result<(), WorkerError> {
        swap_leading(model, kiln, self.outer, self.rows, self.inner_bytes)
    }
}

/// The size of one element of `dtype`; BYTES is refused.
pub fn element_size(name: &str, dtype: DataType) -> Result<usize, WorkerError> {
    dtype.size().ok_or_else(|| {
        WorkerError::new(format!(
            "`{name}` is {dtype}: a batch axis other than the first needs elements of a \
             fixed size"
        ))
    })
}

/// Copies `src`, laid out `[a, b, block]` (`block` in bytes), into `dst` as
/// `[b, a, block]`. Both must hold exactly `a * b * block` bytes.
pub fn swap_leading(
    src: &[u8],
    dst: &mut [u8],
    a: usize,
    b: usize,
    block: usize,
) -> Result<(), WorkerError> {
    let len = a.checked_mul(b).and_then(|n| n.checked_mul(block));
    if len != Some(src.len()) || len != Some(dst.len()) {
        return Err(WorkerError::new(format!(
            "moving a batch axis: {} bytes in and {} out for [{a}, {b}] blocks of {block} bytes",
            src.len(),
            dst.len()
        )));
    }
    if block == 0 {
        return Ok(());
    }
    for (k, from) in src.chunks_exact(block).enumerate() {
        let (i, j) = (k / b, k % b);
        let at = (j * a + i) * block;
        dst[at..at + block].copy_from_slice(from);
    }
    Ok(())
}

/// kiln's dims of a model shape batched on `axis`: the batch axis moved to the front.
pub fn batch_first(shape: &[i64], axis: usize) -> Vec<i64> {
    let mut dims = shape.to_vec();
    if axis < dims.len() {
        let rows = dims.remove(axis);
        dims.insert(0, rows);
    }
    dims
}

/// The model's shape for kiln's non-batch dims `inner` and `rows` on `axis`.
pub fn with_batch_at(inner: &[i64], axis: usize, rows: usize) -> Vec<i64> {
    let mut dims = inner.to_vec();
    dims.insert(axis.min(dims.len()), rows as i64);
    dims
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        bytemuck::cast_slice(values).to_vec()
    }

    #[test]
    fn moves_the_batch_axis_and_back() {
        // kiln: 3 rows of [2, 4] -> the model's [2, 3, 4], as Silero's state.
        let kiln: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let split = Split::new("state", DataType::Fp32, &[2, 3, 4], 1).unwrap();
        assert_eq!(
            split,
            Split {
                outer: 2,
                rows: 3,
                inner_bytes: 16
            }
        );
        let mut model = vec![0u8; split.len().unwrap()];
        split.kiln_to_model(&f32_bytes(&kiln), &mut model).unwrap();
        let moved: Vec<f32> = bytemuck::pod_collect_to_vec(&model);
        // model[o][r][i] = kiln[r][o][i]
        for o in 0..2 {
            for r in 0..3 {
                for i in 0..4 {
                    assert_eq!(moved[(o * 3 + r) * 4 + i], kiln[(r * 2 + o) * 4 + i]);
                }
            }
        }
        let mut back = vec![0u8; model.len()];
        split.model_to_kiln(&model, &mut back).unwrap();
        assert_eq!(back, f32_bytes(&kiln));
    }

    #[test]
    fn last_axis_and_first_axis() {
        // Batch axis last: [2, 3] batched on 1 is a plain transpose.
        let split = Split::new("x", DataType::Int64, &[2, 3], 1).unwrap();
        let kiln: Vec<i64> = vec![10, 20, 11, 21, 12, 22]; // 3 rows of [2]
        let mut model = vec![0u8; 48];
        split
            .kiln_to_model(bytemuck::cast_slice(&kiln), &mut model)
            .unwrap();
        assert_eq!(
            bytemuck::pod_collect_to_vec::<u8, i64>(&model),
            vec![10, 11, 12, 20, 21, 22]
        );
        // Axis 0 is the identity.
        let split = Split::new("x", DataType::Uint8, &[3, 2], 0).unwrap();
        let mut out = [0u8; 6];
        split.kiln_to_model(&[1, 2, 3, 4, 5, 6], &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn refuses_bytes_wrong_sizes_and_axes() {
        let e = Split::new("text", DataType::Bytes, &[2, 3], 1).unwrap_err();
        assert!(e.0.contains("`text` is BYTES"), "{e}");
        assert!(Split::new("x", DataType::Fp32, &[2, 3], 2).is_err());
        let split = Split::new("x", DataType::Fp32, &[2, 3], 1).unwrap();
        assert!(split.kiln_to_model(&[0; 20], &mut [0; 24]).is_err());
        assert!(split.kiln_to_model(&[0; 24], &mut [0; 20]).is_err());
        // Empty tensors move nothing.
        let split = Split::new("x", DataType::Fp32, &[2, 0, 3], 1).unwrap();
        assert!(split.kiln_to_model(&[], &mut []).is_ok());
    }

    #[test]
    fn shapes_between_layouts() {
        assert_eq!(batch_first(&[2, 5, 128], 1), vec![5, 2, 128]);
        assert_eq!(batch_first(&[5, 1], 0), vec![5, 1]);
        assert_eq!(with_batch_at(&[2, 128], 1, 5), vec![2, 5, 128]);
        assert_eq!(with_batch_at(&[2, 128], 2, 5), vec![2, 128, 5]);
        assert_eq!(with_batch_at(&[], 0, 5), vec![5]);
    }

    #[test]
    fn aligned_bytes_reuse() {
        let mut a = AlignedBytes::default();
        a.resize(12).copy_from_slice(&[7; 12]);
        assert_eq!(a.as_slice(), &[7; 12]);
        assert_eq!(a.as_slice().as_ptr() as usize % 8, 0);
        a.resize(4);
        assert_eq!(a.as_slice().len(), 4);
    }
}
