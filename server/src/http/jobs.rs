//! The job routes (docs/jobs.md), category `inference` but for the listing,
//! category `jobs-admin` (closed unless the operator restricts it to a header):
//!
//! ```text
//! POST   /v2/models/{m}/jobs[?priority=N]  submit: one request, an array, JSON lines → 202 {"ids": [...]}
//! GET    /v2/jobs[?model=&state=&limit=&after=]  a page of jobs, in submission order (jobs-admin)
//! GET    /v2/jobs/{id}                     one job, with its response or error
//! DELETE /v2/jobs/{id}                     cancel a queued job (also POST /v2/jobs/{id}/cancel)
//! ```
//!
//! A submission is split as it arrives ([`kiln_jobs::split`]), each request
//! decoded and checked against the model as every inference is
//! ([`kiln_core::models::Served::check`]) and spooled; once the body is read
//! whole and every request passed, all are stored in one durable write
//! (fsync'd) and only then answered 202. Any bad request: 400 naming its index,
//! nothing stored. The store's calls run on actix's blocking pool.
//!
//! Bounds (docs/security.md, "Jobs"): a submission's body is at most
//! `--jobs-max-submission-bytes` (default `--max-body-bytes`) and
//! `--jobs-max-per-submission` jobs (413), its bytes reserved from the
//! client-bytes budget as they arrive (`job_submission`, 429); the store holds at
//! most `--jobs-max-stored` jobs (429 at once). A job's record is sent as
//! stored: its response bytes are spliced into the JSON, not parsed into values,
//! built on the blocking pool and reserved (`job_result`) before the store reads
//! them (it learns their length first) until sent.

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, MessageBody};
use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use kiln_core::memory::client_bytes::{Reservation, Use};
use kiln_jobs::queue::{PRIORITY_DEFAULT, PRIORITY_HIGHEST, PRIORITY_LOWEST};
use kiln_jobs::split::{SplitError, Splitter};
use kiln_jobs::spool::Spool;
use kiln_jobs::{CancelResult, Job, JobId, JobQueue, JobState, JobsError, ListFilter};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{restricted, HttpError, HttpResult, State};
use crate::jobs::{server_error, Jobs};
use crate::restricted::{Category, Restrictions};
use kiln_core::error::ServerError;
use kiln_core::models::Served;

/// Most jobs one listing page shows.
pub const MAX_PAGE: usize = 1000;

impl From<SplitError> for HttpError {
    fn from(e: SplitError) -> Self {
        HttpError(ServerError::InvalidRequest(e.to_string()))
    }
}

/// Registers the routes under `/v2/jobs` (the submission is a model route).
pub fn configure(cfg: &mut web::ServiceConfig, restrictions: &Restrictions) {
    let listing = web::resource("/v2/jobs");
    match restrictions.get(Category::JobsAdmin) {
        Some(_) => restricted::add(
            cfg,
            restrictions,
            Category::JobsAdmin,
            listing.route(web::get().to(list)),
        ),
        None => {
            cfg.service(listing.route(web::get().to(list_closed)));
        }
    }
    let mut add = |resource| restricted::add(cfg, restrictions, Category::Inference, resource);
    add(web::resource("/v2/jobs/{id}")
        .route(web::get().to(get))
        .route(web::delete().to(cancel)));
    add(web::resource("/v2/jobs/{id}/cancel").route(web::post().to(cancel)));
}

fn jobs(state: &State) -> Result<&std::sync::Arc<Jobs>, HttpError> {
    state
        .jobs
        .as_ref()
        .ok_or_else(|| HttpError(ServerError::Unavailable("jobs are not enabled".into())))
}

/// Runs a store call on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, kiln_jobs::JobsError> + Send + 'static,
) -> Result<T, HttpError> {
    web::block(f)
        .await
        .map_err(|e| {
            HttpError(ServerError::Internal(format!(
                "the job store's thread: {e}"
            )))
        })?
        .map_err(|e| HttpError(server_error(e)))
}

/// The store, or `None` before the first submission opened it.
async fn opened(
    state: &State,
    create: bool,
) -> Result<Option<std::sync::Arc<dyn JobQueue>>, HttpError> {
    let jobs = jobs(state)?.clone();
    blocking(move || jobs.queue(create)).await
}

#[derive(Deserialize)]
struct SubmitQuery {
    priority: Option<u8>,
}

/// `POST /v2/models/{m}/jobs`.
pub async fn submit(
    state: &State,
    req: &HttpRequest,
    mut payload: web::Payload,
    group: &Served,
) -> HttpResult {
    let query = web::Query::<SubmitQuery>::from_query(req.query_string())
        .map_err(|e| HttpError(ServerError::invalid(format!("bad query: {e}"))))?;
    let priority = query.priority.unwrap_or(PRIORITY_DEFAULT);
    if !(PRIORITY_HIGHEST..=PRIORITY_LOWEST).contains(&priority) {
        return Err(HttpError(ServerError::invalid(format!(
            "priority must be {PRIORITY_HIGHEST} (first) to {PRIORITY_LOWEST}, got {priority}"
        ))));
    }
    if let Some(encoding) = req.headers().get(actix_web::http::header::CONTENT_ENCODING) {
        if encoding.as_bytes() != b"identity" {
            return Err(HttpError(ServerError::invalid(
                "a job submission is read as it arrives: send it without Content-Encoding",
            )));
        }
    }
    let jobs = jobs(state)?.clone();
    let limits = jobs.limits();
    let max_bytes = limits.max_submission_bytes.unwrap_or(state.max_body_bytes);
    let too_large = || {
        HttpError(ServerError::TooLarge(format!(
            "a job submission is at most {max_bytes} bytes (--jobs-max-submission-bytes)"
        )))
    };
    let declared = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|n| n > max_bytes) {
        return Err(too_large());
    }
    // A full store refuses at once, before the body is read.
    let quota = jobs.clone();
    blocking(move || match quota.queue(true)? {
        Some(queue) => quota.check_quota(&*queue, 1),
        None => Err(JobsError::Store("the store did not open".into())),
    })
    .await?;
    let max_jobs = limits.max_per_submission;
    let mut held = state.server.client_bytes().empty(Use::JobSubmission);
    let mut read = 0usize;
    let mut splitter = Splitter::new(state.max_body_bytes.min(max_bytes));
    let mut spool = Spool::new(&jobs.spool_dir());
    let mut check = |index: usize, bytes: &[u8]| -> Result<(), HttpError> {
        if index >= max_jobs {
            return Err(HttpError(ServerError::TooLarge(format!(
                "a job submission carries at most {max_jobs} jobs (--jobs-max-per-submission)"
            ))));
        }
        let at = |e: &dyn std::fmt::Display| {
            HttpError(ServerError::invalid(format!("request {index}: {e}")))
        };
        let request = kiln_protocol::http::json::decode_request(group.endpoint(), bytes)
            .map_err(|e| at(&e))?;
        group.check(&request).map_err(|e| at(&e))?;
        spool.push(bytes).map_err(|e| HttpError(server_error(e)))
    };
    while let Some(chunk) = std::future::poll_fn(|cx| {
        futures_core::Stream::poll_next(std::pin::Pin::new(&mut payload), cx)
    })
    .await
    {
        let chunk = chunk.map_err(|e| {
            HttpError(ServerError::invalid(format!(
                "cannot read the request body: {e}"
            )))
        })?;
        // Counted before it is held: the body read so far (spooled or not) stays
        // reserved until the store has taken it.
        read = read.saturating_add(chunk.len());
        if read > max_bytes {
            return Err(too_large());
        }
        held.grow_to(read).map_err(|e| HttpError(e.into()))?;
        splitter.push(&chunk, &mut check)?;
    }
    splitter.finish()?;
    let model = group.endpoint().to_owned();
    let ids = blocking(move || {
        let _held = held;
        let Some(queue) = jobs.queue(true)? else {
            return Err(JobsError::Store("the store did not open".into()));
        };
        jobs.check_quota(&*queue, spool.len() as u64)?;
        queue.enqueue(&mut spool.into_jobs(model, priority)?)
    })
    .await?;
    Ok(HttpResponse::Accepted().json(json!({ "ids": ids })))
}

/// A job's fields but its response, as JSON.
fn job_json(job: &Job) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("id".into(), json!(job.id));
    out.insert("model".into(), json!(job.model));
    out.insert("state".into(), json!(job.state.as_str()));
    out.insert("priority".into(), json!(job.priority));
    out.insert("attempts".into(), json!(job.attempts));
    out.insert("submitted_ms".into(), json!(job.submitted_ms));
    if let Some(at) = job.finished_ms {
        out.insert("finished_ms".into(), json!(at));
    }
    if let Some(error) = &job.error {
        out.insert("error".into(), json!(error));
    }
    out
}

/// A job and its response as the JSON body: the stored response bytes are
/// spliced in as they are when they are one JSON value (checked by a scan that
/// builds nothing, `IgnoredAny`), else sent as a JSON string. Parsing a 7.6 MiB
/// response into `Value`s cost ~138 MiB per read (issue 27, finding 10).
fn job_body(mut job: Job) -> Vec<u8> {
    let response = job.response.take();
    let head = Value::Object(job_json(&job)).to_string();
    let mut out = Vec::with_capacity(head.len() + response.as_ref().map_or(0, |r| r.len() + 16));
    out.extend_from_slice(head.as_bytes());
    if let Some(response) = response {
        out.pop(); // the head's closing `}`
        out.extend_from_slice(b",\"response\":");
        if serde_json::from_slice::<serde::de::IgnoredAny>(&response).is_ok() {
            out.extend_from_slice(&response);
        } else {
            let text = Value::String(String::from_utf8_lossy(&response).into_owned());
            out.extend_from_slice(text.to_string().as_bytes());
        }
        out.push(b'}');
    }
    out
}

/// A response body that keeps its bytes reserved until it is sent (or dropped).
struct HeldBody {
    bytes: Option<Bytes>,
    len: u64,
    _held: Reservation,
}

impl MessageBody for HeldBody {
    type Error = std::convert::Infallible;

    fn size(&self) -> BodySize {
        BodySize::Sized(self.len)
    }

    fn poll_next(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Poll::Ready(self.get_mut().bytes.take().map(Ok))
    }
}

fn no_job(id: &str) -> HttpError {
    HttpError(ServerError::NotFound(format!("no job `{id}`")))
}

/// `GET /v2/jobs/{id}`.
async fn get(state: web::Data<State>, id: web::Path<String>) -> HttpResult {
    let id = JobId(id.into_inner());
    let Some(queue) = opened(&state, false).await? else {
        return Err(no_job(&id.0));
    };
    let lookup = id.clone();
    let budget = state.server.client_bytes().clone();
    let found = blocking(move || {
        // The stored copy and the body built from it, reserved before the
        // store reads it (the store learns its length first), until sent.
        let mut held = budget.empty(Use::JobResult);
        let mut admit = |len: usize| {
            held.grow_to(len.saturating_mul(2))
                .map_err(|e| JobsError::Full(ServerError::from(e).to_string()))
        };
        let Some(job) = queue.get_admitted(&lookup, &mut admit)? else {
            return Ok(None);
        };
        Ok(Some((job_body(job), held)))
    })
    .await?;
    match found {
        Some((body, held)) => {
            Ok(HttpResponse::Ok()
                .content_type("application/json")
                .body(HeldBody {
                    len: body.len() as u64,
                    bytes: Some(Bytes::from(body)),
                    _held: held,
                }))
        }
        None => Err(no_job(&id.0)),
    }
}

/// `GET /v2/jobs` while the operator has not opened `jobs-admin`.
async fn list_closed() -> HttpResult {
    Err(HttpError(ServerError::Restricted(
        "listing jobs is an operator's act: it needs --http-restricted-api \
         jobs-admin:KEY=VALUE and that header"
            .into(),
    )))
}

#[derive(Deserialize)]
struct ListQuery {
    model: Option<String>,
    state: Option<String>,
    limit: Option<usize>,
    after: Option<String>,
}

/// `GET /v2/jobs`.
async fn list(state: web::Data<State>, req: HttpRequest) -> HttpResult {
    let query = web::Query::<ListQuery>::from_query(req.query_string())
        .map_err(|e| HttpError(ServerError::invalid(format!("bad query: {e}"))))?
        .into_inner();
    let job_state = match query.state.as_deref() {
        None => None,
        Some(name) => Some(JobState::parse(name).ok_or_else(|| {
            HttpError(ServerError::invalid(format!(
                "unknown state `{name}`: queued, running, done, failed or cancelled"
            )))
        })?),
    };
    let limit = query.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(HttpError(ServerError::invalid(format!(
            "limit must be 1 to {MAX_PAGE}, got {limit}"
        ))));
    }
    let Some(queue) = opened(&state, false).await? else {
        return Ok(HttpResponse::Ok().json(json!({"jobs": [], "next": null})));
    };
    let filter = ListFilter {
        model: query.model,
        state: job_state,
    };
    let after = query.after;
    let page = blocking(move || queue.list(&filter, after.as_deref(), limit)).await?;
    let jobs: Vec<Value> = page
        .jobs
        .iter()
        .map(|job| Value::Object(job_json(job)))
        .collect();
    Ok(HttpResponse::Ok().json(json!({"jobs": jobs, "next": page.next})))
}

/// `DELETE /v2/jobs/{id}`, `POST /v2/jobs/{id}/cancel`.
async fn cancel(state: web::Data<State>, id: web::Path<String>) -> HttpResult {
    let id = JobId(id.into_inner());
    let Some(queue) = opened(&state, false).await? else {
        return Err(no_job(&id.0));
    };
    let target = id.clone();
    match blocking(move || queue.cancel(&target)).await? {
        CancelResult::Cancelled => {
            Ok(HttpResponse::Ok().json(json!({"id": id, "state": "cancelled"})))
        }
        CancelResult::NotQueued(s) => Err(HttpError(ServerError::Conflict(format!(
            "job `{id}` is {}: only a queued job can be cancelled",
            s.as_str()
        )))),
        CancelResult::NotFound => Err(no_job(&id.0)),
    }
}
