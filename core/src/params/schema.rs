//! The names a settings type takes, read from the type itself: a walk of its
//! `Deserialize` impl with no parameters, recording the path of every value it
//! reaches. So the list of server parameters ([`server_keys`]) is
//! [`LoadParams`](super::LoadParams)' fields, never a second list kept by hand.
//!
//! A map's key is a placeholder: `<level>` for a [`Levels`](super::Levels) map
//! (a number), `<input>` for a [`Names`](super::Names) map (the whole rest of
//! the name), `<key>` for another map (one segment).

use std::cell::RefCell;
use std::sync::LazyLock;

use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;

use super::access::{Children, SpelledParts};
use super::error::ValueError;
use super::shapes::{LEVELS, NAMES, REST, REST_FIELD, SPELLED};
use super::LoadParams;

/// One name a settings type takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    /// `batch_size`, `priority_queue_policy.<level>.timeout_action`, `state.<input>`.
    pub pattern: String,
    /// Whether its value is a list (JSON's and TOML's `[4, 8]` arrive as `"4,8"`).
    pub list: bool,
}

impl Known {
    /// Whether `key` is this name, placeholders filled, without regard to case.
    pub fn matches(&self, key: &str) -> bool {
        let (mut want, mut got) = (self.pattern.split('.'), key.split('.'));
        loop {
            match (want.next(), got.next()) {
                (None, None) => return true,
                (Some("<level>"), Some(seg))
                    if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) => {}
                // An input's name (the last segment) may itself hold dots.
                (Some("<input>"), Some(seg)) => return !seg.is_empty(),
                (Some("<key>"), Some(seg)) if !seg.is_empty() => {}
                (Some(w), Some(seg)) if !w.starts_with('<') && w.eq_ignore_ascii_case(seg) => {}
                _ => return false,
            }
        }
    }
}

/// The load parameters the server reads ([`LoadParams`]' fields), in declaration
/// order; walked once.
pub fn server_keys() -> &'static [Known] {
    static KEYS: LazyLock<Vec<Known>> = LazyLock::new(describe::<LoadParams>);
    &KEYS
}

/// Every name `T` takes (see the module doc).
pub fn describe<T: DeserializeOwned>() -> Vec<Known> {
    let out = RefCell::new(Vec::new());
    // A settings type the walk cannot describe has no names to offer: the unit
    // tests of `server_keys` fail loudly if `LoadParams` ever is one.
    let _ = T::deserialize(Schema {
        path: String::new(),
        out: &out,
    });
    out.into_inner()
}

/// A node of the walk: the path it stands for, and where names are recorded.
struct Schema<'a> {
    path: String,
    out: &'a RefCell<Vec<Known>>,
}

impl<'a> Schema<'a> {
    fn child(&self, name: &str) -> Schema<'a> {
        Schema {
            path: match self.path.is_empty() {
                true => name.to_owned(),
                false => format!("{}.{name}", self.path),
            },
            out: self.out,
        }
    }

    /// Records this path as a name the type takes.
    fn leaf(&self, list: bool) {
        self.out.borrow_mut().push(Known {
            pattern: self.path.clone(),
            list,
        });
    }

    /// A map with one key, `placeholder`.
    fn map<'de, V: Visitor<'de>>(
        self,
        placeholder: &str,
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        let child = self.child(placeholder);
        visitor.visit_map(Children {
            children: vec![(placeholder.to_owned(), child)].into_iter(),
            next: None,
        })
    }
}

/// Every integer type is a leaf read as an `i64`.
macro_rules! integer_leaves {
    ($($method:ident)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
                self.leaf(false);
                visitor.visit_i64(0)
            }
        )*
    };
}

impl<'de> de::Deserializer<'de> for Schema<'_> {
    type Error = ValueError;

    /// A value of its own kind (a state's output name): a leaf.
    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.leaf(false);
        visitor.visit_str("")
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.leaf(false);
        visitor.visit_bool(false)
    }

    integer_leaves! {
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_u8
        deserialize_u16 deserialize_u32 deserialize_u64
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.leaf(false);
        visitor.visit_f64(0.0)
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.deserialize_f64(visitor)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.leaf(false);
        visitor.visit_str("")
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_some(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.leaf(true);
        visitor.visit_seq(de::value::SeqDeserializer::<_, ValueError>::new(
            std::iter::empty::<i64>(),
        ))
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.map("<key>", visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        match name {
            NAMES => visitor.visit_newtype_struct(Placeholder(self, "<input>")),
            LEVELS => visitor.visit_newtype_struct(Placeholder(self, "<level>")),
            SPELLED => visitor.visit_seq(SpelledParts {
                key: Some(String::new()),
                index: Some(0),
                node: Some(self),
            }),
            REST => visitor.visit_newtype_struct(de::value::SeqDeserializer::<_, ValueError>::new(
                std::iter::empty::<String>(),
            )),
            _ => visitor.visit_newtype_struct(self),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        let children: Vec<(String, Schema<'_>)> = fields
            .iter()
            .filter(|f| **f != REST_FIELD)
            .map(|f| ((*f).to_owned(), self.child(f)))
            .collect();
        visitor.visit_map(Children {
            children: children.into_iter(),
            next: None,
        })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        self.leaf(false);
        let first = variants.first().ok_or_else(|| {
            ValueError::Other(format!("`{}`: an enum with no variant", self.path))
        })?;
        visitor.visit_enum((*first).into_deserializer())
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_unit()
    }

    forward_to_deserialize_any! {
        i128 u128 char bytes byte_buf unit unit_struct tuple tuple_struct identifier
    }
}

/// A map newtype's inside: a map keyed by the placeholder.
struct Placeholder<'a>(Schema<'a>, &'static str);

impl<'de> de::Deserializer<'de> for Placeholder<'_> {
    type Error = ValueError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.0.map(self.1, visitor)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum
        identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_keys_are_load_params_fields() {
        let keys = server_keys();
        let names: Vec<&str> = keys.iter().map(|k| k.pattern.as_str()).collect();
        for want in [
            "batch_size",
            "timeout",
            "isolation",
            "default_queue_policy.timeout_action",
            "priority_queue_policy.<level>.max_queue_size",
            "sequence_strategy",
            "control.corrid",
            "state.<input>",
            "state_initial.<input>",
            "state_dims.<input>",
        ] {
            assert!(names.contains(&want), "{want} in {names:?}");
        }
        // Every field of every struct in `LoadParams`, the worker's `*` not one.
        assert_eq!(names.len(), 40, "{names:?}");
        assert!(!names.iter().any(|n| n.contains('*')), "{names:?}");
        let lists: Vec<&str> = keys
            .iter()
            .filter(|k| k.list)
            .map(|k| k.pattern.as_str())
            .collect();
        assert_eq!(
            lists,
            [
                "preferred_batch_size",
                "state_dims.<input>",
                "dims.<input>",
                "reshape.<input>"
            ]
        );
    }

    #[test]
    fn placeholders_match_their_kind_of_key() {
        let known = |pattern: &str| Known {
            pattern: pattern.into(),
            list: false,
        };
        let level = known("priority_queue_policy.<level>.timeout_action");
        assert!(level.matches("Priority_Queue_Policy.12.TIMEOUT_ACTION"));
        assert!(!level.matches("priority_queue_policy.x.timeout_action"));
        assert!(!level.matches("priority_queue_policy..timeout_action"));
        let input = known("state.<input>");
        assert!(input.matches("state.in.put") && !input.matches("state."));
        assert!(!input.matches("state"));
        let key = known("m.<key>.v");
        assert!(key.matches("m.a.v") && !key.matches("m.a.b.v"));
        assert!(!known("batch_size").matches("batch_size.x"));
    }
}
