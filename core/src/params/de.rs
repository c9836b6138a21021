//! A serde [`Deserializer`](de::Deserializer) over a load-parameter list, so the
//! settings the server reads are one `#[derive(Deserialize)]` type
//! ([`super::LoadParams`]) whatever way the parameters arrived (JSON, gRPC,
//! `config.toml`, `--load`).
//!
//! - A key is a path of `.`-separated segments: `default_queue_policy.max_queue_size`
//!   fills the field `max_queue_size` of the struct in the field
//!   `default_queue_policy`. Field names match without regard to case.
//! - A map takes the next segment as its key; a [`Levels`] map only a number
//!   (`priority_queue_policy.2.…`: key `2`); a [`Names`] map the whole rest
//!   (`state.in.put`: key `in.put`).
//! - Values coerce as [`kiln_worker_sdk::Params`]' getters do, with the same
//!   [`kiln_worker_sdk::coerce`]: a CLI and gRPC's string parameters give text, so
//!   `"8"` is an integer and `"TRUE"` a boolean. A list is its comma-separated text
//!   (`"4,8"`, the form JSON's and TOML's `[4, 8]` take on the way in); an enum
//!   matches its variants without regard to case.
//! - A key repeated takes its first value, as `Params::get` reads it.
//! - Keys no field takes go to the root type's [`Rest`] field (in `LoadParams`: the
//!   worker's own parameters); a type without one refuses them.
//!
//! [`super::schema`] walks the same types without parameters, for the names they take.

use std::cell::RefCell;

use kiln_worker_sdk::coerce;
use kiln_worker_sdk::{Param, ParamValue};
use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;

use super::access::{Children, ListItem, SpelledParts};
use super::error::ValueError;
use super::shapes::{LEVELS, NAMES, REST, REST_FIELD, SPELLED};

/// Deserializes `T` from `params`. Keys no field takes go to `T`'s [`Rest`]
/// field; without one, the first is refused ([`ValueError::Unknown`]).
pub fn from_params<T: DeserializeOwned>(params: &[Param]) -> Result<T, ValueError> {
    let seen = Seen::default();
    let value = T::deserialize(Node::root(params, &seen))?;
    match seen.leftovers.into_inner().into_iter().next() {
        Some(key) => Err(ValueError::Unknown { key }),
        None => Ok(value),
    }
}

/// What a deserialization saw besides the value.
#[derive(Default)]
struct Seen {
    /// Keys no field took (yet: a [`Rest`] field takes them all).
    leftovers: RefCell<Vec<String>>,
}

/// How a map's keys split from the rest of a name.
#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// The next segment.
    Segment,
    /// The next segment when it is a number ([`Levels`]); others are no key.
    Level,
    /// The whole rest, when not empty ([`Names`]).
    Whole,
}

/// A parameter, with what is left of its name below the node that holds it.
#[derive(Clone, Copy)]
struct Entry<'a> {
    rest: &'a str,
    param: &'a Param,
    index: usize,
}

/// The parameters under one path: a value (an entry with nothing left of its
/// name) or a struct or map of deeper ones.
struct Node<'a> {
    /// The canonical name of this node (`default_queue_policy.max_queue_size`).
    path: String,
    entries: Vec<Entry<'a>>,
    /// How a map here splits its keys.
    keys: Keys,
    seen: &'a Seen,
}

impl<'a> Node<'a> {
    fn root(params: &'a [Param], seen: &'a Seen) -> Node<'a> {
        Node {
            path: String::new(),
            entries: params
                .iter()
                .enumerate()
                .map(|(index, param)| Entry {
                    rest: param.key.as_str(),
                    param,
                    index,
                })
                .collect(),
            keys: Keys::Segment,
            seen,
        }
    }

    fn child(&self, name: &str, entries: Vec<Entry<'a>>) -> Node<'a> {
        Node {
            path: if self.path.is_empty() {
                name.to_owned()
            } else {
                format!("{}.{name}", self.path)
            },
            entries,
            keys: Keys::Segment,
            seen: self.seen,
        }
    }

    /// The value at this node: the first entry with nothing left of its name.
    fn value(&self) -> Result<&'a ParamValue, ValueError> {
        if let Some(entry) = self.entries.iter().find(|e| e.rest.is_empty()) {
            for deeper in self.entries.iter().filter(|e| !e.rest.is_empty()) {
                self.seen
                    .leftovers
                    .borrow_mut()
                    .push(deeper.param.key.to_string());
            }
            return Ok(&entry.param.value);
        }
        let key = self
            .entries
            .first()
            .map(|e| e.param.key.to_string())
            .unwrap_or_default();
        Err(ValueError::TooDeep {
            key,
            path: self.path.clone(),
        })
    }

    fn int(&self) -> Result<i64, ValueError> {
        Ok(coerce::int(&self.path, self.value()?)?)
    }

    fn bool(&self) -> Result<bool, ValueError> {
        Ok(coerce::bool(&self.path, self.value()?)?)
    }

    fn float(&self) -> Result<f64, ValueError> {
        Ok(coerce::float(&self.path, self.value()?)?)
    }

    /// The entries grouped by what `place` makes of the rest of each name: its
    /// group and what is left below it; an entry it places nowhere is left over.
    fn group<K: PartialEq>(
        &self,
        place: impl Fn(&'a str) -> Option<(K, &'a str)>,
    ) -> Vec<(K, Vec<Entry<'a>>)> {
        let mut groups: Vec<(K, Vec<Entry<'a>>)> = Vec::new();
        for entry in &self.entries {
            let Some((key, rest)) = place(entry.rest) else {
                self.seen
                    .leftovers
                    .borrow_mut()
                    .push(entry.param.key.to_string());
                continue;
            };
            let entry = Entry { rest, ..*entry };
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, entries)) => entries.push(entry),
                None => groups.push((key, vec![entry])),
            }
        }
        groups
    }

    /// The entries grouped under each of `names` (matched without regard to case)
    /// by the next segment of their names; the others are left over.
    fn by_field(&self, names: &'static [&'static str]) -> Vec<(&'static str, Vec<Entry<'a>>)> {
        self.group(|name| {
            let (head, rest) = name.split_once('.').unwrap_or((name, ""));
            let field = names
                .iter()
                .find(|n| **n != REST_FIELD && n.eq_ignore_ascii_case(head))?;
            Some((*field, rest))
        })
    }

    /// The entries grouped by their keys in this map (split as `self.keys`
    /// says), keys as written; entries that have no key are left over.
    fn by_key(&self) -> Vec<(String, Vec<Entry<'a>>)> {
        let keys = self.keys;
        self.group(|name| {
            let (head, rest) = match keys {
                Keys::Whole => (name, ""),
                Keys::Segment | Keys::Level => name.split_once('.').unwrap_or((name, "")),
            };
            let is_key = match keys {
                Keys::Segment => true,
                Keys::Level => !head.is_empty() && head.bytes().all(|b| b.is_ascii_digit()),
                Keys::Whole => !head.is_empty(),
            };
            is_key.then(|| (head.to_owned(), rest))
        })
    }

    fn visit_map<'de, V: Visitor<'de>>(
        self,
        groups: Vec<(String, Vec<Entry<'a>>)>,
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        let children = groups
            .into_iter()
            .map(|(key, entries)| {
                let child = self.child(&key, entries);
                (key, child)
            })
            .collect::<Vec<_>>();
        visitor.visit_map(Children {
            children: children.into_iter(),
            next: None,
        })
    }
}

/// Every integer type reads as an `i64` (settings range-check their own values).
macro_rules! integers_as_i64 {
    ($($method:ident)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
                self.deserialize_i64(visitor)
            }
        )*
    };
}

impl<'de, 'a> de::Deserializer<'de> for Node<'a> {
    type Error = ValueError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        if !self.entries.iter().any(|e| e.rest.is_empty()) {
            let groups = self.by_key();
            return self.visit_map(groups, visitor);
        }
        match self.value()? {
            ParamValue::Bool(v) => visitor.visit_bool(*v),
            ParamValue::Int(v) => visitor.visit_i64(*v),
            ParamValue::Uint(v) => visitor.visit_u64(*v),
            ParamValue::Float(v) => visitor.visit_f64(*v),
            ParamValue::Str(s) => visitor.visit_str(s),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_bool(self.bool()?)
    }

    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_i64(self.int()?)
    }

    integers_as_i64! {
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_u8 deserialize_u16
        deserialize_u32 deserialize_u64
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_f64(self.float()?)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_f64(self.float()?)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_string(self.value()?.to_string())
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        match name {
            NAMES => visitor.visit_newtype_struct(Node {
                keys: Keys::Whole,
                ..self
            }),
            LEVELS => visitor.visit_newtype_struct(Node {
                keys: Keys::Level,
                ..self
            }),
            // Visited last (see `deserialize_struct`): every leftover is known.
            REST => {
                let keys = self.seen.leftovers.take();
                visitor.visit_newtype_struct(de::value::SeqDeserializer::new(keys.into_iter()))
            }
            SPELLED => {
                let first = self.entries.iter().min_by_key(|e| e.index);
                let (key, index) = first
                    .map(|e| (e.param.key.to_string(), e.index))
                    .unwrap_or_default();
                visitor.visit_seq(SpelledParts {
                    key: Some(key),
                    index: Some(index),
                    node: Some(self),
                })
            }
            _ => visitor.visit_newtype_struct(self),
        }
    }

    /// A list: the value's comma-separated text.
    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        let list = self.value()?.to_string();
        // `""`: the empty list (a scalar's dims, `reshape.<tensor> = []`).
        let items: Vec<ListItem> = list
            .split(',')
            .filter(|_| !list.trim().is_empty())
            .map(|item| ListItem {
                path: self.path.clone(),
                item: item.to_owned(),
                list: list.clone(),
            })
            .collect();
        visitor.visit_seq(de::value::SeqDeserializer::new(items.into_iter()))
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        let groups = self.by_key();
        self.visit_map(groups, visitor)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        let mut groups: Vec<(String, Vec<Entry<'a>>)> = self
            .by_field(fields)
            .into_iter()
            .map(|(name, entries)| (name.to_owned(), entries))
            .collect();
        // The keys no field takes, once every other field has been visited.
        if fields.contains(&REST_FIELD) {
            groups.push((REST_FIELD.to_owned(), Vec::new()));
        }
        self.visit_map(groups, visitor)
    }

    /// A unit variant named without regard to case.
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        let text = self.value()?.to_string();
        let text = text.trim();
        match variants.iter().find(|v| v.eq_ignore_ascii_case(text)) {
            Some(variant) => visitor.visit_enum((*variant).into_deserializer()),
            None => {
                // Echo the value in the variants' case, as it was compared.
                let upper = variants.iter().all(|v| !v.contains(char::is_lowercase));
                Err(ValueError::NotOneOf {
                    key: self.path,
                    allowed: variants,
                    got: match upper {
                        true => text.to_ascii_uppercase(),
                        false => text.to_ascii_lowercase(),
                    },
                })
            }
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_unit()
    }

    forward_to_deserialize_any! {
        i128 u128 char bytes byte_buf unit unit_struct tuple tuple_struct identifier
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::params::shapes::{Levels, Names, Rest, Spelled};
    use kiln_worker_sdk::{params_from_pairs, ParamValue};
    use serde::Deserialize;

    #[derive(Debug, Default, Deserialize, PartialEq)]
    #[serde(default)]
    struct Inner {
        size: Option<i64>,
        on: Option<bool>,
    }

    #[derive(Debug, Deserialize, PartialEq, Clone, Copy)]
    #[serde(rename_all = "lowercase")]
    enum Kind {
        Hard,
        Soft,
    }

    #[derive(Debug, Default, Deserialize, PartialEq)]
    #[serde(default)]
    struct Settings {
        count: Option<i64>,
        kind: Option<Kind>,
        sizes: Option<Vec<i64>>,
        ratio: Option<f64>,
        inner: Inner,
        levels: BTreeMap<String, Inner>,
        numbered: Levels<Inner>,
        names: Names<String>,
        spelled: Option<Spelled<i64>>,
        #[serde(rename = "*")]
        rest: Rest,
    }

    fn parse(pairs: &[(&str, &str)]) -> Result<(Settings, Vec<String>), String> {
        from_params::<Settings>(&params_from_pairs(pairs))
            .map(|s| {
                let left = s.rest.0.clone();
                (s, left)
            })
            .map_err(|e| e.to_string())
    }

    #[test]
    fn text_values_take_their_types_and_paths_nest() {
        let (s, left) = parse(&[
            ("Count", "8"),
            ("kind", "HARD"),
            ("sizes", "8, 4"),
            ("ratio", "0.5"),
            ("inner.size", "3"),
            ("INNER.on", "yes"),
            ("levels.2.size", "1"),
            ("names.in.put", "out"),
            ("count", "9"),
            ("worker_own", "x"),
            ("Spelled", "5"),
        ])
        .unwrap();
        assert_eq!(s.count, Some(8), "the first of a repeated key");
        assert_eq!(s.kind, Some(Kind::Hard));
        assert_eq!(s.sizes, Some(vec![8, 4]));
        assert_eq!(s.ratio, Some(0.5));
        assert_eq!(
            s.inner,
            Inner {
                size: Some(3),
                on: Some(true)
            }
        );
        assert_eq!(s.levels["2"].size, Some(1));
        assert_eq!(s.names.0["in.put"], "out");
        assert_eq!(
            s.spelled,
            Some(Spelled {
                key: "Spelled".into(),
                index: 10,
                value: 5
            })
        );
        assert_eq!(left, ["worker_own"]);
    }

    #[test]
    fn type_errors_name_the_parameter() {
        for (pair, want) in [
            (
                ("count", "x"),
                "parameter `count` must be an integer, got `x`",
            ),
            (
                ("inner.on", "maybe"),
                "parameter `inner.on` must be a boolean, got `maybe`",
            ),
            (
                ("ratio", "r"),
                "parameter `ratio` must be a number, got `r`",
            ),
            (
                ("kind", "Firm"),
                "parameter `kind` must be `hard` or `soft`, got `firm`",
            ),
            (
                ("sizes", "4,x"),
                "parameter `sizes` must be positive sizes, got `4,x`",
            ),
            (
                ("count.x", "1"),
                "parameter `count.x` takes no `.` segments after `count`",
            ),
        ] {
            assert_eq!(parse(&[pair]).unwrap_err(), want);
        }
        let large = [Param {
            key: "count".into(),
            value: ParamValue::Uint(u64::MAX),
        }];
        assert!(from_params::<Settings>(&large)
            .unwrap_err()
            .to_string()
            .contains("is too large"));
    }

    #[test]
    fn keys_no_field_takes_go_to_the_rest_field_or_are_refused() {
        let (s, left) = parse(&[
            ("numbered.2.size", "1"),
            ("numbered.x.size", "1"),
            ("names.", "out"),
            ("inner.depth", "1"),
            ("count", "1"),
            ("count.x", "1"),
            ("*", "1"),
        ])
        .unwrap();
        assert_eq!(s.numbered.0["2"].size, Some(1));
        assert_eq!(s.numbered.0.len(), 1);
        assert!(s.names.0.is_empty());
        // Every level's leftovers: the root's first, then each field's as visited.
        assert_eq!(
            left,
            ["*", "numbered.x.size", "names.", "inner.depth", "count.x"]
        );
        // `Inner` has no `Rest` field: what it does not take is refused.
        let e =
            from_params::<Inner>(&params_from_pairs(&[("size", "1"), ("depth", "2")])).unwrap_err();
        assert_eq!(e.to_string(), "unknown parameter `depth`");
    }
}
