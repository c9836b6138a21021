//! kiln-worker-sdk: the ABI-stable contract between the kiln server and its worker
//! plugins.
//!
//! A plugin is a `cdylib` crate that implements [`Worker`] and calls
//! [`export_worker!`] once. The server loads it with abi_stable, which checks the
//! SDK version and the layout of every type crossing the boundary, and refuses a
//! mismatch with an error. Every entry point catches panics and turns them into an
//! error for the batch. Plugin `log` records reach the server's log.
//!
//! ```ignore
//! use kiln_worker_sdk::*;
//! struct Echo;
//! impl Worker for Echo { /* init, info, run */ }
//! export_worker!(Echo);
//! ```
//!
//! A device that completes batches later (an FPGA's compute units, a callback API)
//! implements [`AsyncWorker`] instead and is exported with
//! `export_worker!(async MyDevice)`: see [`async_batch`].
//!
//! A worker may run inference on other loaded models from its `run`
//! ([`call`]: Triton's BLS), synchronously, with errors as values.
//!
//! [`testing::Harness`] runs a worker in-process for unit tests.

pub mod async_batch;
pub mod batch;
pub mod call;
pub mod coerce;
pub mod error;
pub mod ffi;
pub mod logging;
pub mod spec;
pub mod testing;
pub mod trace;
pub mod types;
pub mod worker;

pub use async_batch::{AsyncBatch, BatchCompletion, BatchCompletionBox, BatchCompletion_TO};
pub use batch::{
    Batch, BatchFfi, Input, InputFfi, Output, OutputBuffer, OutputBufferRef, OutputBuffer_TO,
    OutputFfi, RequestFfi,
};
pub use call::{CallError, CallErrorKind, CallInput, CallOutput, CallSink, ModelCall};
pub use coerce::CoerceError;
pub use error::{RequestError, RequestErrorKind, WorkerError};
pub use ffi::{WorkerBox, WorkerFfi, WorkerFfi_TO, WorkerMod, WorkerModRef};
pub use logging::LogSink;
pub use spec::{ParamKind, ParamScope, ParamSpec, INSTANCES_PARAM};
pub use trace::TraceSink;
pub use types::{
    encode_bytes, params_from_pairs, tensor_byte_len, BatcherKind, DataType, Param, ParamValue,
    Params, Shape, TensorSpec, WorkerInfo, MAX_RANK,
};
pub use worker::{AsyncWorker, Worker};

pub use abi_stable::sabi_trait::TD_Opaque;

/// Items the [`export_worker!`] macro and the host need from abi_stable.
#[doc(hidden)]
pub mod reexports {
    pub use abi_stable::library::{
        __call_root_module_loader, lib_header_from_path, CheckTypeLayout, LibHeader, LibraryError,
        RootModuleResult,
    };
    pub use abi_stable::prefix_type::PrefixTypeTrait;
    pub use abi_stable::sabi_types::RMut;
    pub use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut, RStr, RString, RVec};
}
