//! The one inference path. Every ingress (REST, gRPC unary and streaming, the
//! WebSocket streams' frames, jobs, the in-process [`crate::Server::infer`])
//! decodes its protocol into an [`InferRequest`], then takes the same steps,
//! through a [`Call`] ([`call`]), which does everything but decoding and encoding:
//!
//! 1. **lookup**: [`crate::Server::lookup`], what serves the model (and the
//!    version) the call names: a worker group or an ensemble
//!    ([`crate::models::Served`]);
//! 2. **admission**: [`Call::start`], that is [`submit`], which counts a request
//!    that failed to decode as invalid, or validates the decoded one and queues it
//!    ([`WorkerGroup::submit`]), refusing it at once when the queue is full; an
//!    ensemble's request instead starts its steps ([`crate::ensemble::run`]), each
//!    admitted by its own model's group the same way. A refusal is logged here
//!    (or by the group, for its own admission checks);
//! 3. **answer**: [`Call::answer`], awaiting the [`Admitted`] [`submit`] returned.
//!    Dropping the call (a client gone, a deadline passed) cancels the request:
//!    the dynamic batcher sees the closed reply channel and takes it out of its
//!    queue;
//! 4. **end**: [`Call::end`], with what the ingress's encoder made of the answer:
//!    the request counted a success or a failure, a failure logged.
//!
//! The call holds the request's [`Trace`] throughout: begun at receipt by the
//! ingress ([`Trace::receive`], with the caller's W3C headers), sampled at
//! admission, told of the answer ([`Trace::answered`]) and finished when the call
//! ends; while tracing is off it is empty and each step is a branch (see
//! [`crate::observe::trace`]).
//!
//! Between 2 and 3 an ingress may wait as its transport needs (gRPC queues on the
//! connection's task and awaits on the call's; REST waits for the answer *or* the
//! client's leaving); before 1 and between 3 and 4 only decoding and encoding
//! differ.
//! A worker's call to another model ([`crate::compute::calls`]) takes steps 1 to 3 (no
//! trace of its own, nothing to encode).

mod call;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::ensemble::run::Run;
use crate::ensemble::Ensemble;
use crate::error::{Result, ServerError};
use crate::group::WorkerGroup;
use crate::models::{Model, Served};
use crate::observe::request_log::{self, RequestLog};
use crate::observe::trace::{SpanIds, Trace};
use crate::request::answer::{Answer, BatchRow, Delivery};
use crate::request::infer::{InferRequest, InferResponse};

pub use call::Call;

/// An inference its model's group accepted: awaiting it yields the answer
/// (a [`ServerError`] when the request failed in its batch); dropping it cancels
/// the request.
#[must_use = "dropping an Admitted cancels its request"]
pub struct Admitted(AdmittedBy);

/// What an [`Admitted`] waits on.
enum AdmittedBy {
    /// Its model's group answers it.
    Group(oneshot::Receiver<Answer>),
    /// An ensemble's steps ([`crate::ensemble::run`]), advanced as it is polled.
    Ensemble(Box<Run>),
}

impl Future for Admitted {
    type Output = Result<InferResponse>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            // The response is built here, on the awaiting thread (see `crate::request::answer`).
            AdmittedBy::Group(rx) => Pin::new(rx).poll(cx).map(|answer| match answer {
                Ok(answer) => answer.map(BatchRow::into_response),
                Err(_) => Err(ServerError::Internal(
                    "the worker dropped the request".into(),
                )),
            }),
            AdmittedBy::Ensemble(run) => Pin::new(run.as_mut())
                .poll(cx)
                .map(|answer| answer.map(|(response, _counted_on_drop)| response)),
        }
    }
}

impl Admitted {
    /// The answer and its [`Delivery`], for a [`Call`], which still has to encode
    /// or place the response: it reports a failure there through the delivery, so
    /// the request is counted a failure rather than a success (awaiting the
    /// `Admitted` itself counts it a success).
    pub(crate) async fn delivered(self) -> Result<(InferResponse, Delivery)> {
        match self.0 {
            AdmittedBy::Group(rx) => match rx.await {
                Ok(answer) => answer.map(BatchRow::into_delivery),
                Err(_) => Err(ServerError::Internal(
                    "the worker dropped the request".into(),
                )),
            },
            AdmittedBy::Ensemble(run) => run.await,
        }
    }
}

/// Admission of a request an ingress decoded for `served` (found with
/// [`crate::Server::lookup`]), with what the ingress keeps beside it to encode the
/// answer (`T`: where the outputs go). A request that failed to decode is counted
/// invalid for the model and its error returned; a decoded one is validated and
/// queued ([`WorkerGroup::submit`]), or starts an ensemble's steps
/// ([`Run::start`]). `trace` is sampled here (see [`crate::observe::trace`]).
pub fn submit<T>(
    served: &Served,
    decoded: Result<(InferRequest, T)>,
    trace: &mut Trace,
) -> Result<(Admitted, T)> {
    match served {
        Served::Group(group) => admit(group.as_ref(), decoded, trace),
        Served::Ensemble(ensemble) => admit(ensemble.as_ref(), decoded, trace),
    }
}

/// What takes a decoded request: a worker group queues it, an ensemble starts
/// its steps.
trait Admits: Model {
    fn start(&self, request: InferRequest, link: Option<SpanIds>) -> Result<AdmittedBy>;
}

impl Admits for WorkerGroup {
    fn start(&self, request: InferRequest, link: Option<SpanIds>) -> Result<AdmittedBy> {
        // The group logs its own refusals.
        Ok(AdmittedBy::Group(self.submit(request, link)?))
    }
}

impl Admits for Ensemble {
    fn start(&self, request: InferRequest, link: Option<SpanIds>) -> Result<AdmittedBy> {
        // An ensemble's steps are requests of their own models (traced apart).
        let log = request_log::when_logged(&request.id, link.map(|l| l.trace_id));
        let run = Run::start(self, request).inspect_err(|e| refused(&log, self, e))?;
        Ok(AdmittedBy::Ensemble(Box::new(run)))
    }
}

/// [`submit`] to `model`.
fn admit<T>(
    model: &impl Admits,
    decoded: Result<(InferRequest, T)>,
    trace: &mut Trace,
) -> Result<(Admitted, T)> {
    let link = trace.admit(
        model.endpoint(),
        model.version(),
        decoded.as_ref().ok().map(|(r, _)| r),
    );
    let (request, keep) = decoded.inspect_err(|e| {
        model.record_invalid();
        // Undecodable: its id, if it had one, is not known.
        refused(&RequestLog::default(), model, e);
    })?;
    Ok((Admitted(model.start(request, link)?), keep))
}

/// The line about a request `model` refused at admission (a worker group writes
/// its own: [`WorkerGroup::submit`]).
fn refused(log: &RequestLog, model: &dyn Model, error: &ServerError) {
    request_log::failed(log, model.endpoint(), error);
}

/// A worker's call to another model takes this same path
/// ([`crate::compute::calls`]).
impl crate::compute::calls::Callee for WorkerGroup {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn is_caller(&self) -> bool {
        WorkerGroup::is_caller(self)
    }

    fn submit(&self, request: InferRequest) -> Result<crate::compute::calls::CallFuture> {
        let (pending, ()) = admit(self, Ok((request, ())), &mut Trace::default())?;
        Ok(Box::pin(pending))
    }
}

/// A worker may call an ensemble as any model.
impl crate::compute::calls::Callee for Ensemble {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn is_caller(&self) -> bool {
        Ensemble::is_caller(self)
    }

    fn submit(&self, request: InferRequest) -> Result<crate::compute::calls::CallFuture> {
        let (pending, ()) = admit(self, Ok((request, ())), &mut Trace::default())?;
        Ok(Box::pin(pending))
    }
}
