//! [`Text`]: the owned UTF-8 string in a [`crate::Param`].
//!
//! Why not `String`: parameters cross the plugin boundary by reference (the worker
//! reads `&[Param]`), and `String`'s layout is not guaranteed between compilers, so
//! a plugin built by another rustc could misread it. Why not abi_stable's `RString`:
//! clients and codecs use `Param` too, and a client has no business with the plugin
//! ABI. `Text` is a `String` taken apart into a `#[repr(C)]` pointer, length and
//! capacity: its layout is fixed, the SDK's layout check covers it (`abi` feature),
//! and converting from and to `String` moves the buffer without copying.
//!
//! Ownership stays on the side that built it: the host hands plugins `&[Param]`
//! and no API moves a `Param` across the boundary, so a `Text` is always freed by
//! the allocator that allocated it.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::ptr::NonNull;

/// An owned, immutable UTF-8 string with a fixed (`#[repr(C)]`) layout.
#[repr(C)]
#[cfg_attr(feature = "abi", derive(abi_stable::StableAbi))]
pub struct Text {
    /// The buffer of a `String` (dangling when `capacity` is 0, as `String`'s is).
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: `Text` owns its buffer exclusively and never mutates it after
// construction, as `String` (which is Send + Sync) does.
unsafe impl Send for Text {}
// SAFETY: see `Send`; `&Text` gives only `&str`.
unsafe impl Sync for Text {}

impl Text {
    /// An empty text (allocates nothing).
    pub const fn new() -> Text {
        Text {
            ptr: NonNull::dangling(),
            len: 0,
            capacity: 0,
        }
    }

    /// The text as a `&str`.
    pub fn as_str(&self) -> &str {
        // SAFETY: `ptr`/`len` come from a `String` (`From<String>`) that this value
        // owns and never mutates: `len` initialized bytes of valid UTF-8.
        unsafe {
            std::str::from_utf8_unchecked(std::slice::from_raw_parts(self.ptr.as_ptr(), self.len))
        }
    }

    /// The `String` back, without copying.
    pub fn into_string(self) -> String {
        let this = ManuallyDrop::new(self);
        // SAFETY: the parts of the `String` this was made from, given back once
        // (`this` is not dropped).
        unsafe { String::from_raw_parts(this.ptr.as_ptr(), this.len, this.capacity) }
    }
}

impl Drop for Text {
    fn drop(&mut self) {
        // SAFETY: the parts of the `String` this was made from; dropped once.
        drop(unsafe { String::from_raw_parts(self.ptr.as_ptr(), self.len, self.capacity) });
    }
}

impl From<String> for Text {
    fn from(s: String) -> Text {
        let mut s = ManuallyDrop::new(s);
        match NonNull::new(s.as_mut_ptr()) {
            Some(ptr) => Text {
                ptr,
                len: s.len(),
                capacity: s.capacity(),
            },
            // A `String`'s pointer is never null; were it, nothing is leaked by
            // answering empty (a null buffer holds no allocation).
            None => Text::new(),
        }
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Text {
        Text::from(s.to_owned())
    }
}

impl From<&String> for Text {
    fn from(s: &String) -> Text {
        Text::from(s.as_str())
    }
}

impl From<Text> for String {
    fn from(t: Text) -> String {
        t.into_string()
    }
}

impl Default for Text {
    fn default() -> Text {
        Text::new()
    }
}

impl Clone for Text {
    fn clone(&self) -> Text {
        Text::from(self.as_str())
    }
}

impl Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Text {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for Text {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Text {
    fn eq(&self, other: &Text) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Text {}

impl PartialEq<str> for Text {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl Hash for Text {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_without_copying() {
        let s = String::from("sequence_id");
        let at = s.as_ptr();
        let t = Text::from(s);
        assert_eq!(t.as_str(), "sequence_id");
        assert_eq!(t, "sequence_id");
        let back = t.into_string();
        assert_eq!(back.as_ptr(), at);
        assert_eq!(back, "sequence_id");
    }

    #[test]
    fn empty_clone_and_compare() {
        let empty = Text::new();
        assert_eq!(empty.as_str(), "");
        assert_eq!(Text::from(String::new()), empty);
        let a = Text::from("ä€");
        let b = a.clone();
        assert_ne!(a.as_ptr(), b.as_ptr());
        assert_eq!(a, b);
        assert_eq!(format!("{a} {b:?}"), "ä€ \"ä€\"");
        assert_eq!(String::from(b), "ä€");
        let with_spare = {
            let mut s = String::with_capacity(64);
            s.push('x');
            Text::from(s)
        };
        assert_eq!(with_spare.clone().into_string().len(), 1);
    }
}
