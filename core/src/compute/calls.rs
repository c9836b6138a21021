//! The host's side of workers calling models (`kiln_worker_sdk::call`, Triton's
//! BLS). While an instance thread runs a batch it holds a [`Scope`]
//! (thread-local): the group's [`Caller`] and the batch's members. The plugin's
//! call lands in [`plugin_call_sink`]'s callback on that same thread, which
//! submits each call through the one inference path ([`crate::request::serve::submit`]:
//! validation, the callee's queue bound, batching with every other request) and
//! blocks the instance thread until every answer is in.
//!
//! The no-deadlock rule: the calling thread blocks, so the callee must be served
//! by other threads. A call into the caller's own model is refused, and so is a
//! call into a model whose worker itself calls models (each group notes, before
//! its first call, that it is a caller; two groups calling each other for the
//! first time at once cannot both miss the other's mark, since both mark, then
//! look, in one sequentially consistent order). Every other wait is bounded: a
//! full callee queue refuses at once (`Exhausted`), and the caller stops waiting
//! at its request's deadline or when its client is gone.

use std::cell::Cell;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kiln_batchers::Member;
use kiln_worker_sdk::call::{
    CallError, CallErrorKind, CallFfi, CallOutputFfi, CallResultFfi, CallSink,
};
use kiln_worker_sdk::reexports::{RResult, RSlice, RVec};
use kiln_worker_sdk::{Param, ParamValue};

use crate::error::{Result, ServerError};
use crate::memory::client_bytes::{ClientBytes, Reservation, Use};
use crate::params::RequestParams;
use crate::request::answer::Reply;
use crate::request::infer::{InferRequest, InferResponse, InputTensor};

/// How often a waiting caller looks at its requests' clients and deadlines. A
/// wake-up per 5 ms of waiting, only while a worker waits on a call (model
/// calls take milliseconds); a deadline itself is met on time.
const CHECK_EVERY: Duration = Duration::from_millis(5);

/// A call's answer to come (the one inference path's `serve::Admitted`; dropping
/// it cancels the callee's request).
pub type CallFuture = Pin<Box<dyn Future<Output = Result<InferResponse>> + Send>>;

/// A model a worker may call (a `WorkerGroup`).
pub trait Callee: Send + Sync {
    /// Its endpoint name.
    fn endpoint(&self) -> &str;
    /// Whether its own workers call models.
    fn is_caller(&self) -> bool;
    /// Admission through the one inference path (`serve::submit`).
    fn submit(&self, request: InferRequest) -> Result<CallFuture>;
}

/// The loaded models, as calls find them (the Manager's snapshot).
pub trait Callees: Send + Sync {
    /// The model named `name` (as given, then lower-cased), if loaded; `None`
    /// also once the server has stopped.
    fn find(&self, name: &str) -> Option<Arc<dyn Callee>>;
    /// The budget a call's copy of its inputs is reserved from (the server's
    /// client bytes: a call's inputs derive from its clients' requests).
    fn budget(&self) -> Option<&Arc<ClientBytes>> {
        None
    }
}

/// A group's side of calling: the models it may call and whether it has called.
pub struct Caller {
    endpoint: String,
    callees: OnceLock<Arc<dyn Callees>>,
    /// Set before the group's first call; a caller cannot be called.
    calls: AtomicBool,
}

impl Caller {
    /// The caller of the group `endpoint`, calling nothing yet.
    pub fn new(endpoint: &str) -> Caller {
        Caller {
            endpoint: endpoint.to_owned(),
            callees: OnceLock::new(),
            calls: AtomicBool::new(false),
        }
    }

    /// Lets the group's workers call the models `callees` finds.
    pub fn connect(&self, callees: Arc<dyn Callees>) {
        let _ = self.callees.set(callees);
    }

    /// Whether the group's workers have called models.
    pub fn is_caller(&self) -> bool {
        self.calls.load(Ordering::SeqCst)
    }
}

/// What the running batch's calls need, while an instance thread runs it.
#[derive(Clone, Copy)]
struct Active {
    caller: *const Caller,
    members: *const [Member<Reply>],
}

thread_local! {
    static ACTIVE: Cell<Option<Active>> = const { Cell::new(None) };
}

/// Calls are possible on this thread while a `Scope` lives: it borrows what
/// the callback reads, so that outlives it.
pub(crate) struct Scope<'a> {
    previous: Option<Active>,
    _borrows: PhantomData<&'a [Member<Reply>]>,
}

/// Opens the calls of a batch of `members` run by an instance of `caller`'s group.
pub(crate) fn enter<'a>(caller: &'a Caller, members: &'a [Member<Reply>]) -> Scope<'a> {
    let active = Active {
        caller: caller as *const _,
        members: members as *const _,
    };
    Scope {
        previous: ACTIVE.with(|a| a.replace(Some(active))),
        _borrows: PhantomData,
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(self.previous));
    }
}

/// The callback handed to each plugin.
pub fn plugin_call_sink() -> CallSink {
    CallSink { infer: call }
}

fn error(kind: CallErrorKind, message: impl Into<String>) -> CallResultFfi {
    RResult::RErr(CallError::new(kind, message))
}

extern "C" fn call(calls: RSlice<'_, CallFfi<'_>>) -> RVec<CallResultFfi> {
    run_here(calls.as_slice()).into()
}

/// Runs `calls` for the batch this thread runs (an in-process plugin's through
/// [`plugin_call_sink`], a worker host's relayed by [`crate::compute::isolation::relay`]).
pub(crate) fn run_here(calls: &[CallFfi<'_>]) -> Vec<CallResultFfi> {
    let n = calls.len();
    // Nothing may unwind into the plugin.
    catch_unwind(AssertUnwindSafe(|| {
        let Some(active) = ACTIVE.with(Cell::get) else {
            return refused_all(
                n,
                "model calls are made from a worker's run, on its instance's thread",
            );
        };
        // SAFETY: `active` was set by a `Scope` that still lives on this thread
        // (it is cleared on drop), and it borrows both for its whole life.
        let (caller, members) = unsafe { (&*active.caller, &*active.members) };
        run_calls(caller, members, calls)
    }))
    .unwrap_or_else(|_| {
        (0..n)
            .map(|_| {
                error(
                    CallErrorKind::Failed,
                    "the host panicked running a model call",
                )
            })
            .collect()
    })
}

fn refused_all(n: usize, message: &str) -> Vec<CallResultFfi> {
    (0..n)
        .map(|_| error(CallErrorKind::Refused, message))
        .collect()
}

/// A call submitted and not yet answered.
struct OpenCall {
    pending: CallFuture,
    model: String,
    /// The request served (`None`: the whole batch).
    for_request: Option<usize>,
    deadline: Option<Instant>,
    /// The inputs' copy, held until the callee answers.
    _held: Option<Reservation>,
}

fn run_calls(
    caller: &Caller,
    members: &[Member<Reply>],
    calls: &[CallFfi<'_>],
) -> Vec<CallResultFfi> {
    let Some(callees) = caller.callees.get() else {
        return refused_all(calls.len(), "model calls are not available to this model");
    };
    // Marked before looking at any callee's mark (see the module's comment).
    caller.calls.store(true, Ordering::SeqCst);
    let now = Instant::now();
    let mut results: Vec<Option<CallResultFfi>> = Vec::with_capacity(calls.len());
    let mut waiting: Vec<Option<OpenCall>> = Vec::with_capacity(calls.len());
    for call in calls {
        match submit(caller, members, &**callees, call, now) {
            Ok(w) => {
                results.push(None);
                waiting.push(Some(w));
            }
            Err(e) => {
                results.push(Some(RResult::RErr(e)));
                waiting.push(None);
            }
        }
    }
    wait(members, &mut waiting, &mut results);
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| error(CallErrorKind::Failed, "no answer")))
        .collect()
}

/// The deadline of request `j` of the batch: its `timeout` parameter (µs),
/// counted from its arrival.
fn request_deadline(member: &Member<Reply>) -> Option<Instant> {
    // Admitted, so it parses: `RequestParams::parse` read it at admission.
    let timeout = RequestParams::parse(&member.params).ok()?.timeout?;
    member
        .arrived
        .checked_add(timeout)
        .filter(|_| !timeout.is_zero())
}

fn submit(
    caller: &Caller,
    members: &[Member<Reply>],
    callees: &dyn Callees,
    call: &CallFfi<'_>,
    now: Instant,
) -> std::result::Result<OpenCall, CallError> {
    let name = call.model.as_str();
    let group = callees.find(name).ok_or_else(|| {
        CallError::new(
            CallErrorKind::NotFound,
            format!("no model `{name}` is loaded"),
        )
    })?;
    if group.endpoint() == caller.endpoint {
        return Err(CallError::new(
            CallErrorKind::Refused,
            format!(
                "model `{}` cannot call itself: its instance thread waits for the answer, \
                 which only its own instances could give (deadlock)",
                caller.endpoint
            ),
        ));
    }
    if group.is_caller() {
        return Err(CallError::new(
            CallErrorKind::Refused,
            format!(
                "model `{}` cannot call `{}`, which itself calls models: calls go one \
                 level deep, so no chain of waiting instances can wait on itself",
                caller.endpoint,
                group.endpoint()
            ),
        ));
    }
    let for_request = match call.for_request {
        r if r < 0 => None,
        r => {
            let r = r as usize;
            if r >= members.len() {
                return Err(CallError::new(
                    CallErrorKind::Invalid,
                    format!("for_request {r}: the batch has {} requests", members.len()),
                ));
            }
            Some(r)
        }
    };
    let request_deadline = match for_request {
        Some(r) => request_deadline(&members[r]),
        // The whole batch: the latest of its requests' deadlines (none if any has none).
        None => members
            .iter()
            .map(request_deadline)
            .try_fold(None::<Instant>, |latest, d| {
                d.map(|d| Some(latest.map_or(d, |l| l.max(d))))
            })
            .flatten(),
    };
    let own = (call.timeout_us > 0).then(|| now + Duration::from_micros(call.timeout_us));
    let deadline = match (request_deadline, own) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let mut parameters = Vec::new();
    if let Some(deadline) = deadline {
        let left = deadline.saturating_duration_since(now);
        if left.is_zero() {
            return Err(CallError::new(
                CallErrorKind::Timeout,
                format!("the deadline passed before calling `{name}`"),
            ));
        }
        // The callee's queue expires it too (Triton's `timeout`, µs).
        parameters.push(Param {
            key: "timeout".into(),
            value: ParamValue::Int(left.as_micros().clamp(1, i64::MAX as u128) as i64),
        });
    }
    // Counted before the copy below is made.
    let bytes = call.inputs.iter().map(|i| i.data.len()).sum();
    let held = callees
        .budget()
        .map(|budget| budget.reserve(Use::ModelCall, bytes))
        .transpose()
        .map_err(|e| CallError::new(CallErrorKind::Exhausted, format!("model `{name}`: {e}")))?;
    let request = InferRequest {
        model: group.endpoint().to_owned(),
        id: None,
        inputs: call
            .inputs
            .iter()
            .map(|i| InputTensor {
                name: i.name.as_str().to_owned(),
                dtype: i.dtype,
                shape: i.shape.to_vec(),
                data: Bytes::copy_from_slice(i.data.as_slice()),
            })
            .collect(),
        outputs: (!call.outputs.is_empty())
            .then(|| call.outputs.iter().map(|o| o.as_str().to_owned()).collect()),
        parameters,
    };
    let pending = group
        .submit(request)
        .map_err(|e| from_server_error(name, e))?;
    Ok(OpenCall {
        pending,
        model: group.endpoint().to_owned(),
        for_request,
        deadline,
        _held: held,
    })
}

fn from_server_error(model: &str, e: ServerError) -> CallError {
    let kind = match &e {
        ServerError::InvalidRequest(_) | ServerError::TooLarge(_) => CallErrorKind::Invalid,
        ServerError::NotFound(_) => CallErrorKind::NotFound,
        ServerError::QueueFull { .. } | ServerError::Exhausted(_) => CallErrorKind::Exhausted,
        ServerError::Unavailable(msg) if msg.contains("timeout") => CallErrorKind::Timeout,
        ServerError::Unavailable(_) => CallErrorKind::Unavailable,
        _ => CallErrorKind::Failed,
    };
    CallError::new(kind, format!("model `{model}`: {e}"))
}

fn answer(response: Result<InferResponse>, model: &str) -> CallResultFfi {
    match response {
        Ok(response) => RResult::ROk(
            response
                .outputs
                .into_iter()
                .map(|o| CallOutputFfi {
                    name: o.name.into(),
                    dtype: o.dtype,
                    shape: o.shape.into(),
                    data: o.data.as_ref().to_vec().into(),
                })
                .collect(),
        ),
        Err(e) => RResult::RErr(from_server_error(model, e)),
    }
}

/// Whether the request `for_request` serves is gone (every request of the
/// batch, for `None`).
fn cancelled(members: &[Member<Reply>], for_request: Option<usize>) -> bool {
    match for_request {
        Some(r) => members.get(r).is_some_and(|m| m.reply.tx.is_closed()),
        None => members.iter().all(|m| m.reply.tx.is_closed()),
    }
}

struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Blocks this thread until each call is answered, cancelled or past its
/// deadline (a dropped `Admitted` cancels its callee request).
fn wait(
    members: &[Member<Reply>],
    waiting: &mut [Option<OpenCall>],
    results: &mut [Option<CallResultFfi>],
) {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        let now = Instant::now();
        let mut wake_at = now + CHECK_EVERY;
        let mut open = false;
        for (slot, result) in waiting.iter_mut().zip(results.iter_mut()) {
            let Some(w) = slot else { continue };
            if let Poll::Ready(response) = w.pending.as_mut().poll(&mut cx) {
                *result = Some(answer(response, &w.model));
                *slot = None;
            } else if cancelled(members, w.for_request) {
                *result = Some(error(
                    CallErrorKind::Cancelled,
                    "the request this call serves was cancelled",
                ));
                *slot = None;
            } else if w.deadline.is_some_and(|d| d <= now) {
                *result = Some(error(
                    CallErrorKind::Timeout,
                    "the request's deadline passed while the call waited",
                ));
                *slot = None;
            } else {
                open = true;
                if let Some(d) = w.deadline {
                    wake_at = wake_at.min(d);
                }
            }
        }
        if !open {
            return;
        }
        std::thread::park_timeout(wake_at.saturating_duration_since(Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::request_log::RequestLog;

    fn member(params: Vec<Param>, arrived: Instant) -> (Member<Reply>, impl Drop) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let member = Member {
            rows: 1,
            params,
            arrived,
            sequence: None,
            inputs: Vec::new(),
            reply: Reply {
                tx,
                log: RequestLog::default(),
                output_mask: 1,
                trace: None,
            },
        };
        (member, rx)
    }

    fn never(for_request: Option<usize>, deadline: Option<Instant>) -> Option<OpenCall> {
        Some(OpenCall {
            pending: Box::pin(std::future::pending()),
            model: "m".into(),
            for_request,
            deadline,
            _held: None,
        })
    }

    fn kind(result: &Option<CallResultFfi>) -> Option<CallErrorKind> {
        match result {
            Some(RResult::RErr(e)) => Some(e.kind),
            _ => None,
        }
    }

    /// A call whose request's client is gone ends as cancelled, though its
    /// callee never answers; a whole-batch call only once every client is gone.
    #[test]
    fn a_cancelled_request_ends_its_calls() {
        let (gone, rx) = member(Vec::new(), Instant::now());
        drop(rx);
        let (alive, _rx) = member(Vec::new(), Instant::now());
        let members = [gone, alive];
        let mut waiting = [never(Some(0), None)];
        let mut results = [None];
        wait(&members, &mut waiting, &mut results);
        assert_eq!(kind(&results[0]), Some(CallErrorKind::Cancelled));
        assert!(!cancelled(&members, None));
        assert!(cancelled(&members[..1], None));
    }

    /// The request's `timeout` (µs from its arrival) is the call's deadline.
    #[test]
    fn the_request_deadline_ends_its_calls() {
        let timeout = vec![Param {
            key: "timeout".into(),
            value: ParamValue::Int(1_000),
        }];
        let arrived = Instant::now();
        let (m, _rx) = member(timeout, arrived);
        assert_eq!(
            request_deadline(&m),
            Some(arrived + Duration::from_millis(1))
        );
        let members = [m];
        let deadline = request_deadline(&members[0]);
        let mut waiting = [never(Some(0), deadline)];
        let mut results = [None];
        wait(&members, &mut waiting, &mut results);
        assert_eq!(kind(&results[0]), Some(CallErrorKind::Timeout));
    }
}
