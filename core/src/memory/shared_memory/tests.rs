//! Tests of the shared-memory registry (`super`).
use super::testing::Object;
use super::*;

fn message(e: ServerError) -> String {
    e.to_string()
}

fn truncate(object: &Object, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(&object.path)
        .unwrap()
        .set_len(len)
        .unwrap();
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
    shm.write("r", 0, &[0xaa, 0xbb]).unwrap();
    let contents = object.contents();
    assert_eq!(&contents[15..19], &[15, 0xaa, 0xbb, 18]);
    assert_eq!(shm.read("r", 0, 2).unwrap().as_ref(), &[0xaa, 0xbb]);
    // A read is a copy: what the object holds later does not change it.
    let copy = shm.read("r", 0, 4).unwrap();
    shm.write("r", 1, &copy).unwrap();
    assert_eq!(&object.contents()[16..21], &[0xaa, 0xaa, 0xbb, 18, 19]);
    assert_eq!(copy.as_ref(), &[0xaa, 0xbb, 18, 19]);
    // Whatever the object's contents become is what is read next.
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
    // Unregistering frees the name at once; bytes already read stay as read.
    assert!(shm.unregister("r"));
    assert!(!shm.unregister("r"), "an unknown name is not an error");
    assert!(matches!(shm.read("r", 0, 1), Err(ServerError::NotFound(_))));
    assert_eq!(bytes.as_ref(), &[20, 21, 22, 23]);
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
}

#[test]
fn a_truncated_object_is_an_invalid_request() {
    let object = Object::new(&[7u8; 32]);
    let shm = SharedMemory::new();
    shm.register("r", &object.key, 8, 16).unwrap();
    // Windows taken before the truncation, as a request holds them.
    let (early, late) = (shm.slice("r", 0, 4).unwrap(), shm.slice("r", 8, 8).unwrap());
    truncate(&object, 12);
    for result in [late.read().map(drop), late.write(&[1; 8])] {
        let err = result.unwrap_err();
        assert!(matches!(err, ServerError::InvalidRequest(_)), "{err}");
        assert!(
            message(err).contains("was truncated to 12 bytes, below the region's end at 24"),
            "{}",
            object.key
        );
    }
    // Not extended by the refused write; what is still there can be used.
    assert_eq!(object.contents().len(), 12);
    assert_eq!(early.read().unwrap().as_ref(), &[7; 4]);
    early.write(&[1; 4]).unwrap();
    assert_eq!(object.contents(), [[7; 8].as_slice(), &[1; 4]].concat());
    truncate(&object, 0);
    assert!(message(early.read().unwrap_err()).contains("truncated to 0 bytes"));
    // Extended again, the region works again.
    truncate(&object, 32);
    shm.write("r", 8, &[9; 8]).unwrap();
    assert_eq!(shm.read("r", 6, 4).unwrap().as_ref(), &[0, 0, 9, 9]);
    assert_eq!(shm.held_bytes(), 0, "every read released");
}

#[test]
fn bytes_held_are_bounded() {
    let object = Object::new(&[1u8; 64]);
    let shm = SharedMemory::with_max_held_bytes(8);
    shm.set_max_held_bytes(40);
    shm.register("r", &object.key, 0, 64).unwrap();
    let err = shm.read("r", 0, 41).unwrap_err();
    assert!(matches!(err, ServerError::TooLarge(_)), "{err}");
    let first = shm.read("r", 0, 32).unwrap();
    let second = shm.read("r", 0, 8).unwrap();
    assert_eq!(shm.held_bytes(), 40);
    let err = shm.read("r", 0, 1).unwrap_err();
    assert!(matches!(err, ServerError::Exhausted(_)), "{err}");
    // Slices of a read hold it until the last is dropped.
    let part = first.slice(4..8);
    drop(first);
    assert_eq!(shm.held_bytes(), 40);
    drop(part);
    assert_eq!(shm.held_bytes(), 8);
    assert_eq!(shm.read("r", 0, 32).unwrap().len(), 32);
    drop(second);
    assert_eq!(shm.held_bytes(), 0);
    // A failed read holds nothing.
    truncate(&object, 4);
    assert!(shm.read("r", 0, 8).is_err());
    assert_eq!(shm.held_bytes(), 0);
}

#[test]
fn bytes_held_count_against_the_server_wide_budget() {
    let object = Object::new(&[1u8; 64]);
    let budget = crate::memory::client_bytes::ClientBytes::new(48);
    let shm = SharedMemory::with_budget(std::sync::Arc::clone(&budget));
    shm.register("r", &object.key, 0, 64).unwrap();
    // Another surface holds 16 of the 48 bytes.
    let other = budget.reserve(Use::DecodedImage, 16).unwrap();
    let first = shm.read("r", 0, 32).unwrap();
    assert_eq!(budget.held(), 48);
    let err = shm.read("r", 0, 1).unwrap_err();
    assert!(
        matches!(err, ServerError::Exhausted(ref m) if m.contains("--max-client-bytes")),
        "{err}"
    );
    assert_eq!(
        shm.held_bytes(),
        32,
        "a refusal by the budget holds nothing here"
    );
    drop(other);
    let second = shm.read("r", 0, 16).unwrap();
    drop((first, second));
    assert_eq!(budget.held(), 0);
    assert_eq!(shm.held_bytes(), 0);
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
