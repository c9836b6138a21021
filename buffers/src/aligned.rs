//! 64-byte aligned, growable CPU memory.

use kiln_worker_sdk::reexports::{RResult, RString};
use kiln_worker_sdk::OutputBuffer;

/// Alignment of every [`AlignedBuf`], enough for any tensor element and for SIMD.
pub const ALIGN: usize = 64;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Block([u8; ALIGN]);

// SAFETY: `Block` is 64 bytes with alignment 64: no padding, any bit pattern valid.
unsafe impl bytemuck::Zeroable for Block {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for Block {}

/// Growable bytes aligned to [`ALIGN`]. Shrinking keeps the memory, so a pooled
/// buffer stops allocating once it has seen its largest batch.
#[derive(Default, Clone)]
pub struct AlignedBuf {
    blocks: Vec<Block>,
    len: usize,
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl AlignedBuf {
    /// An empty buffer with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> AlignedBuf {
        AlignedBuf {
            blocks: vec![Block([0; ALIGN]); capacity.div_ceil(ALIGN)],
            len: 0,
        }
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes available without growing.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * ALIGN
    }

    /// The bytes in use.
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.blocks)[..self.len]
    }

    /// The bytes in use, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.blocks)[..self.len]
    }

    /// Sets the length to zero, keeping the memory.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Sets the length, growing the memory when needed. New bytes are unspecified
    /// (zero or stale); callers overwrite them.
    pub fn resize(&mut self, len: usize) -> &mut [u8] {
        let blocks = len.div_ceil(ALIGN);
        if blocks > self.blocks.len() {
            self.blocks.resize(blocks, Block([0; ALIGN]));
        }
        self.len = len;
        self.as_mut_slice()
    }

    /// Like [`AlignedBuf::resize`], but an error instead of a panic or an abort when
    /// the memory cannot be had (a plugin's output size is not trusted).
    pub fn try_resize(&mut self, len: usize) -> Result<&mut [u8], String> {
        let blocks = len.div_ceil(ALIGN);
        if blocks > self.blocks.len() {
            self.blocks
                .try_reserve_exact(blocks - self.blocks.len())
                .map_err(|e| format!("cannot allocate {len} bytes: {e}"))?;
            self.blocks.resize(blocks, Block([0; ALIGN]));
        }
        self.len = len;
        Ok(self.as_mut_slice())
    }

    /// Appends `bytes`.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        let start = self.len;
        self.resize(start + bytes.len())[start..].copy_from_slice(bytes);
    }
}

/// Runs inside the plugin's call into the host (an `extern "C"` shim that aborts on
/// a panic), so it never panics nor aborts: an impossible size is an error.
impl OutputBuffer for AlignedBuf {
    fn resize(
        &mut self,
        len: usize,
    ) -> RResult<kiln_worker_sdk::reexports::RSliceMut<'_, u8>, RString> {
        match self.try_resize(len) {
            Ok(buf) => RResult::ROk(buf.into()),
            Err(e) => RResult::RErr(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_growing() {
        let mut b = AlignedBuf::with_capacity(10);
        assert_eq!(b.capacity(), 64);
        b.extend_from_slice(&[1, 2, 3]);
        b.extend_from_slice(&[7; 100]);
        assert_eq!(b.len(), 103);
        assert_eq!(&b.as_slice()[..4], &[1, 2, 3, 7]);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        let cap = b.capacity();
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.capacity(), cap);
    }

    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        let mut b = AlignedBuf::with_capacity(64);
        b.extend_from_slice(&[9; 10]);
        for len in [usize::MAX, usize::MAX / 2, isize::MAX as usize] {
            assert!(b.try_resize(len).is_err(), "{len}");
            let through_the_trait = OutputBuffer::resize(&mut b, len);
            assert!(through_the_trait.is_err(), "{len}");
        }
        // The buffer is unharmed and still usable.
        assert_eq!(b.try_resize(100).unwrap().len(), 100);
        assert_eq!(b.as_slice()[..10], [9; 10]);
    }
}
