//! Parameters: the one place load-time and request parameters are parsed and
//! checked. A parameter is a key and a value in any form a protocol gives (text
//! from a CLI or gRPC, typed from JSON or TOML); values coerce with the SDK's one
//! [`kiln_worker_sdk::coerce`], which workers' `Params` getters use too.
//!
//! | file | what it holds |
//! |---|---|
//! | `load.rs` | [`LoadParams`]: the server's load settings as one `Deserialize` type (the worker's own keys in its `Rest`); [`GroupParams`] once checked |
//! | `batching.rs` | the dynamic and sequence batchers' settings, checked |
//! | `de.rs` | the serde deserializer over a parameter list (`.`-paths nest, case-blind names, text coerces) |
//! | `shapes.rs`, `access.rs` | the map, spelled-name and rest shapes a settings type may take; the serde access types |
//! | `schema.rs` | the names a settings type takes, read from the type ([`server_keys`], [`takes_list`]) |
//! | `known.rs` | [`check_known`]: refuses a load parameter neither the server nor the worker knows |
//! | `scope.rs` | who may set what ([`check_client_keys`]); the worker's [`RequestRules`] for request parameters |
//! | `request.rs` | [`RequestParams`]: an inference request's `priority`, `timeout`, sequence; [`take_version`] |
//! | `identity.rs` | [`identity`]: when two loads are the same configuration |
//! | `error.rs` | [`ValueError`], [`SettingError`], [`ParamError`]: each a 400 / INVALID_ARGUMENT |
//!
//! `kiln serve --load`'s `WORKER:key=value,...` specs are parsed in the binary's
//! crate (`kiln_server::load_spec`).

mod access;
mod batching;
mod de;
mod error;
mod identity;
mod known;
mod load;
mod request;
mod schema;
mod scope;
mod shapes;

pub use de::from_params;
pub use error::{ParamError, SettingError, ValueError};
pub use identity::identity;
pub use known::{check_known, takes_list};
pub use load::{GroupParams, LoadParams};
pub use request::{take_version, RequestParams, SequenceRequest};
pub use schema::{describe, server_keys, Known};
pub use scope::{check_client_keys, client_keys, Origin, RequestRules};
pub use shapes::{Levels, Names, Rest, Spelled};
