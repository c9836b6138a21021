//! Model calls (`kiln_worker_sdk::call`, Triton's BLS) from a worker in a worker
//! host, relayed to the server, which runs them through the same path as an
//! in-process worker's ([`crate::compute::calls`]: the one inference path, the caller's
//! deadline and cancellation, the no-deadlock rule).
//!
//! While a batch runs, the host's call callback ([`host_call_sink`]) writes each
//! call's inputs into the arena past everything the batch placed so far, and sends
//! a [`HOST_CALLS`] frame on the control socket (models, input ranges, the offset
//! from which the server may place answers). The server, blocked reading the
//! batch's reply on the instance thread, serves it ([`serve`]): it reads the inputs
//! from the arena, runs the calls, writes the answers' outputs into the arena from
//! that offset and replies; the host copies them out and returns to the worker.
//! Then it goes on reading the batch's reply. Everything a call moves through the
//! arena counts against the model's per-batch limit of it
//! (`--max-buffer-bytes-per-model`), and the server's copy of the inputs against
//! the client-bytes budget ([`crate::compute::calls`]).

use std::cell::Cell;
use std::io::Write;
use std::marker::PhantomData;
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kiln_worker_sdk::call::{
    CallError, CallErrorKind, CallFfi, CallInputFfi, CallOutputFfi, CallResultFfi, CallSink,
};
use kiln_worker_sdk::reexports::{RResult, RSlice, RStr, RVec};
use kiln_worker_sdk::DataType;

use super::arena::{align, Arena};
use super::wire::{read_frame, write_frame, Reader, WireError, Writer, REPLY_ERR, REPLY_OK};

/// The first byte of a frame the host sends while a batch runs: model calls,
/// not the batch's reply (which starts with `REPLY_OK` or `REPLY_ERR`).
pub const HOST_CALLS: u8 = 2;

// ---- the host's side ----------------------------------------------------------

/// What the running batch's calls go through (set while a batch runs).
#[derive(Clone, Copy)]
struct Link {
    socket: *const UnixStream,
    arena: *const Arena,
    /// The end of what the batch placed in the arena so far.
    next: *const Cell<usize>,
}

thread_local! {
    static LINK: Cell<Option<Link>> = const { Cell::new(None) };
}

/// Calls are relayed from this thread while an `Open` lives (it borrows what the
/// callback reads).
pub(super) struct Open<'a> {
    previous: Option<Link>,
    _borrows: PhantomData<&'a Arena>,
}

/// Opens the calls of the batch that runs now, its placements ending at `next`.
pub(super) fn open<'a>(
    socket: &'a UnixStream,
    arena: &'a Arena,
    next: &'a Cell<usize>,
) -> Open<'a> {
    let link = Link {
        socket,
        arena,
        next,
    };
    Open {
        previous: LINK.with(|l| l.replace(Some(link))),
        _borrows: PhantomData,
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        LINK.with(|l| l.set(self.previous));
    }
}

/// The callback the host gives its plugin.
pub(super) fn host_call_sink() -> CallSink {
    CallSink { infer: relay }
}

fn failed_all(n: usize, kind: CallErrorKind, message: &str) -> RVec<CallResultFfi> {
    (0..n)
        .map(|_| RResult::RErr(CallError::new(kind, message)))
        .collect()
}

extern "C" fn relay(calls: RSlice<'_, CallFfi<'_>>) -> RVec<CallResultFfi> {
    let n = calls.len();
    // Nothing may unwind into the plugin.
    catch_unwind(AssertUnwindSafe(|| {
        let Some(link) = LINK.with(Cell::get) else {
            return failed_all(
                n,
                CallErrorKind::Refused,
                "model calls are made from a worker's run, on the thread that runs it",
            );
        };
        // SAFETY: set by an `Open` that still lives on this thread (cleared on
        // drop), which borrows all three for its whole life.
        let (socket, arena, next) = unsafe { (&*link.socket, &*link.arena, &*link.next) };
        relay_calls(socket, arena, next.get(), calls.as_slice()).unwrap_or_else(|e| {
            failed_all(
                n,
                CallErrorKind::Failed,
                &format!("the worker host cannot relay model calls: {e}"),
            )
        })
    }))
    .unwrap_or_else(|_| {
        failed_all(
            n,
            CallErrorKind::Failed,
            "the worker host panicked relaying a model call",
        )
    })
}

/// Places the calls' inputs in the arena from `start`, sends them, and reads
/// the answers.
fn relay_calls(
    socket: &UnixStream,
    arena: &Arena,
    start: usize,
    calls: &[CallFfi<'_>],
) -> Result<RVec<CallResultFfi>, String> {
    let mut message = Vec::new();
    let mut w = Writer::start(&mut message, HOST_CALLS);
    w.count(calls.len());
    let mut end = start;
    for call in calls {
        w.str(call.model.as_str());
        w.u64(call.for_request as u64);
        w.u64(call.timeout_us);
        w.count(call.inputs.len());
        for input in call.inputs.iter() {
            let data = input.data.as_slice();
            let at = align(end);
            end = at
                .checked_add(data.len())
                .ok_or("inputs too large for the arena")?;
            arena.ensure(end)?;
            // SAFETY: ensured above; past everything the batch placed, and the
            // server reads it only after this message.
            unsafe { arena.slice_mut(at, data.len()) }.copy_from_slice(data);
            w.str(input.name.as_str());
            w.u8(input.dtype as u8);
            w.dims(input.shape.as_slice());
            w.usize(at);
            w.usize(data.len());
        }
        w.count(call.outputs.len());
        call.outputs.iter().for_each(|o| w.str(o.as_str()));
    }
    w.usize(align(end));
    let mut stream = socket;
    write_frame(&mut stream, &message).map_err(|e| e.to_string())?;
    stream.flush().map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    read_frame(&mut stream, &mut reply).map_err(|e| e.to_string())?;
    let mut r = Reader::new(&reply);
    match r.u8().map_err(|e| e.to_string())? {
        REPLY_OK => {}
        _ => {
            return Ok(failed_all(
                calls.len(),
                CallErrorKind::Failed,
                r.str().unwrap_or("malformed reply"),
            ))
        }
    }
    read_answers(&mut r, arena, calls.len()).map_err(|e| e.to_string())
}

/// The server's answers: each call's outputs (copied out of the arena) or error.
fn read_answers(
    r: &mut Reader<'_>,
    arena: &Arena,
    calls: usize,
) -> Result<RVec<CallResultFfi>, String> {
    let bad = |e: WireError| e.to_string();
    let mut answers = RVec::with_capacity(calls);
    for _ in 0..calls {
        if r.u8().map_err(bad)? != 0 {
            answers.push(RResult::RErr(read_call_error(r).map_err(bad)?));
            continue;
        }
        let n = r.count(13).map_err(bad)?;
        let mut outputs = RVec::with_capacity(n);
        for _ in 0..n {
            let name = r.str().map_err(bad)?.into();
            let dtype = datatype(r.u8().map_err(bad)?).map_err(bad)?;
            let shape = r.dims().map_err(bad)?.into();
            let (offset, len) = (r.usize().map_err(bad)?, r.usize().map_err(bad)?);
            arena.check(offset, len)?;
            // SAFETY: checked above; the server wrote it before its reply.
            let data = unsafe { arena.slice(offset, len) }.to_vec().into();
            outputs.push(CallOutputFfi {
                name,
                dtype,
                shape,
                data,
            });
        }
        answers.push(RResult::ROk(outputs));
    }
    Ok(answers)
}

// ---- the server's side --------------------------------------------------------

/// A call as the host sent it (inputs as arena ranges).
struct Sent<'a> {
    model: &'a str,
    for_request: i64,
    timeout_us: u64,
    inputs: Vec<(&'a str, DataType, Vec<i64>, usize, usize)>,
    outputs: Vec<RStr<'a>>,
}

/// Serves a [`HOST_CALLS`] frame's `body` (past its tag) on the instance thread
/// that runs the batch: runs the calls ([`crate::compute::calls::run_here`]) and writes
/// the reply into `reply`.
pub(super) fn serve(arena: &Arena, body: &[u8], reply: &mut Vec<u8>) {
    if let Err(message) = serve_calls(arena, body, reply) {
        Writer::start(reply, REPLY_ERR).str(&message);
    }
}

fn serve_calls(arena: &Arena, body: &[u8], reply: &mut Vec<u8>) -> Result<(), String> {
    let bad = |e: WireError| format!("model calls from the worker host: {e}");
    let mut r = Reader::new(body);
    let n = r.count(20).map_err(bad)?;
    if n > kiln_worker_sdk::call::MAX_CALLS {
        return Err(format!(
            "{n} model calls at once; the most is {}",
            kiln_worker_sdk::call::MAX_CALLS
        ));
    }
    let mut sent = Vec::with_capacity(n);
    for _ in 0..n {
        let model = r.str().map_err(bad)?;
        let for_request = r.u64().map_err(bad)? as i64;
        let timeout_us = r.u64().map_err(bad)?;
        let count = r.count(22).map_err(bad)?;
        let mut inputs = Vec::with_capacity(count);
        for _ in 0..count {
            let name = r.str().map_err(bad)?;
            let dtype = datatype(r.u8().map_err(bad)?).map_err(bad)?;
            let dims = r.dims().map_err(bad)?;
            let (offset, len) = (r.usize().map_err(bad)?, r.usize().map_err(bad)?);
            arena.check(offset, len)?;
            inputs.push((name, dtype, dims, offset, len));
        }
        let count = r.count(4).map_err(bad)?;
        let outputs = (0..count)
            .map(|_| r.str().map(RStr::from_str))
            .collect::<Result<_, _>>()
            .map_err(bad)?;
        sent.push(Sent {
            model,
            for_request,
            timeout_us,
            inputs,
            outputs,
        });
    }
    let free = r.usize().map_err(bad)?;
    let inputs: Vec<Vec<CallInputFfi<'_>>> = sent
        .iter()
        .map(|call| {
            call.inputs
                .iter()
                .map(|(name, dtype, dims, offset, len)| CallInputFfi {
                    name: RStr::from_str(name),
                    dtype: *dtype,
                    shape: dims.as_slice().into(),
                    // SAFETY: checked above; the host writes nothing while it
                    // waits for this reply (a host that does only garbles its
                    // own call's inputs, which are copied before they are used).
                    data: unsafe { arena.slice(*offset, *len) }.into(),
                })
                .collect()
        })
        .collect();
    let calls: Vec<CallFfi<'_>> = sent
        .iter()
        .zip(&inputs)
        .map(|(call, inputs)| CallFfi {
            model: RStr::from_str(call.model),
            inputs: inputs.as_slice().into(),
            outputs: call.outputs.as_slice().into(),
            for_request: call.for_request,
            timeout_us: call.timeout_us,
        })
        .collect();
    let results = crate::compute::calls::run_here(&calls);
    write_answers(arena, free, results, reply);
    Ok(())
}

/// Writes each answer's outputs into the arena from `free` (an answer that does
/// not fit fails alone) and the reply naming where they are.
fn write_answers(arena: &Arena, free: usize, results: Vec<CallResultFfi>, reply: &mut Vec<u8>) {
    let mut w = Writer::start(reply, REPLY_OK);
    let mut end = free;
    for result in results {
        let outputs = match result {
            RResult::ROk(outputs) => outputs,
            RResult::RErr(e) => {
                w.u8(1);
                write_call_error(&mut w, &e);
                continue;
            }
        };
        let start = end;
        let placed: Result<Vec<(usize, usize)>, String> = outputs
            .iter()
            .map(|o| {
                let at = align(end);
                let stop = at.checked_add(o.data.len()).ok_or("too large")?;
                arena.ensure(stop)?;
                // SAFETY: ensured above; the host reads it only after the reply.
                unsafe { arena.slice_mut(at, o.data.len()) }.copy_from_slice(&o.data);
                end = stop;
                Ok((at, o.data.len()))
            })
            .collect();
        match placed {
            Ok(placed) => {
                w.u8(0);
                w.count(outputs.len());
                for (o, (at, len)) in outputs.iter().zip(placed) {
                    w.str(o.name.as_str());
                    w.u8(o.dtype as u8);
                    w.dims(o.shape.as_slice());
                    w.usize(at);
                    w.usize(len);
                }
            }
            Err(e) => {
                end = start;
                w.u8(1);
                let message = format!("the call's answer does not fit: {e}");
                write_call_error(&mut w, &CallError::new(CallErrorKind::Exhausted, message));
            }
        }
    }
}

// ---- fields of both -----------------------------------------------------------

const KINDS: [CallErrorKind; 8] = [
    CallErrorKind::Invalid,
    CallErrorKind::NotFound,
    CallErrorKind::Exhausted,
    CallErrorKind::Unavailable,
    CallErrorKind::Timeout,
    CallErrorKind::Cancelled,
    CallErrorKind::Refused,
    CallErrorKind::Failed,
];

fn write_call_error(w: &mut Writer<'_>, e: &CallError) {
    w.u8(e.kind as u8);
    w.str(e.message.as_str());
}

fn read_call_error(r: &mut Reader<'_>) -> Result<CallError, WireError> {
    let kind = KINDS
        .get(r.u8()? as usize)
        .copied()
        .ok_or(WireError::Malformed("call error kind"))?;
    Ok(CallError::new(kind, r.str()?))
}

fn datatype(tag: u8) -> Result<DataType, WireError> {
    DataType::ALL
        .get(tag as usize)
        .copied()
        .ok_or(WireError::Malformed("datatype"))
}
