//! The serde access types the parameter deserializer ([`super::de`]) and the
//! schema walk ([`super::schema`]) hand their visitors: a node's children as map
//! entries, a [`Spelled`](super::Spelled)'s three parts, a list's elements.

use serde::de::{self, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;

use super::error::ValueError;

/// The children of a node (`N`: a deserializer of one child), as map entries.
pub(super) struct Children<N> {
    pub(super) children: std::vec::IntoIter<(String, N)>,
    pub(super) next: Option<N>,
}

impl<'de, N: de::Deserializer<'de, Error = ValueError>> de::MapAccess<'de> for Children<N> {
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

/// A [`Spelled`](super::Spelled) node: its first parameter's name, that
/// parameter's place, the node.
pub(super) struct SpelledParts<N> {
    pub(super) key: Option<String>,
    pub(super) index: Option<usize>,
    pub(super) node: Option<N>,
}

impl<'de, N: de::Deserializer<'de, Error = ValueError>> de::SeqAccess<'de> for SpelledParts<N> {
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
pub(super) struct ListItem {
    pub(super) path: String,
    pub(super) item: String,
    pub(super) list: String,
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

impl<'de> IntoDeserializer<'de, ValueError> for ListItem {
    type Deserializer = ListItem;

    fn into_deserializer(self) -> ListItem {
        self
    }
}
