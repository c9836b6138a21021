//! Calling other models from a worker's `run` (Triton's "business logic
//! scripting", BLS): [`infer`] runs one inference on another loaded model and
//! [`infer_all`] several at once; both block the calling instance thread until
//! every answer is in, and return errors as values.
//!
//! ```no_run
//! use kiln_worker_sdk::call::{self, ModelCall, CallInput};
//! use kiln_worker_sdk::DataType;
//! # fn f() -> Result<(), call::CallError> {
//! let data = 7u32.to_le_bytes();
//! let outputs = call::infer(&ModelCall {
//!     model: "echo",
//!     inputs: vec![CallInput { name: "INPUT0", dtype: DataType::Uint32, shape: &[1], data: &data }],
//!     for_request: Some(0),
//!     ..ModelCall::default()
//! })?;
//! # Ok(()) }
//! ```
//!
//! The host submits each call through the server's one inference path, so it
//! batches with every other request to that model. A call made on behalf of a
//! request of the running batch (`for_request`) carries that request's deadline
//! (its `timeout` parameter, counted from its arrival) and its cancellation: once
//! the client is gone, or the deadline has passed, the calls still waiting fail at
//! once. Without `for_request` the call serves the whole batch: it is cancelled
//! when every request of the batch is.
//!
//! **The rule that keeps this free of deadlocks**: the calling instance thread
//! blocks while it waits, so the called model must be served by other threads.
//! The host refuses a call into the caller's own model, and a call into a model
//! that itself calls models (so no chain of callers can wait on itself): calls
//! go one level deep. Calls are made from `run` on the instance's own thread only
//! (in a worker host, `isolation = "process"`, on the thread that runs the batch:
//! the host relays them to the server); elsewhere (`init`, a thread of the
//! worker's) they fail with a clear error.

use std::sync::OnceLock;
use std::time::Duration;

use abi_stable::std_types::{RResult, RSlice, RStr, RString, RVec};
use abi_stable::StableAbi;

use crate::types::DataType;

/// The most calls one [`infer_all`] may make (more are refused): the caller's
/// waiting is bounded, as is what one batch may queue at its callees.
pub const MAX_CALLS: usize = 1024;

/// One input tensor of a call, borrowed from the worker.
#[derive(Debug, Clone, Copy)]
pub struct CallInput<'a> {
    pub name: &'a str,
    pub dtype: DataType,
    pub shape: &'a [i64],
    /// Little-endian elements (BYTES: 4-byte length-prefixed elements).
    pub data: &'a [u8],
}

/// One inference on another model.
#[derive(Debug, Clone, Default)]
pub struct ModelCall<'a> {
    /// The model (endpoint) to run.
    pub model: &'a str,
    pub inputs: Vec<CallInput<'a>>,
    /// Outputs to return; every output when empty.
    pub outputs: Vec<&'a str>,
    /// The request of the running batch this call serves (its deadline and
    /// cancellation apply); `None`: the whole batch.
    pub for_request: Option<usize>,
    /// A deadline of the call's own, from now (the earlier of it and the
    /// request's applies).
    pub timeout: Option<Duration>,
}

/// An output tensor a call returned (owned by the worker).
#[derive(Debug, Clone, PartialEq)]
pub struct CallOutput {
    pub name: String,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

impl CallOutput {
    /// The data as elements of `T` (copied, so alignment does not matter); an
    /// error when the datatype's size does not match `T`'s.
    pub fn values<T: bytemuck::Pod>(&self) -> Result<Vec<T>, CallError> {
        if self.dtype.size() != Some(std::mem::size_of::<T>()) {
            return Err(CallError::new(
                CallErrorKind::Failed,
                format!(
                    "output `{}` is {}, not of the asked type",
                    self.name, self.dtype
                ),
            ));
        }
        Ok(bytemuck::pod_collect_to_vec(&self.data))
    }
}

/// Why a call failed.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallErrorKind {
    /// The call itself is wrong (inputs, shapes, names): HTTP 400's kind.
    Invalid,
    /// No such model is loaded.
    NotFound,
    /// The callee's queue is full (HTTP 429's kind): retry later or fail.
    Exhausted,
    /// The callee cannot serve now (no healthy instance).
    Unavailable,
    /// The request's (or the call's) deadline passed.
    Timeout,
    /// The request the call serves was cancelled (its client left).
    Cancelled,
    /// Refused by the no-deadlock rule, or made where calls are not available.
    Refused,
    /// The callee's worker failed, or anything else.
    Failed,
}

/// A failed call: its kind and the host's message.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct CallError {
    pub kind: CallErrorKind,
    pub message: RString,
}

impl CallError {
    /// An error of `kind` with `message`.
    pub fn new(kind: CallErrorKind, message: impl Into<String>) -> CallError {
        CallError {
            kind,
            message: message.into().into(),
        }
    }
}

impl From<CallError> for crate::WorkerError {
    fn from(e: CallError) -> Self {
        crate::WorkerError(e.message.into_string())
    }
}

/// An input crossing the boundary.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct CallInputFfi<'a> {
    pub name: RStr<'a>,
    pub dtype: DataType,
    pub shape: RSlice<'a, i64>,
    pub data: RSlice<'a, u8>,
}

/// A call crossing the boundary.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct CallFfi<'a> {
    pub model: RStr<'a>,
    pub inputs: RSlice<'a, CallInputFfi<'a>>,
    pub outputs: RSlice<'a, RStr<'a>>,
    /// The request served, or -1 for the whole batch.
    pub for_request: i64,
    /// The call's own deadline in microseconds from now; 0: none.
    pub timeout_us: u64,
}

/// An output crossing back (allocated by the host; abi_stable's vectors free
/// themselves through the allocator that made them).
#[repr(C)]
#[derive(StableAbi, Clone)]
pub struct CallOutputFfi {
    pub name: RString,
    pub dtype: DataType,
    pub shape: RVec<i64>,
    pub data: RVec<u8>,
}

/// One call's answer crossing back.
pub type CallResultFfi = RResult<RVec<CallOutputFfi>, CallError>;

/// The host's model-calling callback: runs every call and answers each, in order.
/// It never unwinds.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct CallSink {
    pub infer: extern "C" fn(calls: RSlice<'_, CallFfi<'_>>) -> RVec<CallResultFfi>,
}

static SINK: OnceLock<CallSink> = OnceLock::new();

/// Installs the host's callback for this plugin (first call wins).
pub fn install(sink: CallSink) {
    let _ = SINK.set(sink);
}

/// Runs one call (see the module's documentation).
pub fn infer(call: &ModelCall<'_>) -> Result<Vec<CallOutput>, CallError> {
    infer_all(std::slice::from_ref(call))
        .pop()
        .unwrap_or_else(|| Err(CallError::new(CallErrorKind::Failed, "no answer")))
}

/// Runs `calls` together (all submitted before any is waited for, so they can
/// share batches) and answers each, in order. At most [`MAX_CALLS`].
pub fn infer_all(calls: &[ModelCall<'_>]) -> Vec<Result<Vec<CallOutput>, CallError>> {
    let fail = |kind, message: &str| {
        calls
            .iter()
            .map(|_| Err(CallError::new(kind, message)))
            .collect()
    };
    let Some(sink) = SINK.get() else {
        return fail(
            CallErrorKind::Refused,
            "model calls are not available here: the host gave this plugin no call \
             callback",
        );
    };
    if calls.len() > MAX_CALLS {
        return fail(
            CallErrorKind::Invalid,
            &format!("{} calls at once; the most is {MAX_CALLS}", calls.len()),
        );
    }
    let inputs: Vec<Vec<CallInputFfi<'_>>> = calls
        .iter()
        .map(|c| {
            c.inputs
                .iter()
                .map(|i| CallInputFfi {
                    name: i.name.into(),
                    dtype: i.dtype,
                    shape: i.shape.into(),
                    data: i.data.into(),
                })
                .collect()
        })
        .collect();
    let outputs: Vec<Vec<RStr<'_>>> = calls
        .iter()
        .map(|c| c.outputs.iter().map(|&o| o.into()).collect())
        .collect();
    let ffi: Vec<CallFfi<'_>> = calls
        .iter()
        .zip(&inputs)
        .zip(&outputs)
        .map(|((c, inputs), outputs)| CallFfi {
            model: c.model.into(),
            inputs: inputs.as_slice().into(),
            outputs: outputs.as_slice().into(),
            for_request: c
                .for_request
                .map_or(-1, |r| r.min(i64::MAX as usize) as i64),
            timeout_us: c
                .timeout
                .map_or(0, |t| t.as_micros().clamp(1, u128::from(u64::MAX)) as u64),
        })
        .collect();
    let answers = (sink.infer)(ffi.as_slice().into());
    let mut answers: Vec<_> = answers
        .into_iter()
        .map(|a| {
            a.into_result().map(|outs| {
                outs.into_iter()
                    .map(|o| CallOutput {
                        name: o.name.into_string(),
                        dtype: o.dtype,
                        shape: o.shape.into_vec(),
                        data: o.data.into_vec(),
                    })
                    .collect()
            })
        })
        .collect();
    // The host answers each call; should it not, the missing ones fail.
    answers.resize_with(calls.len(), || {
        Err(CallError::new(
            CallErrorKind::Failed,
            "the host gave no answer",
        ))
    });
    answers
}
