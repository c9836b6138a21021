//! kiln-types: the vocabulary every kiln crate shares — tensor datatypes and
//! shapes, parameters — with no plugin ABI and no protocol.
//!
//! The worker SDK carries these types across the plugin boundary, so each is
//! `#[repr(C)]` and, with the `abi` feature (which only the SDK turns on),
//! `StableAbi`. A client or a codec depends on this crate without it and so
//! never pulls in abi_stable.
//!
//! - [`tensor`]: [`DataType`], [`Shape`] and the byte layout of tensor data.
//! - [`param`]: [`Param`] and [`ParamValue`], the load-time and request parameters.
//! - [`text`]: [`Text`], the owned string inside parameters that both sides read.

pub mod param;
pub mod tensor;
pub mod text;

pub use param::{Param, ParamValue};
pub use tensor::{encode_bytes, tensor_byte_len, DataType, Shape, MAX_RANK};
pub use text::Text;
