//! One client's inference from its ingress's side: a [`Call`] is started with the
//! decoded request and ended with what the ingress's encoder made of the answer,
//! and takes every step between itself, so no ingress threads them by hand:
//!
//! ```text
//! ingress: receive ─ decode ─┐                          ┌─ encode ─ send
//!                            Call::start ─ Call::answer ─ Call::end
//!   admission (serve::submit), the trace (received → answered → finished),
//!   the failure line (request_log), the delivery's count, cancellation (drop)
//! ```
//!
//! - [`Call::start`] admits the request ([`super::submit`]: counted invalid and
//!   logged when it failed to decode, validated and queued otherwise) and samples
//!   its [`Trace`]; refused, the trace ends with the refusal.
//! - [`Call::answer`] awaits the answer; an error ends the call there (its line was
//!   written where it happened: the batcher, the instance, the ensemble).
//! - [`Call::end`] takes the encoder's result: a failure there (an answer too large
//!   to encode, an output that does not fit its shared-memory window) is logged
//!   ([`crate::observe::request_log::failed`]) and counted a failure, not a success
//!   ([`crate::request::answer::Delivery`]); the trace ends with the outcome.
//! - Dropping a call cancels it: a queued request is taken out of its queue (the
//!   batcher sees the closed reply channel), an ensemble's steps in flight are
//!   dropped, the trace ends `cancelled`. That is how a client gone or a deadline
//!   passed (gRPC's `grpc-timeout`) ends a call: the ingress drops it.
//!
//! A call is a struct on its ingress's stack: it moves what the ingress moved
//! before (the group, the trace, the pending answer, then the delivery) and
//! allocates nothing of its own; the failure line's copy of the request id is made
//! only while verbose lines are written ([`crate::observe::request_log::when_logged`]).
//!
//! ```ignore
//! let (mut call, placement) = Call::start(group, decoded, trace)?;
//! let response = call.answer().await?;
//! call.end(encode(response, placement))
//! ```

use crate::error::{Result, ServerError};
use crate::models::Served;
use crate::observe::request_log::{self, RequestLog};
use crate::observe::trace::Trace;
use crate::request::answer::Delivery;
use crate::request::infer::{InferRequest, InferResponse};

use super::Admitted;

/// One inference in flight, from its admission to its response (see the module
/// documentation). Dropping it cancels the request.
#[must_use = "dropping a Call cancels its request"]
pub struct Call {
    served: Served,
    trace: Trace,
    stage: Stage,
}

/// Where a call is.
enum Stage {
    /// Admitted: its answer is to come.
    Waiting(Admitted),
    /// Answered: on its way to the client, counted when it is delivered or not.
    Answered(Delivery, RequestLog),
    /// Answered with an error, or in the middle of awaiting its answer.
    Over,
}

impl Call {
    /// Admits a request an ingress decoded (`decoded`, with what it keeps beside
    /// it to encode the answer: `T`) into `served` (found with
    /// [`crate::Server::lookup`]); `trace` began when the request arrived
    /// ([`Trace::receive`]) and is sampled here. A refusal ends the trace with it.
    pub fn start<T>(
        served: Served,
        decoded: Result<(InferRequest, T)>,
        mut trace: Trace,
    ) -> Result<(Call, T)> {
        match super::submit(&served, decoded, &mut trace) {
            Ok((pending, keep)) => Ok((
                Call {
                    served,
                    trace,
                    stage: Stage::Waiting(pending),
                },
                keep,
            )),
            Err(e) => {
                trace.finish(Some(&e));
                Err(e)
            }
        }
    }

    /// The answer, once it comes. An error ends the call (the trace ends with it).
    /// Dropping this future (a `select!` on the client's leaving) drops the
    /// pending answer: the request is cancelled, the call is over.
    pub async fn answer(&mut self) -> Result<InferResponse> {
        let Stage::Waiting(pending) = std::mem::replace(&mut self.stage, Stage::Over) else {
            return Err(ServerError::Internal(
                "the call's answer was already taken".into(),
            ));
        };
        match pending.delivered().await {
            Ok((response, delivery)) => {
                self.trace.answered(Some(&response));
                // Only for a line about a failure: no copy of the id unless one
                // can be written.
                let log = request_log::when_logged(&response.id, self.trace.trace_id());
                self.stage = Stage::Answered(delivery, log);
                Ok(response)
            }
            Err(e) => {
                self.trace.answered(None);
                std::mem::take(&mut self.trace).finish(Some(&e));
                Err(e)
            }
        }
    }

    /// Ends the call with what its encoder made of the answer (`encoded`, returned
    /// as it is): delivered, the request counts a success; failed, it is logged
    /// and counted a failure (invalid for a client's error). The trace ends here.
    pub fn end<R>(mut self, encoded: Result<R>) -> Result<R> {
        let trace = std::mem::take(&mut self.trace);
        let stage = std::mem::replace(&mut self.stage, Stage::Over);
        match &encoded {
            Ok(_) => trace.finish(None),
            Err(e) => {
                if let Stage::Answered(delivery, log) = stage {
                    request_log::failed(&log, self.served.endpoint(), e);
                    delivery.failed(e);
                }
                trace.finish(Some(e));
            }
        }
        encoded
    }
}
