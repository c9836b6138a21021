//! The registry behind Triton's system shared-memory extension, free of any
//! protocol: the REST routes (`http::shm`) and the gRPC service share it.
//!
//! A client creates a POSIX shared-memory object (`shm_open("/name")`, which on
//! Linux is the file `/dev/shm/name`), registers a window of it under a region name,
//! and then names that region in inference requests instead of sending tensor bytes.
//! The server maps each registered window once; inputs are read from the mapping
//! without a copy (the batcher's copy into the batch buffer is the only one) and
//! outputs are written into it.
//!
//! The memory is shared with other processes: as in Triton, a client must not change
//! a region that an in-flight request reads or writes. Only processes that can open
//! the object take part, and a client that registers a key makes the server read and
//! write that object on its behalf, so keys are confined to `/dev/shm` (one path
//! component, no symbolic link).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use memmap2::{MmapOptions, MmapRaw};
use parking_lot::RwLock;

use crate::error::{Result, ServerError};

/// Where Linux keeps POSIX shared-memory objects.
const SHM_DIR: &str = "/dev/shm";

/// The registered regions of one server.
///
/// Safe for concurrent use: one `RwLock` over the map of regions. Registration is
/// rare and takes the write lock; a lookup for a request's input or output takes the
/// read lock once, only to clone the region's `Arc`; reading and writing the memory
/// happen without the lock. An unregistered region stays mapped until the last
/// request (or [`Bytes`]) using it is done, and its name is free at once.
#[derive(Default)]
pub struct SharedMemory {
    regions: RwLock<BTreeMap<String, Arc<Region>>>,
}

/// One registered region: `byte_size` bytes at `offset` of the object `key`.
struct Region {
    key: String,
    offset: usize,
    byte_size: usize,
    /// Kept open to notice an object truncated under the mapping.
    file: File,
    map: MmapRaw,
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

/// A checked window of a registered region, held by a request: it keeps the mapping
/// alive even if the region is unregistered meanwhile.
#[derive(Clone)]
pub struct ShmSlice {
    name: Arc<str>,
    region: Arc<Region>,
    start: usize,
    len: usize,
}

impl SharedMemory {
    /// An empty registry.
    pub fn new() -> Self {
        SharedMemory::default()
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

    /// `byte_size` bytes at `offset` of region `name`, without a copy: the [`Bytes`]
    /// keeps the mapping alive. Errors as [`SharedMemory::slice`].
    pub fn read(&self, name: &str, offset: usize, byte_size: usize) -> Result<Bytes> {
        self.slice(name, offset, byte_size)?.read()
    }

    /// Writes `data` at `offset` of region `name`. Errors as [`SharedMemory::slice`].
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

    /// The window's bytes, without a copy: the [`Bytes`] keeps the mapping alive.
    pub fn read(&self) -> Result<Bytes> {
        self.region.check_size(&self.name)?;
        if self.len == 0 {
            return Ok(Bytes::new());
        }
        Ok(Bytes::from_owner(self.clone()))
    }

    /// Writes `data` at the window's start; it must fit the window.
    pub fn write(&self, data: &[u8]) -> Result<()> {
        if data.len() > self.len {
            return Err(ServerError::invalid(format!(
                "shared-memory region `{}`: {} bytes do not fit the {} bytes given",
                self.name,
                data.len(),
                self.len
            )));
        }
        self.region.check_size(&self.name)?;
        // SAFETY: `start + data.len() <= start + len <= map.len()` (checked by
        // `SharedMemory::slice`), and the mapping is writable and lives as long as
        // `self.region`. `copy` allows `data` to overlap the window (a slice read
        // from the same region).
        unsafe {
            std::ptr::copy(
                data.as_ptr(),
                self.region.map.as_mut_ptr().add(self.start),
                data.len(),
            );
        }
        Ok(())
    }
}

impl AsRef<[u8]> for ShmSlice {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the window lies inside the mapping (checked by
        // `SharedMemory::slice`), which lives as long as `self.region`. Other
        // processes may write the memory: the extension's contract (as Triton's) is
        // that clients leave a region alone while a request uses it.
        unsafe { std::slice::from_raw_parts(self.region.map.as_ptr().add(self.start), self.len) }
    }
}

impl Region {
    /// Opens `/dev/shm/<key>` and maps the window `offset..offset + byte_size`.
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
        let map = MmapOptions::new()
            .offset(offset as u64)
            .len(byte_size)
            .map_raw(&file)
            .map_err(|e| fail(format!("cannot map it: {e}")))?;
        Ok(Region {
            key: key.to_owned(),
            offset,
            byte_size,
            file,
            map,
        })
    }

    /// Refuses to touch a mapping whose object was truncated below it (touching it
    /// would kill the process with SIGBUS).
    fn check_size(&self, name: &str) -> Result<()> {
        let size = self.file.metadata().map(|m| m.len()).unwrap_or(0);
        if size < (self.offset + self.byte_size) as u64 {
            return Err(ServerError::invalid(format!(
                "shared-memory region `{name}`: the object `{}` shrank to {size} bytes",
                self.key
            )));
        }
        Ok(())
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

/// Shared-memory objects for unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A shared-memory object for one test, removed on drop.
    pub(crate) struct Object {
        pub key: String,
        pub path: PathBuf,
    }

    impl Object {
        /// A new object `/kiln-unit-<pid>-<n>` holding `contents`.
        pub(crate) fn new(contents: &[u8]) -> Object {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let key = format!("/kiln-unit-{}-{n}", std::process::id());
            let path = object_path(&key).unwrap();
            std::fs::write(&path, contents).unwrap();
            Object { key, path }
        }

        pub(crate) fn contents(&self) -> Vec<u8> {
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
mod tests {
    use super::testing::Object;
    use super::*;

    fn message(e: ServerError) -> String {
        e.to_string()
    }

    #[test]
    fn register_read_write_status_unregister() {
        let object = Object::new(&(0u8..64).collect::<Vec<_>>());
        let shm = SharedMemory::new();
        shm.register("r", &object.key, 16, 32).unwrap();
        // Offsets count from the region's start, not the object's.
        let bytes = shm.read("r", 4, 4).unwrap();
        assert_eq!(bytes.as_ref(), &[20, 21, 22, 23]);
        assert!(shm.read("r", 0, 0).unwrap().is_empty());
        // No copy: two reads see the same memory.
        assert_eq!(shm.read("r", 4, 1).unwrap().as_ptr(), bytes.as_ptr());
        shm.write("r", 0, &[0xaa, 0xbb]).unwrap();
        let contents = object.contents();
        assert_eq!(&contents[15..19], &[15, 0xaa, 0xbb, 18]);
        assert_eq!(shm.read("r", 0, 2).unwrap().as_ref(), &[0xaa, 0xbb]);
        // A write overlapping what it copies from.
        let overlap = shm.read("r", 0, 4).unwrap();
        shm.write("r", 1, &overlap).unwrap();
        assert_eq!(&object.contents()[16..21], &[0xaa, 0xaa, 0xbb, 18, 19]);
        // Whatever the object's contents become is what is read.
        shm.register("whole", &object.key, 0, 64).unwrap();
        assert_eq!(shm.read("whole", 17, 1).unwrap().as_ref(), &[0xaa]);
        let status = shm.status(None).unwrap();
        assert_eq!(
            status,
            vec![
                RegionStatus {
                    name: "r".into(),
                    key: object.key.clone(),
                    offset: 16,
                    byte_size: 32
                },
                RegionStatus {
                    name: "whole".into(),
                    key: object.key.clone(),
                    offset: 0,
                    byte_size: 64
                },
            ]
        );
        assert_eq!(shm.status(Some("whole")).unwrap(), status[1..].to_vec());
        // Unregistering frees the name at once; bytes already read stay mapped (a
        // view of the memory, which the overlapping write changed).
        assert!(shm.unregister("r"));
        assert!(!shm.unregister("r"), "an unknown name is not an error");
        assert!(matches!(shm.read("r", 0, 1), Err(ServerError::NotFound(_))));
        assert_eq!(bytes.as_ref(), &[19, 21, 22, 23]);
        assert_eq!(bytes.as_ref(), &object.contents()[20..24]);
        shm.register("r", &object.key, 0, 8).unwrap();
        assert_eq!(shm.unregister_all(), 2);
        assert!(shm.status(None).unwrap().is_empty());
    }

    #[test]
    fn bounds_are_checked() {
        let object = Object::new(&[0u8; 32]);
        let shm = SharedMemory::new();
        for (offset, size) in [(0, 33), (32, 1), (16, 17), (usize::MAX, 2)] {
            let err = message(shm.register("r", &object.key, offset, size).unwrap_err());
            assert!(err.contains("run past the object's 32 bytes"), "{err}");
        }
        assert!(message(shm.register("r", &object.key, 0, 0).unwrap_err()).contains("at least 1"));
        shm.register("r", &object.key, 8, 16).unwrap();
        for (offset, size) in [(0, 17), (16, 1), (1, usize::MAX)] {
            let err = shm.read("r", offset, size).unwrap_err();
            assert!(matches!(err, ServerError::InvalidRequest(_)), "{err}");
            assert!(message(err).contains("run past its 16 bytes"));
        }
        assert!(shm.write("r", 10, &[0; 7]).is_err());
        assert_eq!(object.contents(), vec![0; 32], "nothing written");
        shm.write("r", 10, &[1; 6]).unwrap();
        assert!(shm.read("r", 16, 0).unwrap().is_empty());
        // A slice refuses more than its window.
        let slice = shm.slice("r", 0, 2).unwrap();
        assert_eq!(slice.region(), "r");
        assert!(message(slice.write(&[0; 3]).unwrap_err()).contains("do not fit the 2 bytes"));
        // An object truncated under the mapping is refused, not touched.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&object.path)
            .unwrap()
            .set_len(12)
            .unwrap();
        assert!(message(shm.read("r", 0, 1).unwrap_err()).contains("shrank to 12 bytes"));
        assert!(shm.write("r", 0, &[1]).is_err());
    }

    #[test]
    fn twice_unknown_and_bad_keys() {
        let object = Object::new(&[0u8; 8]);
        let shm = SharedMemory::new();
        shm.register("r", &object.key, 0, 8).unwrap();
        let err = message(shm.register("r", &object.key, 0, 4).unwrap_err());
        assert!(err.contains("already in manager"), "{err}");
        assert_eq!(shm.status(Some("r")).unwrap()[0].byte_size, 8);
        assert!(matches!(
            shm.status(Some("nope")),
            Err(ServerError::NotFound(_))
        ));
        assert!(matches!(
            shm.write("nope", 0, &[1]),
            Err(ServerError::NotFound(_))
        ));
        // Without the leading slash is the same object.
        shm.register("r2", &object.key[1..], 0, 8).unwrap();
        for key in ["", "/", "/a/b", "/..", "..", "/.", "/x/../y", "/a\0b"] {
            let err = shm.register("k", key, 0, 1).unwrap_err();
            assert!(matches!(err, ServerError::InvalidRequest(_)), "{key:?}");
            assert!(message(err).contains("must be `/name`"), "{key:?}");
        }
        let err = message(shm.register("k", "/kiln-unit-missing", 0, 1).unwrap_err());
        assert!(err.contains("No such file"), "{err}");
        assert!(shm.register("", &object.key, 0, 1).is_err());
        // A symbolic link in /dev/shm is not followed.
        let link = Object {
            key: format!("/kiln-unit-link-{}", std::process::id()),
            path: object_path(&format!("/kiln-unit-link-{}", std::process::id())).unwrap(),
        };
        std::os::unix::fs::symlink(&object.path, &link.path).unwrap();
        let err = message(shm.register("k", &link.key, 0, 1).unwrap_err());
        assert!(err.contains("not a shared-memory object"), "{err}");
        assert_eq!(shm.status(None).unwrap().len(), 2);
    }
}
