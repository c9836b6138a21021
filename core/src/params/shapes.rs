//! The shapes a settings type takes beyond serde's own, which the parameter
//! deserializer ([`super::de`]) and the schema walk ([`super::schema`]) both know
//! by their newtype names: maps keyed by level or by name, a value with the name it
//! was given as, and the keys no field takes.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Visitor};
use serde::Deserialize;

pub(super) const NAMES: &str = "kiln::Names";
pub(super) const LEVELS: &str = "kiln::Levels";
pub(super) const SPELLED: &str = "kiln::Spelled";
pub(super) const REST: &str = "kiln::Rest";

/// The field name of a [`Rest`] (`#[serde(rename = "*")]`): no parameter's name
/// matches it, so it only ever takes the keys no other field took.
pub(super) const REST_FIELD: &str = "*";

/// A map whose keys are input names that may hold dots (`state.<input>`): each
/// key is the whole rest of the parameter's name after the map's own.
#[derive(Debug, Clone, PartialEq)]
pub struct Names<T>(pub BTreeMap<String, T>);

/// A map keyed by a priority level (`priority_queue_policy.<level>.…`): a key
/// whose segment is not a number is no key of the map.
#[derive(Debug, Clone, PartialEq)]
pub struct Levels<T>(pub BTreeMap<String, T>);

impl<T> Default for Names<T> {
    fn default() -> Self {
        Names(BTreeMap::new())
    }
}

impl<T> Default for Levels<T> {
    fn default() -> Self {
        Levels(BTreeMap::new())
    }
}

/// Deserializes a newtype over a map (its name tells the deserializer how keys split).
fn map_newtype<'de, D, T, M>(
    d: D,
    name: &'static str,
    wrap: fn(BTreeMap<String, T>) -> M,
) -> Result<M, D::Error>
where
    D: de::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct V<T, M>(fn(BTreeMap<String, T>) -> M, PhantomData<T>);
    impl<'de, T: Deserialize<'de>, M> Visitor<'de> for V<T, M> {
        type Value = M;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map of parameters")
        }
        fn visit_newtype_struct<D: de::Deserializer<'de>>(self, d: D) -> Result<M, D::Error> {
            BTreeMap::deserialize(d).map(self.0)
        }
    }
    d.deserialize_newtype_struct(name, V(wrap, PhantomData))
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Names<T> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        map_newtype(d, NAMES, Names)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Levels<T> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        map_newtype(d, LEVELS, Levels)
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
        struct V<T>(PhantomData<T>);
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
        d.deserialize_newtype_struct(SPELLED, V(PhantomData))
    }
}

/// The keys no other field of the root type took, in the order given: declared as
/// `#[serde(rename = "*")] field: Rest` in the root type only. In
/// [`super::LoadParams`] they are the worker's own parameters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rest(pub Vec<String>);

impl<'de> Deserialize<'de> for Rest {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Rest;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("the keys no field took")
            }
            fn visit_newtype_struct<D: de::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Rest, D::Error> {
                Vec::deserialize(d).map(Rest)
            }
        }
        d.deserialize_newtype_struct(REST, V)
    }
}
