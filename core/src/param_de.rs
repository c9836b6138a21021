//! A serde [`Deserializer`](de::Deserializer) over a load-parameter list, so the
//! settings the server reads are one `#[derive(Deserialize)]` type
//! ([`crate::params::LoadParams`]) whatever way the parameters arrived (JSON,
//! gRPC, `config.toml`, `--load`).
//!
//! - A key is a path of `.`-separated segments: `default_queue_policy.max_queue_size`
//!   fills the field `max_queue_size` of the struct in the field
//!   `default_queue_policy`. Field names match without regard to case.
//! - A map takes the next segment as its key (`priority_queue_policy.2.…`: key `2`);
//!   a [`Names`] map takes the whole rest (`state.in.put`: key `in.put`).
//! - Values coerce as [`kiln_worker_sdk::Params`]' getters do, since a CLI and
//!   gRPC's string parameters give text: `"8"` is an integer, `"TRUE"` a boolean.
//!   A list is its comma-separated text (`"4,8"`, the form JSON's and TOML's
//!   `[4, 8]` take on the way in); an enum matches its variants without regard to case.
//! - A key repeated takes its first value, as `Params::get` reads it.
//! - Keys no field takes are left to the caller (they are the worker's own
//!   parameters: [`crate::params::check_known`] refuses the ones nobody knows);
//!   [`from_params`] returns them.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;

use kiln_worker_sdk::{Param, ParamValue};
use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};
use serde::{forward_to_deserialize_any, Deserialize};

/// A parameter whose value does not have the type its setting takes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValueError {
    /// Not an integer, nor text that parses as one.
    #[error("parameter `{key}` must be an integer, got `{got}`")]
    NotInteger { key: String, got: String },
    /// An unsigned integer beyond `i64::MAX`.
    #[error("parameter `{key}`: {got} is too large (the most is {})", i64::MAX)]
    TooLarge { key: String, got: u64 },
    /// Not a boolean, 0/1, nor `true`/`false`/`yes`/`no`/`1`/`0` text.
    #[error("parameter `{key}` must be a boolean, got `{got}`")]
    NotBool { key: String, got: String },
    /// Not a number, nor text that parses as one.
    #[error("parameter `{key}` must be a number, got `{got}`")]
    NotNumber { key: String, got: String },
    /// Not one of an enum's variants.
    #[error("parameter `{key}` must be {}, got `{got}`", one_of(allowed))]
    NotOneOf {
        key: String,
        allowed: &'static [&'static str],
        got: String,
    },
    /// An element of a list (`preferred_batch_size`) is not an integer.
    #[error("parameter `{key}` must be positive sizes, got `{got}`")]
    NotSizes { key: String, got: String },
    /// A key that goes deeper than its setting (`batch_size.x`).
    #[error("parameter `{key}` takes no `.` segments after `{path}`")]
    TooDeep { key: String, path: String },
    /// Anything else serde reports (a settings type that does not fit this format).
    #[error("{0}")]
    Other(String),
}

impl de::Error for ValueError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        ValueError::Other(msg.to_string())
    }
}

/// `` `a`, `b` or `c` ``.
fn one_of(allowed: &[&str]) -> String {
    let quoted: Vec<String> = allowed.iter().map(|a| format!("`{a}`")).collect();
    match quoted.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// Deserializes `T` from `params`; also returns the keys no field of `T` took.
pub fn from_params<T: DeserializeOwned>(params: &[Param]) -> Result<(T, Vec<String>), ValueError> {
    let seen = Seen::default();
    let value = T::deserialize(Node::root(params, &seen))?;
    Ok((value, seen.leftovers.into_inner()))
}

/// The names of every field of every struct deserializing `T` from `params` visits
/// (`default_queue_policy.max_queue_size`; a map's key as written), whether
/// `params` sets it or not: what `T` takes, to compare with a list of names.
pub fn declared_fields<T: DeserializeOwned>(params: &[Param]) -> Result<Vec<String>, ValueError> {
    let seen = Seen::default();
    T::deserialize(Node::root(params, &seen))?;
    Ok(seen.declared.into_inner())
}

/// What a deserialization saw besides the value.
#[derive(Default)]
struct Seen {
    /// Keys no field took.
    leftovers: RefCell<Vec<String>>,
    /// Every field of every struct visited.
    declared: RefCell<Vec<String>>,
}

/// A map whose keys are names that may hold dots (`state.<input>`): each key is
/// the whole rest of the parameter's name after the map's own.
#[derive(Debug, Clone, PartialEq)]
pub struct Names<T>(pub BTreeMap<String, T>);

impl<T> Default for Names<T> {
    fn default() -> Self {
        Names(BTreeMap::new())
    }
}

const NAMES: &str = "kiln::Names";
const SPELLED: &str = "kiln::Spelled";

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Names<T> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Names<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("names")
            }
            fn visit_newtype_struct<D: de::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                BTreeMap::deserialize(d).map(Names)
            }
        }
        d.deserialize_newtype_struct(NAMES, V(std::marker::PhantomData))
    }
}

/// A setting with the name its first parameter was given as (for errors that
/// name what the user wrote) and that parameter's place in the list.
#[derive(Debug, Clone, PartialEq)]
pub struct Spelled<T> {
    pub key: String,
    pub index: usize,
    pub value: T,
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Spelled<T> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Spelled<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a parameter")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let missing = || de::Error::custom("a spelled parameter has three parts");
                Ok(Spelled {
                    key: seq.next_element()?.ok_or_else(missing)?,
                    index: seq.next_element()?.ok_or_else(missing)?,
                    value: seq.next_element()?.ok_or_else(missing)?,
                })
            }
        }
        d.deserialize_newtype_struct(SPELLED, V(std::marker::PhantomData))
    }
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
    /// A [`Names`] map: each key is the whole rest of a name.
    whole_keys: bool,
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
            whole_keys: false,
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
            whole_keys: false,
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
        let key = || self.path.clone();
        match self.value()? {
            ParamValue::Int(v) => Ok(*v),
            ParamValue::Str(s) => s.trim().parse().map_err(|_| ValueError::NotInteger {
                key: key(),
                got: s.to_string(),
            }),
            ParamValue::Uint(v) => Err(ValueError::TooLarge {
                key: key(),
                got: *v,
            }),
            other => Err(ValueError::NotInteger {
                key: key(),
                got: other.to_string(),
            }),
        }
    }

    fn bool(&self) -> Result<bool, ValueError> {
        let not_bool = |got: String| ValueError::NotBool {
            key: self.path.clone(),
            got,
        };
        match self.value()? {
            ParamValue::Bool(v) => Ok(*v),
            ParamValue::Int(0) => Ok(false),
            ParamValue::Int(1) => Ok(true),
            ParamValue::Str(s) => match s.trim().to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" => Ok(true),
                "false" | "0" | "no" => Ok(false),
                _ => Err(not_bool(s.to_string())),
            },
            other => Err(not_bool(other.to_string())),
        }
    }

    fn float(&self) -> Result<f64, ValueError> {
        match self.value()? {
            ParamValue::Float(v) => Ok(*v),
            ParamValue::Int(v) => Ok(*v as f64),
            ParamValue::Uint(v) => Ok(*v as f64),
            ParamValue::Str(s) => s.trim().parse().map_err(|_| ValueError::NotNumber {
                key: self.path.clone(),
                got: s.to_string(),
            }),
            other => Err(ValueError::NotNumber {
                key: self.path.clone(),
                got: other.to_string(),
            }),
        }
    }

    /// The entries grouped under each of `names` (matched without regard to case)
    /// by the next segment of their names; the others are left over.
    fn by_field(&self, names: &'static [&'static str]) -> Vec<(&'static str, Vec<Entry<'a>>)> {
        let mut fields: Vec<(&'static str, Vec<Entry<'a>>)> = Vec::new();
        for entry in &self.entries {
            let (head, rest) = entry.rest.split_once('.').unwrap_or((entry.rest, ""));
            let Some(name) = names.iter().find(|n| n.eq_ignore_ascii_case(head)) else {
                self.seen
                    .leftovers
                    .borrow_mut()
                    .push(entry.param.key.to_string());
                continue;
            };
            let entry = Entry { rest, ..*entry };
            match fields.iter_mut().find(|(n, _)| n == name) {
                Some((_, entries)) => entries.push(entry),
                None => fields.push((name, vec![entry])),
            }
        }
        fields
    }

    /// The entries grouped by the next segment of their names (`whole`: by the
    /// whole rest), keys as written.
    fn by_key(&self, whole: bool) -> Vec<(String, Vec<Entry<'a>>)> {
        let mut keys: Vec<(String, Vec<Entry<'a>>)> = Vec::new();
        for entry in &self.entries {
            let (head, rest) = match whole {
                true => (entry.rest, ""),
                false => entry.rest.split_once('.').unwrap_or((entry.rest, "")),
            };
            let entry = Entry { rest, ..*entry };
            match keys.iter_mut().find(|(k, _)| k == head) {
                Some((_, entries)) => entries.push(entry),
                None => keys.push((head.to_owned(), vec![entry])),
            }
        }
        keys
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

/// The children of a node, as map entries.
struct Children<'a> {
    children: std::vec::IntoIter<(String, Node<'a>)>,
    next: Option<Node<'a>>,
}

impl<'de, 'a> de::MapAccess<'de> for Children<'a> {
    type Error = ValueError;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ValueError> {
        let Some((key, node)) = self.children.next() else {
            return Ok(None);
        };
        self.next = Some(node);
        seed.deserialize(key.into_deserializer()).map(Some)
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, ValueError> {
        let node = self
            .next
            .take()
            .ok_or_else(|| ValueError::Other("a value without its key".into()))?;
        seed.deserialize(node)
    }
}

/// A [`Spelled`] node: its first parameter's name, that parameter's place, the node.
struct SpelledParts<'a> {
    key: Option<String>,
    index: Option<usize>,
    node: Option<Node<'a>>,
}

impl<'de, 'a> de::SeqAccess<'de> for SpelledParts<'a> {
    type Error = ValueError;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, ValueError> {
        if let Some(key) = self.key.take() {
            return seed.deserialize(key.into_deserializer()).map(Some);
        }
        if let Some(index) = self.index.take() {
            return seed.deserialize(index.into_deserializer()).map(Some);
        }
        match self.node.take() {
            Some(node) => seed.deserialize(node).map(Some),
            None => Ok(None),
        }
    }
}

/// A list's elements: integers, each reported with the whole list when it is not.
struct ListItem {
    path: String,
    item: String,
    list: String,
}

impl<'de> de::Deserializer<'de> for ListItem {
    type Error = ValueError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        visitor.visit_string(self.item)
    }

    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        match self.item.trim().parse() {
            Ok(v) => visitor.visit_i64(v),
            Err(_) => Err(ValueError::NotSizes {
                key: self.path,
                got: self.list,
            }),
        }
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum
        identifier ignored_any
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
            let groups = self.by_key(false);
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
                whole_keys: true,
                ..self
            }),
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
        let items: Vec<ListItem> = list
            .split(',')
            .map(|item| ListItem {
                path: self.path.clone(),
                item: item.to_owned(),
                list: list.clone(),
            })
            .collect();
        visitor.visit_seq(de::value::SeqDeserializer::new(items.into_iter()))
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ValueError> {
        let groups = self.by_key(self.whole_keys);
        self.visit_map(groups, visitor)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ValueError> {
        self.seen
            .declared
            .borrow_mut()
            .extend(fields.iter().map(|f| self.child(f, Vec::new()).path));
        let groups = self
            .by_field(fields)
            .into_iter()
            .map(|(name, entries)| (name.to_owned(), entries))
            .collect();
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

impl<'de> IntoDeserializer<'de, ValueError> for ListItem {
    type Deserializer = ListItem;

    fn into_deserializer(self) -> ListItem {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_worker_sdk::params_from_pairs;

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
        names: Names<String>,
        spelled: Option<Spelled<i64>>,
    }

    fn parse(pairs: &[(&str, &str)]) -> Result<(Settings, Vec<String>), String> {
        from_params(&params_from_pairs(pairs)).map_err(|e| e.to_string())
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
}
