//! Admission: a request validated against the model (its tensors, its scheduling
//! and declared parameters) and queued within the group's `queue_size`, or refused
//! at once; a request that reaches a group replaced by a reload goes to its
//! successor.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::{Sender, TrySendError};
use kiln_batchers::Request;
use tokio::sync::oneshot;

use super::{Reply, WorkerGroup};
use crate::error::{Result, ServerError};
use crate::observe::request_log::RequestLog;
use crate::params::RequestParams;
use crate::request::infer::{validate, InferRequest};

impl WorkerGroup {
    /// Validates `request` and queues it; the receiver yields its answer. A full
    /// queue refuses at once.
    /// `trace`: the request span its batch's work is recorded under, if sampled.
    pub fn submit(
        &self,
        mut request: InferRequest,
        trace: Option<crate::observe::trace::SpanIds>,
    ) -> Result<oneshot::Receiver<crate::request::answer::Answer>> {
        // Held from here to the send: a group drained meanwhile still takes the
        // request into its queue (its batchers drain until the last sender goes).
        let queue = self.queue.load();
        let Some(tx) = queue.as_ref() else {
            return match self.successor.load_full() {
                // Replaced by a reload: the name's new group answers.
                Some(next) => next.submit(request, trace),
                None => Err(self.gone()),
            };
        };
        let mut log = RequestLog {
            id: request.id.take(),
            trace_id: trace.map(|t| Box::new(t.trace_id)),
        };
        self.admit(request, tx, &mut log, trace).inspect_err(|e| {
            crate::observe::request_log::failed(&log, &self.endpoint, e);
        })
    }

    /// [`WorkerGroup::submit`]: `log` goes with the request when it is queued.
    fn admit(
        &self,
        request: InferRequest,
        tx: &Sender<Request<Reply>>,
        log: &mut RequestLog,
        trace: Option<crate::observe::trace::SpanIds>,
    ) -> Result<oneshot::Receiver<crate::request::answer::Answer>> {
        let metrics = &self.context.metrics;
        // Move the fields out: `validate` needs only the tensors, the rest travels on.
        let InferRequest {
            inputs,
            outputs,
            parameters,
            ..
        } = request;
        // Read once: the scheduling and sequence parameters.
        let RequestParams {
            priority,
            timeout,
            sequence: sequence_request,
        } = RequestParams::parse(&parameters)
            .and_then(|read| {
                // The worker's declared request parameters: a bad value fails this
                // request alone, before it can share a batch.
                self.request_params.check(&parameters)?;
                Ok(read)
            })
            .inspect_err(|_| {
                metrics.invalid.inc();
            })?;
        let tensors = InferRequest {
            inputs,
            outputs,
            ..InferRequest::default()
        };
        let mut valid =
            validate(&self.info, self.settings.batch_size, tensors).inspect_err(|_| {
                metrics.invalid.inc();
            })?;
        self.reshape
            .inputs(&mut valid.inputs, self.info.max_batch_size > 0);
        let sequence = match &self.sequence {
            None => None,
            Some(seq) => {
                let flags = sequence_request
                    .flags(&self.endpoint)
                    .and_then(|flags| match (seq.batched, valid.rows) {
                        (true, rows) if rows != 1 => Err(ServerError::invalid(format!(
                            "model `{}` is stateful: each request of a sequence is one row, got {rows}",
                            self.endpoint
                        ))),
                        _ => Ok(flags),
                    })
                    .inspect_err(|_| {
                        metrics.invalid.inc();
                    })?;
                valid.output_mask = seq.model.worker_mask(valid.output_mask);
                Some(flags)
            }
        };
        if self.context.healthy.load(Ordering::SeqCst) == 0 {
            metrics.unavailable.inc();
            return Err(ServerError::Unavailable(format!(
                "model `{}` has no worker instance able to run",
                self.endpoint
            )));
        }
        // Refused at once when the bound is reached: nothing is queued.
        let Some(ticket) = self.admission.try_admit() else {
            metrics.rejected.inc();
            return Err(ServerError::QueueFull {
                model: self.endpoint.clone(),
                capacity: self.settings.queue_size,
            });
        };
        let (reply_tx, reply_rx) = oneshot::channel();
        let request = Request {
            inputs: valid.inputs,
            rows: valid.rows,
            params: parameters,
            arrived: Instant::now(),
            priority,
            timeout,
            sequence,
            ticket: Some(ticket),
            reply: Reply {
                tx: reply_tx,
                log: std::mem::take(log),
                output_mask: valid.output_mask,
                trace: trace.map(Box::new),
            },
        };
        metrics.pending.inc();
        match tx.try_send(request) {
            Ok(()) => Ok(reply_rx),
            Err(e) => {
                metrics.pending.dec();
                match e {
                    TrySendError::Full(_) => {
                        metrics.rejected.inc();
                        Err(ServerError::QueueFull {
                            model: self.endpoint.clone(),
                            capacity: self.settings.queue_size,
                        })
                    }
                    TrySendError::Disconnected(_) => Err(self.gone()),
                }
            }
        }
    }

    /// Checks `request` as [`WorkerGroup::submit`] would (scheduling and declared
    /// request parameters, names, datatypes, shapes, sizes) without queuing it:
    /// the job API validates each job at submission. Counts nothing.
    pub fn check(&self, request: &InferRequest) -> Result<()> {
        RequestParams::parse(&request.parameters)?;
        self.request_params.check(&request.parameters)?;
        let tensors = InferRequest {
            inputs: request.inputs.clone(),
            outputs: request.outputs.clone(),
            ..InferRequest::default()
        };
        validate(&self.info, self.settings.batch_size, tensors).map(|_| ())
    }
}
