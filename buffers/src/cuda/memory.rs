//! Pinned host and device allocations, paired as staging buffers, and the buffer
//! set of one chunk of work in flight on a stream.

use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CU_MEMHOSTALLOC_WRITECOMBINED};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream};

use super::CudaError;
use crate::pool::Pool;

/// Staging buffers grow in steps of this many bytes (fewer reallocations as
/// requests vary in size; the driver's own granularity is 2 MiB for device memory).
const GROWTH: usize = 64 * 1024;

/// Page-locked host memory (`cuMemHostAlloc`): copies from and to it run
/// asynchronously on a stream, at the bus's full speed.
pub struct PinnedBuf {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation is owned by this value alone; the driver allows using and
// freeing it from any thread with the context bound.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    /// `len` bytes (at least 1); `write_combined` for memory the CPU only writes
    /// (faster across the bus, very slow for the CPU to read).
    pub fn new(
        ctx: &Arc<CudaContext>,
        len: usize,
        write_combined: bool,
    ) -> Result<Self, CudaError> {
        let len = len.max(1);
        if len > isize::MAX as usize {
            return Err(CudaError::Size(format!("{len} bytes of pinned memory")));
        }
        ctx.bind_to_thread()?;
        let flags = if write_combined {
            CU_MEMHOSTALLOC_WRITECOMBINED
        } else {
            0
        };
        // SAFETY: a fresh allocation of `len` bytes, freed in `drop`.
        let ptr = unsafe { result::malloc_host(len, flags) }?.cast::<u8>();
        Ok(PinnedBuf {
            ctx: Arc::clone(ctx),
            ptr,
            len,
        })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a pinned buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes. The caller makes sure no copy on a stream is using them (the
    /// buffer set's event).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable; same condition as [`PinnedBuf::as_slice`].
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes it exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_host`, freed once.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// Device memory (`cuMemAlloc`).
pub struct DeviceBuf {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    len: usize,
}

impl DeviceBuf {
    /// `len` bytes (at least 1) on the context's device, uninitialised.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        let len = len.max(1);
        ctx.bind_to_thread()?;
        // SAFETY: a fresh allocation, freed in `drop`.
        let ptr = unsafe { result::malloc_sync(len) }?;
        Ok(DeviceBuf {
            ctx: Arc::clone(ctx),
            ptr,
            len,
        })
    }

    /// The device address, for kernel arguments and copies.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a device buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_sync`, freed once, after the set's event
            // (nothing is in flight when a set is dropped: see `CudaBufferSet`).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Which way a staging buffer's data goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagingKind {
    /// Host → device (write-combined pinned memory).
    Upload,
    /// Device → host (cached pinned memory, read by the CPU).
    Download,
}

/// A pinned host buffer and a device buffer of the same size.
pub struct Staging {
    pub host: PinnedBuf,
    pub device: DeviceBuf,
    kind: StagingKind,
}

impl Staging {
    /// Staging of `capacity` bytes.
    pub fn new(
        ctx: &Arc<CudaContext>,
        capacity: usize,
        kind: StagingKind,
    ) -> Result<Staging, CudaError> {
        let capacity = round_up(capacity)?;
        Ok(Staging {
            host: PinnedBuf::new(ctx, capacity, kind == StagingKind::Upload)?,
            device: DeviceBuf::new(ctx, capacity)?,
            kind,
        })
    }

    /// Bytes either side holds.
    pub fn capacity(&self) -> usize {
        self.device.len()
    }

    /// Grows both sides to hold `len` bytes (contents are lost); nothing is done
    /// when they already do. Call only while the set is idle.
    pub fn reserve(&mut self, ctx: &Arc<CudaContext>, len: usize) -> Result<(), CudaError> {
        if len > self.capacity() {
            *self = Staging::new(ctx, len, self.kind)?;
        }
        Ok(())
    }

    /// Enqueues the copy of the first `len` host bytes to the device on `stream`.
    pub fn upload(&self, stream: &CudaStream, len: usize) -> Result<(), CudaError> {
        let src = self
            .host
            .as_slice()
            .get(..len)
            .ok_or_else(|| too_long(len, self))?;
        // SAFETY: both sides hold `len` bytes and stay alive and untouched until
        // the set's event has completed (the caller's contract).
        unsafe { result::memcpy_htod_async(self.device.ptr(), src, stream.cu_stream()) }?;
        Ok(())
    }

    /// Enqueues the copy of the first `len` device bytes to the host on `stream`.
    pub fn download(&mut self, stream: &CudaStream, len: usize) -> Result<(), CudaError> {
        if len > self.capacity() {
            return Err(too_long(len, self));
        }
        let src = self.device.ptr();
        let dst = &mut self.host.as_mut_slice()[..len];
        // SAFETY: as in `upload`.
        unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }?;
        Ok(())
    }
}

fn too_long(len: usize, staging: &Staging) -> CudaError {
    CudaError::Size(format!(
        "{len} bytes copied through a staging buffer of {}",
        staging.capacity()
    ))
}

/// `len` rounded up to the growth step (at least one step).
fn round_up(len: usize) -> Result<usize, CudaError> {
    len.max(1)
        .checked_next_multiple_of(GROWTH)
        .ok_or_else(|| CudaError::Size(format!("{len} bytes")))
}

/// The buffers of one chunk of work in flight: staging per input and per output,
/// and the event recorded after its last copy. Sets come from a [`Pool`], whose
/// size bounds the chunks in flight; [`CudaBufferSet::wait`] before reading the
/// downloads or reusing the set.
pub struct CudaBufferSet {
    pub inputs: Vec<Staging>,
    pub outputs: Vec<Staging>,
    done: CudaEvent,
    pending: bool,
}

impl CudaBufferSet {
    /// A set with staging of these capacities (bytes).
    pub fn new(
        ctx: &Arc<CudaContext>,
        inputs: &[usize],
        outputs: &[usize],
    ) -> Result<CudaBufferSet, CudaError> {
        let make = |sizes: &[usize], kind| {
            sizes
                .iter()
                .map(|&c| Staging::new(ctx, c, kind))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(CudaBufferSet {
            inputs: make(inputs, StagingKind::Upload)?,
            outputs: make(outputs, StagingKind::Download)?,
            done: ctx.new_event(None)?,
            pending: false,
        })
    }

    /// A pool of `count` sets (at least 1).
    pub fn pool(
        ctx: &Arc<CudaContext>,
        count: usize,
        inputs: &[usize],
        outputs: &[usize],
    ) -> Result<Arc<Pool<CudaBufferSet>>, CudaError> {
        let sets = (0..count.max(1))
            .map(|_| CudaBufferSet::new(ctx, inputs, outputs))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pool::from_items(sets, false))
    }

    /// Records the set's event on `stream`, after the work enqueued for it.
    pub fn record(&mut self, stream: &CudaStream) -> Result<(), CudaError> {
        self.done.record(stream)?;
        self.pending = true;
        Ok(())
    }

    /// Waits until the work recorded for this set has completed.
    pub fn wait(&mut self) -> Result<(), CudaError> {
        if self.pending {
            self.done.synchronize()?;
            self.pending = false;
        }
        Ok(())
    }
}

impl Drop for CudaBufferSet {
    fn drop(&mut self) {
        // The memory must outlive the copies that use it.
        let _ = self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_grows_in_steps() {
        assert_eq!(round_up(0).unwrap(), GROWTH);
        assert_eq!(round_up(1).unwrap(), GROWTH);
        assert_eq!(round_up(GROWTH).unwrap(), GROWTH);
        assert_eq!(round_up(GROWTH + 1).unwrap(), 2 * GROWTH);
        assert!(round_up(usize::MAX).is_err());
    }
}
