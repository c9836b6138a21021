//! The local server as a [`DispatchTarget`]: its own gauges read in process (no
//! scraping), jobs run through the one inference path (a `kiln_core::request::serve::Call`)
//! at the lowest priority the model's batcher has.

use kiln_core::error::ServerError;
use kiln_core::observe::trace::Trace;
use kiln_core::request::serve::Call;
use kiln_core::{InferRequest, Param, ParamValue, Server};
use kiln_protocol::http::json::{decode_request, encode_response};

use crate::budget::{BoxFuture, DispatchTarget, Dispatched, Reading};
use crate::queue::{ClaimedJob, Outcome};

/// The server this process runs.
pub struct LocalTarget {
    server: Server,
}

impl LocalTarget {
    /// A target over `server`.
    pub fn new(server: Server) -> LocalTarget {
        LocalTarget { server }
    }
}

impl DispatchTarget for LocalTarget {
    fn read(&self) -> BoxFuture<'_, Option<Reading>> {
        // A few atomic loads per group: always readable.
        let load = self.server.load_figures();
        let reading = Reading {
            cur_sys: load.in_batches as f64,
            cur_q: load.queued as f64,
            max_sys: load.capacity as f64,
            taken: std::time::Instant::now(),
        };
        Box::pin(std::future::ready(Some(reading)))
    }

    fn dispatch(&self, job: ClaimedJob) -> BoxFuture<'static, Dispatched> {
        let server = self.server.clone();
        Box::pin(async move { run(&server, job).await })
    }
}

/// Sets the request's `priority` to `level`, whatever the job asked: a job never
/// runs above realtime.
fn lowest_priority(request: &mut InferRequest, level: u32) {
    request
        .parameters
        .retain(|p| !p.key.as_str().eq_ignore_ascii_case("priority"));
    request.parameters.push(Param {
        key: "priority".into(),
        value: ParamValue::Int(i64::from(level)),
    });
}

/// Whether `e` says the target has no room now (the job did not run).
fn overloaded(e: &ServerError) -> bool {
    matches!(e, ServerError::QueueFull { .. } | ServerError::Exhausted(_))
}

/// Whether `e` says the job could not run now, to be tried later.
fn unavailable(e: &ServerError) -> bool {
    matches!(e, ServerError::Unavailable(_))
}

async fn run(server: &Server, job: ClaimedJob) -> Dispatched {
    let group = match server.lookup(&job.model, None) {
        Ok(group) => group,
        // Not loaded (any more): the job fails rather than waiting for a model
        // that may never come.
        Err(e) => return Dispatched::Ran(Outcome::Failed(e.to_string())),
    };
    let mut request = match decode_request(&job.model, &job.request) {
        Ok(request) => request,
        Err(e) => return Dispatched::Ran(Outcome::Failed(e.to_string())),
    };
    lowest_priority(&mut request, group.lowest_priority());
    // Jobs are not traced: a job's request is not a client's call.
    let mut call = match Call::start(group, Ok((request, ())), Trace::default()) {
        Ok((call, ())) => call,
        Err(e) if overloaded(&e) => return Dispatched::Overloaded,
        Err(e) if unavailable(&e) || matches!(e, ServerError::NotFound(_)) => {
            return Dispatched::Unavailable(e.to_string())
        }
        Err(e) => return Dispatched::Ran(Outcome::Failed(e.to_string())),
    };
    let answered = call.answer().await;
    match answered.and_then(|response| call.end(Ok(encode_response(&response)))) {
        Ok(encoded) => Dispatched::Ran(Outcome::Done(encoded)),
        Err(e) if overloaded(&e) => Dispatched::Overloaded,
        Err(e) if unavailable(&e) => Dispatched::Unavailable(e.to_string()),
        Err(e) => Dispatched::Ran(Outcome::Failed(e.to_string())),
    }
}
