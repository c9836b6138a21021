//! The dynamic batcher's host: answers the requests it takes out unbatched
//! (queue full, bad priority, timed out, cancelled), and tells it which clients
//! are gone and how long batches take.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kiln_batchers::dynamic::{DynamicConfig, DynamicHost, Rejection};
use kiln_batchers::Request;

use super::Reply;
use crate::compute::instance::InstanceContext;
use crate::error::ServerError;

/// Answers the requests the dynamic batcher takes out unbatched, and tells it which
/// clients are gone and how long batches take.
pub(super) struct DynamicGroupHost {
    pub(super) ctx: Arc<InstanceContext>,
    pub(super) policies: Vec<kiln_batchers::dynamic::QueuePolicy>,
    pub(super) levels: usize,
}

impl DynamicHost<Reply> for DynamicGroupHost {
    fn rejected(&self, request: Request<Reply>, why: Rejection) {
        let m = &self.ctx.metrics;
        let model = &self.ctx.endpoint;
        m.pending.dec();
        let error = match why {
            Rejection::QueueFull => {
                m.rejected.inc();
                let level = request.priority.map_or(self.levels, |p| p as usize);
                ServerError::QueueFull {
                    model: model.clone(),
                    capacity: self
                        .policies
                        .get(level.saturating_sub(1))
                        .map_or(0, |p| p.max_queue_size),
                }
            }
            Rejection::BadPriority => {
                m.invalid.inc();
                ServerError::invalid(format!(
                    "priority {} is not a level of model `{model}` (1..={})",
                    request.priority.unwrap_or(0),
                    self.levels
                ))
            }
            Rejection::Timeout => {
                m.timeout.inc();
                ServerError::Unavailable(format!(
                    "model `{model}`: request timeout expired in the queue"
                ))
            }
            Rejection::Cancelled => {
                m.cancelled.inc();
                ServerError::Unavailable("cancelled: the client went away".into())
            }
        };
        crate::observe::request_log::failed(&request.reply.log, model, &error);
        let _ = request.reply.tx.send(Err(error));
    }

    fn is_cancelled(&self, reply: &Reply) -> bool {
        reply.tx.is_closed()
    }

    fn compute_estimate(&self) -> Duration {
        Duration::from_nanos(self.ctx.compute_estimate_ns.load(Ordering::Relaxed))
    }
}

impl DynamicGroupHost {
    /// A plain dynamic batcher's [`kiln_batchers::Screen`] (the instances form its
    /// batches): what its queue would take out as an instance takes `request` —
    /// a priority that is not a level, a client that went away — is answered so
    /// and left out; the rest is batched.
    pub(super) fn screen(
        &self,
        config: &DynamicConfig,
        request: Request<Reply>,
    ) -> Option<Request<Reply>> {
        let why = if config.level(request.priority).is_none() {
            Rejection::BadPriority
        } else if self.is_cancelled(&request.reply) {
            Rejection::Cancelled
        } else {
            return Some(request);
        };
        self.rejected(request, why);
        None
    }
}
