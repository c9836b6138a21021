//! The registry behind Triton's system shared-memory extension, free of any
//! protocol: the REST routes (`http::shm_routes`) and the gRPC service share it.
//!
//! A client creates a POSIX shared-memory object (`shm_open("/name")`, which on
//! Linux is the file `/dev/shm/name`), registers a window of it under a region name,
//! and then names that region in inference requests instead of sending tensor bytes.
//!
//! The server never maps a region. Another process can truncate the object at any
//! moment, and touching a mapping past the object's end kills the process with
//! SIGBUS (a size check before the touch is a race). So an input is *copied* out
//! of the object with `pread` through the descriptor kept open at registration,
//! when the request is decoded, and an output is written with `pwrite`: a
//! truncated object is a short count, never a signal, and the request gets an
//! [`ServerError::InvalidRequest`] naming the region. This also keeps memory that
//! other processes change out of Rust references (no `&[u8]` over mutable shared
//! memory).
//!
//! The copy costs one pass over the input more than a mapping did (the batcher
//! still copies it into the batch buffer). Measured on the development machine
//! (allocate, then `pread` from a `/dev/shm` object): 0.25 µs for 4 KiB, 5 µs for
//! 64 KiB, 80 µs for 1 MiB (a plain `memcpy` of 1 MiB: 34 µs), against tens of µs
//! of HTTP or gRPC handling per request; `fstat` + `pwrite` of an output costs
//! about the same. Reading at batch time instead would save that pass but needs a
//! fallible copy in every batcher, and holding the bytes from decode on gives the
//! 400 before the request is queued. The
//! bytes copied and not yet released are bounded for the whole server
//! ([`SharedMemory::with_max_held_bytes`], `--shm-max-held-bytes`): beyond it a
//! request is refused with [`ServerError::Exhausted`] (429) instead of letting
//! small requests naming big regions fill the memory.
//!
//! As in Triton, a client must not change a region that an in-flight request
//! reads or writes. Only processes that can open the object take part, and a
//! client that registers a key makes the server read and write that object on its
//! behalf, so keys are confined to `/dev/shm` (one path component, no symbolic
//! link).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;

use crate::error::{Result, ServerError};
use crate::memory::client_bytes::{ClientBytes, Reservation, Use};

/// Where Linux keeps POSIX shared-memory objects.
const SHM_DIR: &str = "/dev/shm";

/// The default bound on input bytes copied out of shared memory and held by
/// requests at once (1 GiB).
pub const DEFAULT_MAX_HELD_BYTES: usize = 1 << 30;

/// The registered regions of one server.
///
/// Safe for concurrent use: one `RwLock` over the map of regions. Registration is
/// rare and takes the write lock; a lookup for a request's input or output takes the
/// read lock once, only to clone the region's `Arc`; reading and writing the object
/// happen without the lock. An unregistered region's descriptor stays open until
/// the last request using it is done, and its name is free at once.
pub struct SharedMemory {
    regions: RwLock<BTreeMap<String, Arc<Region>>>,
    held: Arc<Held>,
}

impl Default for SharedMemory {
    fn default() -> Self {
        SharedMemory::with_max_held_bytes(DEFAULT_MAX_HELD_BYTES)
    }
}

/// The bytes read out of shared memory that requests still hold, and their bound.
struct Held {
    bytes: AtomicUsize,
    max: AtomicUsize,
    /// The server-wide budget these bytes are also reserved from
    /// ([`crate::memory::client_bytes`]); none in a registry of its own.
    budget: Option<Arc<ClientBytes>>,
}

/// One registered region: `byte_size` bytes at `offset` of the object `key`.
struct Region {
    key: String,
    offset: usize,
    byte_size: usize,
    /// The object, kept open: read with `pread` and written with `pwrite`.
    file: File,
}

/// What the status of a region reports (Triton's `name`, `key`, `offset`, `byte_size`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionStatus {
    /// The name requests use.
    pub name: String,
    /// The shared-memory object's key, as registered (`/name`).
    pub key: String,
    /// Where the region starts in the object.
    pub offset: usize,
    /// The region's length in bytes.
    pub byte_size: usize,
}

/// A checked window of a registered region, held by a request: it keeps the
/// object open even if the region is unregistered meanwhile.
#[derive(Clone)]
pub struct ShmSlice {
    name: Arc<str>,
    region: Arc<Region>,
    held: Arc<Held>,
    start: usize,
    len: usize,
}

impl SharedMemory {
    /// An empty registry holding at most [`DEFAULT_MAX_HELD_BYTES`] of inputs.
    pub fn new() -> Self {
        SharedMemory::default()
    }

    /// An empty registry whose requests hold at most `max` bytes read from shared
    /// memory at once.
    pub fn with_max_held_bytes(max: usize) -> Self {
        SharedMemory {
            regions: RwLock::default(),
            held: Arc::new(Held {
                bytes: AtomicUsize::new(0),
                max: AtomicUsize::new(max),
                budget: None,
            }),
        }
    }

    /// An empty registry whose inputs are also reserved from the server-wide
    /// `budget` (beyond it: [`ServerError::Exhausted`], 429).
    pub fn with_budget(budget: Arc<ClientBytes>) -> Self {
        SharedMemory {
            regions: RwLock::default(),
            held: Arc::new(Held {
                bytes: AtomicUsize::new(0),
                max: AtomicUsize::new(DEFAULT_MAX_HELD_BYTES),
                budget: Some(budget),
            }),
        }
    }

    /// Sets the bound on bytes read from shared memory that requests hold at once
    /// (`--shm-max-held-bytes`); reads already made keep their share.
    pub fn set_max_held_bytes(&self, max: usize) {
        self.held.max.store(max, Ordering::Relaxed);
    }

    /// Bytes read from shared memory that requests hold now.
    pub fn held_bytes(&self) -> usize {
        self.held.bytes.load(Ordering::Relaxed)
    }

    /// Registers `byte_size` bytes at `offset` of the shared-memory object `key`
    /// (`/name`: the file `/dev/shm/name`) as region `name`. A name already
    /// registered, a bad key, a missing object or a window beyond the object's size
    /// is an [`ServerError::InvalidRequest`].
    pub fn register(&self, name: &str, key: &str, offset: usize, byte_size: usize) -> Result<()> {
        if name.is_empty() {
            return Err(ServerError::invalid(
                "a shared-memory region needs a non-empty name",
            ));
        }
        if self.regions.read().contains_key(name) {
            return Err(already_registered(name));
        }
        let region = Region::open(name, key, offset, byte_size)?;
        let mut regions = self.regions.write();
        if regions.contains_key(name) {
            return Err(already_registered(name));
        }
        regions.insert(name.to_owned(), Arc::new(region));
        Ok(())
    }

    /// Unregisters region `name`; whether it was registered. As in Triton, an
    /// unknown name is not an error.
    pub fn unregister(&self, name: &str) -> bool {
        self.regions.write().remove(name).is_some()
    }

    /// Unregisters every region; how many there were.
    pub fn unregister_all(&self) -> usize {
        std::mem::take(&mut *self.regions.write()).len()
    }

    /// The status of region `name`, or of every region (sorted by name) when `None`.
    /// An unknown name is [`ServerError::NotFound`].
    pub fn status(&self, name: Option<&str>) -> Result<Vec<RegionStatus>> {
        let regions = self.regions.read();
        let status = |(name, r): (&String, &Arc<Region>)| RegionStatus {
            name: name.clone(),
            key: r.key.clone(),
            offset: r.offset,
            byte_size: r.byte_size,
        };
        match name {
            None => Ok(regions.iter().map(status).collect()),
            Some(name) => regions
                .get_key_value(name)
                .map(|entry| vec![status(entry)])
                .ok_or_else(|| not_registered(name)),
        }
    }

    /// The window of `byte_size` bytes at `offset` of region `name` (offsets count
    /// from the region's start). Unknown region: [`ServerError::NotFound`]; a window
    /// outside the region: [`ServerError::InvalidRequest`].
    pub fn slice(&self, name: &str, offset: usize, byte_size: usize) -> Result<ShmSlice> {
        let region = self
            .regions
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| not_registered(name))?;
        match offset.checked_add(byte_size) {
            Some(end) if end <= region.byte_size => Ok(ShmSlice {
                name: name.into(),
                region,
                held: Arc::clone(&self.held),
                start: offset,
                len: byte_size,
            }),
            _ => Err(ServerError::invalid(format!(
                "shared-memory region `{name}`: offset {offset} and byte size {byte_size} \
                 run past its {} bytes",
                region.byte_size
            ))),
        }
    }

    /// A copy of `byte_size` bytes at `offset` of region `name`. Errors as
    /// [`SharedMemory::slice`] and [`ShmSlice::read`].
    pub fn read(&self, name: &str, offset: usize, byte_size: usize) -> Result<Bytes> {
        self.slice(name, offset, byte_size)?.read()
    }

    /// Writes `data` at `offset` of region `name`. Errors as [`SharedMemory::slice`]
    /// and [`ShmSlice::write`].
    pub fn write(&self, name: &str, offset: usize, data: &[u8]) -> Result<()> {
        self.slice(name, offset, data.len())?.write(data)
    }
}

impl ShmSlice {
    /// The region's name.
    pub fn region(&self) -> &str {
        &self.name
    }

    /// The window's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy of the window's bytes, read with `pread`. An object truncated below
    /// the window is an [`ServerError::InvalidRequest`]; more bytes than the
    /// server's bound on bytes held ([`SharedMemory::with_max_held_bytes`]) is
    /// [`ServerError::TooLarge`], and more than what is left of it now is
    /// [`ServerError::Exhausted`]. The bytes count against that bound until the
    /// last [`Bytes`] of them is dropped.
    pub fn read(&self) -> Result<Bytes> {
        if self.len == 0 {
            return Ok(Bytes::new());
        }
        let guard = HeldBytes::take(&self.held, self.len, &self.name)?;
        // Zeroed by the allocator (`calloc`: fresh pages of a large one are not
        // written twice), then filled from the object.
        let mut data = vec![0u8; self.len];
        self.region.read_at(&self.name, self.start, &mut data)?;
        Ok(Bytes::from_owner(Owned { data, _held: guard }))
    }

    /// Writes `data` at the window's start with `pwrite`; it must fit the window,
    /// and the object must still hold the window (else
    /// [`ServerError::InvalidRequest`], and nothing past the object's end is
    /// written).
    pub fn write(&self, data: &[u8]) -> Result<()> {
        if data.len() > self.len {
            return Err(ServerError::invalid(format!(
                "shared-memory region `{}`: {} bytes do not fit the {} bytes given",
                self.name,
                data.len(),
                self.len
            )));
        }
        self.region.write_at(&self.name, self.start, data)
    }
}

/// The registry as the codecs see it ([`kiln_protocol::shm_regions`]).
impl kiln_protocol::shm_regions::ShmRegions for SharedMemory {
    type Window = ShmSlice;

    fn window(
        &self,
        region: &str,
        offset: usize,
        byte_size: usize,
    ) -> kiln_protocol::error::Result<ShmSlice> {
        self.slice(region, offset, byte_size).map_err(for_codec)
    }
}

impl kiln_protocol::shm_regions::ShmWindow for ShmSlice {
    fn region(&self) -> &str {
        ShmSlice::region(self)
    }

    fn len(&self) -> usize {
        ShmSlice::len(self)
    }

    fn read(&self) -> kiln_protocol::error::Result<Bytes> {
        ShmSlice::read(self).map_err(for_codec)
    }

    fn write(&self, data: &[u8]) -> kiln_protocol::error::Result<()> {
        ShmSlice::write(self, data).map_err(for_codec)
    }
}

/// A registry's error as a codec carries it back to the server (which turns it
/// into the same [`ServerError`] again: the kinds the registry gives are those
/// [`kiln_protocol::ProtocolError`] has).
fn for_codec(e: ServerError) -> kiln_protocol::ProtocolError {
    use kiln_protocol::ProtocolError as P;
    match e {
        ServerError::InvalidRequest(m) => P::InvalidRequest(m),
        ServerError::TooLarge(m) => P::TooLarge(m),
        ServerError::NotFound(m) => P::NotFound(m),
        ServerError::Exhausted(m) => P::Exhausted(m),
        ServerError::Internal(m) => P::Internal(m),
        other => P::Internal(other.to_string()),
    }
}

/// Bytes read out of shared memory, counted as held until dropped.
struct Owned {
    data: Vec<u8>,
    _held: HeldBytes,
}

impl AsRef<[u8]> for Owned {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

/// A share of [`Held`], given back on drop.
struct HeldBytes {
    held: Arc<Held>,
    len: usize,
    _reserved: Option<Reservation>,
}

impl HeldBytes {
    fn take(held: &Arc<Held>, len: usize, name: &str) -> Result<HeldBytes> {
        let max = held.max.load(Ordering::Relaxed);
        if len > max {
            return Err(ServerError::TooLarge(format!(
                "shared-memory region `{name}`: {len} bytes exceed the server's limit of {max} \
                 bytes read from shared memory"
            )));
        }
        // The server-wide budget first: refused there, nothing is taken here.
        let reserved = match &held.budget {
            Some(budget) => Some(budget.reserve(Use::SharedMemory, len)?),
            None => None,
        };
        held.bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                now.checked_add(len).filter(|&total| total <= max)
            })
            .map_err(|_| {
                ServerError::Exhausted(format!(
                    "shared-memory region `{name}`: the {max} bytes of shared-memory inputs \
                     the server may hold are in use; retry later"
                ))
            })?;
        Ok(HeldBytes {
            held: Arc::clone(held),
            len,
            _reserved: reserved,
        })
    }
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        self.held.bytes.fetch_sub(self.len, Ordering::Relaxed);
    }
}

impl Region {
    /// Opens `/dev/shm/<key>` and checks the window `offset..offset + byte_size`
    /// against the object's size.
    fn open(name: &str, key: &str, offset: usize, byte_size: usize) -> Result<Region> {
        let path = object_path(key)?;
        let fail = |why: String| {
            ServerError::invalid(format!(
                "cannot register shared-memory region `{name}` of `{key}`: {why}"
            ))
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| fail(e.to_string()))?;
        let opened = file.metadata().map_err(|e| fail(e.to_string()))?;
        // The path itself must be that regular file, not a link to one elsewhere.
        let at_path = std::fs::symlink_metadata(&path).map_err(|e| fail(e.to_string()))?;
        if !opened.is_file()
            || !at_path.is_file()
            || (opened.dev(), opened.ino()) != (at_path.dev(), at_path.ino())
        {
            return Err(fail("not a shared-memory object".into()));
        }
        if byte_size == 0 {
            return Err(fail("byte_size must be at least 1".into()));
        }
        let size = opened.len();
        let end = u64::try_from(offset)
            .ok()
            .zip(u64::try_from(byte_size).ok())
            .and_then(|(o, b)| o.checked_add(b));
        if end.is_none_or(|end| end > size) {
            return Err(fail(format!(
                "offset {offset} and byte_size {byte_size} run past the object's {size} bytes"
            )));
        }
        Ok(Region {
            key: key.to_owned(),
            offset,
            byte_size,
            file,
        })
    }

    /// Where byte `start` of the region lies in the object. The window was checked
    /// to lie within the region, whose end fit a `u64` at registration.
    fn position(&self, start: usize) -> u64 {
        (self.offset + start) as u64
    }

    /// Fills `buf` from byte `start` of the region. `pread` past the object's end
    /// reads nothing: a truncated object is a short read, not a signal.
    fn read_at(&self, name: &str, start: usize, buf: &mut [u8]) -> Result<()> {
        self.file
            .read_exact_at(buf, self.position(start))
            .map_err(|e| self.io_error(name, "read", e))
    }

    /// Writes `data` at byte `start` of the region, only if the object still holds
    /// it: `pwrite` past the end would extend the object instead of failing.
    fn write_at(&self, name: &str, start: usize, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let end = self.position(start) + data.len() as u64;
        let size = self
            .file
            .metadata()
            .map_err(|e| self.io_error(name, "write", e))?
            .len();
        if size < end {
            return Err(self.truncated(name, size));
        }
        // A truncation racing between the size check and the write makes `pwrite`
        // extend the object again, with zeros up to the window: the client that
        // shrank its own object mid-request gets it back longer. No signal, no
        // memory touched outside the server: harmless.
        self.file
            .write_all_at(data, self.position(start))
            .map_err(|e| self.io_error(name, "write", e))
    }

    /// An I/O error on the object; reaching its end means it was truncated.
    fn io_error(&self, name: &str, what: &str, e: std::io::Error) -> ServerError {
        match e.kind() {
            ErrorKind::UnexpectedEof | ErrorKind::WriteZero => {
                let size = self.file.metadata().map(|m| m.len()).unwrap_or(0);
                self.truncated(name, size)
            }
            _ => ServerError::Internal(format!(
                "shared-memory region `{name}`: cannot {what} the object `{}`: {e}",
                self.key
            )),
        }
    }

    fn truncated(&self, name: &str, size: u64) -> ServerError {
        ServerError::invalid(format!(
            "shared-memory region `{name}`: the object `{}` was truncated to {size} bytes, \
             below the region's end at {}",
            self.key,
            self.offset + self.byte_size
        ))
    }
}

/// The file of the object `key`: one leading `/` is optional, the rest is one
/// path component.
fn object_path(key: &str) -> Result<PathBuf> {
    let object = key.strip_prefix('/').unwrap_or(key);
    if object.is_empty()
        || object.contains('/')
        || object.contains('\0')
        || object.contains("..")
        || object == "."
    {
        return Err(ServerError::invalid(format!(
            "shared-memory key `{key}` must be `/name` with no other `/` and no `..`"
        )));
    }
    Ok(PathBuf::from(SHM_DIR).join(object))
}

fn already_registered(name: &str) -> ServerError {
    ServerError::AlreadyExists(format!("shared memory region `{name}` already in manager"))
}

fn not_registered(name: &str) -> ServerError {
    ServerError::NotFound(format!(
        "unable to find system shared memory region `{name}`"
    ))
}

/// Shared-memory objects for unit tests (this crate's, and with the `testing`
/// feature other crates').
#[cfg(any(test, feature = "testing"))]
#[allow(clippy::unwrap_used)]
pub mod testing {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A shared-memory object for one test, removed on drop.
    pub struct Object {
        pub key: String,
        pub path: PathBuf,
    }

    impl Object {
        /// A new object `/kiln-unit-<pid>-<n>` holding `contents`.
        pub fn new(contents: &[u8]) -> Object {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let key = format!("/kiln-unit-{}-{n}", std::process::id());
            let path = object_path(&key).unwrap();
            std::fs::write(&path, contents).unwrap();
            Object { key, path }
        }

        /// What the object holds now.
        pub fn contents(&self) -> Vec<u8> {
            std::fs::read(&self.path).unwrap()
        }
    }

    impl Drop for Object {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests;
