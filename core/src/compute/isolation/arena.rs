//! The shared memory of one worker host: one memfd, mapped by the server and by
//! the host at a fixed, large virtual size (so that neither mapping ever moves:
//! slices handed to the worker stay valid while the file grows) and grown with
//! `ftruncate` by whichever side needs more. The server seals it against
//! shrinking (`F_SEAL_SHRINK`): a read below the size either side has seen can
//! never fault (SIGBUS), whatever the host does.
//!
//! Layout of a batch: the inputs from offset 0 (each 64-byte aligned), written by
//! the server; the outputs after them, placed by the host as the worker sizes them.

use std::cell::Cell;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The most bytes one batch may take in the arena (inputs and outputs); the
/// address space reserved for it on both sides. Pages are only used as written.
pub const ARENA_MAX: usize = 16 << 30;

/// What a worker host's arena keeps of its pages between batches: the memory of
/// the batches beyond it is given back after each ([`Arena::release_beyond`]), so
/// a burst of large requests does not leave the host holding its peak.
pub const ARENA_KEEP: usize = 16 << 20;

/// Alignment of every tensor placed in the arena.
pub const ALIGN: usize = 64;

/// One side's mapping of a worker host's arena.
pub struct Arena {
    fd: OwnedFd,
    base: *mut u8,
    /// The file's size as last seen or set: a lower bound (only ever grows).
    size: Cell<usize>,
    /// The most bytes one batch may use (the model's buffer limit; at most
    /// [`ARENA_MAX`]).
    limit: Cell<usize>,
    /// The end of the bytes this side touched since the last release.
    touched: Cell<usize>,
}

// SAFETY: the mapping is owned by this value (unmapped on drop); moving it to
// another thread moves that ownership. It is not shared between threads (`Cell`).
unsafe impl Send for Arena {}

impl Arena {
    /// A new, empty arena (the server's side), sealed against shrinking.
    pub fn create() -> io::Result<Arena> {
        // SAFETY: a constant C string; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"kiln-worker-host".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just opened and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fcntl on an open descriptor.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Arena::map(fd)
    }

    /// Maps an arena the server made (the host's side). The host refuses one
    /// that is not sealed against shrinking.
    pub fn open(fd: OwnedFd) -> io::Result<Arena> {
        // SAFETY: fcntl on an open descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(io::Error::other(
                "the arena is not sealed against shrinking",
            ));
        }
        Arena::map(fd)
    }

    fn map(fd: OwnedFd) -> io::Result<Arena> {
        // SAFETY: a fresh shared mapping of our own descriptor; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ARENA_MAX,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let arena = Arena {
            fd,
            base: base.cast(),
            size: Cell::new(0),
            limit: Cell::new(ARENA_MAX),
            touched: Cell::new(0),
        };
        arena.size.set(arena.file_size()?);
        Ok(arena)
    }

    /// The memfd (inherited by the host).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn file_size(&self) -> io::Result<usize> {
        // SAFETY: fstat into a zeroed struct of the right type.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut stat) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(usize::try_from(stat.st_size).unwrap_or(0))
    }

    /// Bounds what one batch may use to `limit` bytes (the server's buffer limit
    /// per model, `--max-buffer-bytes-per-model`).
    pub fn set_limit(&self, limit: usize) {
        self.limit.set(limit.min(ARENA_MAX));
    }

    /// Makes the file at least `end` bytes long (growing by doubling, so a
    /// steady load stops growing it); an error beyond the arena's limit.
    pub fn ensure(&self, end: usize) -> Result<(), String> {
        let limit = self.limit.get();
        if end > limit {
            return Err(format!(
                "{end} bytes do not fit the worker host's shared memory ({limit} bytes at most per batch)"
            ));
        }
        self.touched.set(self.touched.get().max(end));
        if end <= self.size.get() {
            return Ok(());
        }
        let seen = self.file_size().map_err(|e| format!("arena: {e}"))?;
        self.size.set(seen);
        if end <= seen {
            return Ok(());
        }
        let grown = end
            .max(seen.saturating_mul(2))
            .next_multiple_of(4096)
            .min(limit.next_multiple_of(4096))
            .min(ARENA_MAX);
        // SAFETY: ftruncate on our descriptor; growing a sealed-shrink memfd is allowed.
        if unsafe { libc::ftruncate(self.fd.as_raw_fd(), grown as libc::off_t) } < 0 {
            return Err(format!(
                "cannot grow the worker host's shared memory to {grown} bytes: {}",
                io::Error::last_os_error()
            ));
        }
        self.size.set(grown);
        Ok(())
    }

    /// Checks that `[offset, offset + len)` lies within the file (as the other
    /// side grew it), so reading it cannot fault.
    pub fn check(&self, offset: usize, len: usize) -> Result<(), String> {
        let limit = self.limit.get();
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= limit)
            .ok_or_else(|| {
                format!(
                    "shared-memory range {offset}+{len} does not fit the worker host's \
                     shared memory ({limit} bytes at most per batch)"
                )
            })?;
        self.touched.set(self.touched.get().max(end));
        if end <= self.size.get() {
            return Ok(());
        }
        let seen = self.file_size().map_err(|e| format!("arena: {e}"))?;
        self.size.set(seen);
        if end <= seen {
            Ok(())
        } else {
            Err(format!(
                "shared-memory range {offset}+{len} is past its end ({seen} bytes)"
            ))
        }
    }

    /// Gives the pages past `keep` that batches touched back to the system
    /// (`fallocate(PUNCH_HOLE)`: the file keeps its size, so nothing can fault;
    /// the pages read as zeros and are taken again when written). The pages leave
    /// both processes' mappings. Costs one system call, and only after a batch
    /// that used more than `keep`.
    pub fn release_beyond(&self, keep: usize) -> io::Result<()> {
        let touched = self.touched.get();
        if touched <= keep {
            return Ok(());
        }
        let start = keep.next_multiple_of(4096);
        let len = touched.next_multiple_of(4096).saturating_sub(start);
        self.touched.set(keep);
        if len == 0 {
            return Ok(());
        }
        // SAFETY: fallocate on our descriptor over a range of the file; it keeps
        // the size, so no mapping of the file can fault.
        let done = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                start as libc::off_t,
                len as libc::off_t,
            )
        };
        if done < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The bytes of the file backed by memory now (its allocated blocks).
    pub fn allocated_bytes(&self) -> io::Result<u64> {
        // SAFETY: fstat into a zeroed struct of the right type.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut stat) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(u64::try_from(stat.st_blocks).unwrap_or(0) * 512)
    }

    /// The bytes `[offset, offset + len)`.
    ///
    /// # Safety
    /// The range was [`Arena::check`]ed or [`Arena::ensure`]d, and the other
    /// process does not write it while the slice lives (the protocol's turns:
    /// the server writes inputs before a call and reads outputs after its reply).
    pub unsafe fn slice<'a>(&self, offset: usize, len: usize) -> &'a [u8] {
        // SAFETY: per the contract, in bounds of the mapping and the file.
        unsafe { std::slice::from_raw_parts(self.base.add(offset), len) }
    }

    /// The bytes `[offset, offset + len)`, writable.
    ///
    /// # Safety
    /// As [`Arena::slice`], and no other slice of this range lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<'a>(&self, offset: usize, len: usize) -> &'a mut [u8] {
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(offset), len) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe {
            libc::munmap(self.base.cast(), ARENA_MAX);
        }
    }
}

/// `offset` rounded up to [`ALIGN`].
pub fn align(offset: usize) -> usize {
    offset.next_multiple_of(ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_is_shared_through_a_second_mapping() {
        let a = Arena::create().unwrap();
        // SAFETY: dup of an open descriptor.
        let dup = unsafe { OwnedFd::from_raw_fd(libc::dup(a.fd())) };
        let b = Arena::open(dup).unwrap();
        assert!(b.check(0, 10).is_err());
        a.ensure(10_000).unwrap();
        // SAFETY: ensured above; one writer.
        unsafe { a.slice_mut(5000, 3) }.copy_from_slice(b"abc");
        b.check(5000, 3).unwrap();
        // SAFETY: checked above.
        assert_eq!(unsafe { b.slice(5000, 3) }, b"abc");
        assert!(b.check(usize::MAX - 1, 4).is_err());
        assert!(a.ensure(ARENA_MAX + 1).is_err());
        // Nobody can shrink it.
        // SAFETY: ftruncate on an open descriptor.
        assert!(unsafe { libc::ftruncate(b.fd(), 0) } < 0);
    }

    #[test]
    fn a_large_batch_gives_its_pages_back_and_the_limit_holds() {
        let a = Arena::create().unwrap();
        a.set_limit(64 << 20);
        assert!(a.ensure((64 << 20) + 1).is_err(), "past the model's limit");
        a.ensure(48 << 20).unwrap();
        // SAFETY: ensured above; one writer.
        unsafe { a.slice_mut(0, 48 << 20) }.fill(7);
        assert!(a.allocated_bytes().unwrap() >= 48 << 20);
        a.release_beyond(ARENA_KEEP).unwrap();
        let left = a.allocated_bytes().unwrap();
        assert!(left <= ARENA_KEEP as u64, "{left} bytes still held");
        // SAFETY: within the file (its size is kept); read only.
        assert_eq!(
            unsafe { a.slice(ARENA_KEEP - 1, 2) },
            [7, 0],
            "kept, then given back"
        );
        // Small batches afterwards release nothing (and cost no system call).
        a.ensure(1000).unwrap();
        a.release_beyond(ARENA_KEEP).unwrap();
    }

    #[test]
    fn an_unsealed_memfd_is_refused() {
        // SAFETY: memfd_create with a constant name.
        let fd = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: just opened.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        assert!(Arena::open(fd).is_err());
    }
}
