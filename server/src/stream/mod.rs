//! WebSocket streams (docs/websocket.md): `GET /v2/models/{m}[/versions/{v}]/stream`
//! upgrades to a WebSocket (actix-ws) over which a client streams frames, or names
//! a server-side source, and gets each frame's result back.
//!
//! Each frame is one request through the core's one inference path
//! ([`kiln_core::request::serve::submit`], as REST and gRPC): frames of every session share
//! the model's batches. Modules:
//!
//! ```text
//! args.rs        the --stream-* flags
//! mod.rs         the route's handler: lookup done by the model route, the session
//!                bound, the upgrade; StreamConfig (the operator's settings)
//! protocol.rs    the opening message (Open), the raw-frame header, close codes
//! session.rs     a session's task: reading messages, flow control, results in order
//! frame.rs       one frame's way: decode → pre-process → submit → await → post-process → encode
//! queue.rs       DropQueue: bounded, drops its oldest item when full
//! result.rs      the messages kiln sends (results, errors, events)
//! source.rs      FrameSource / SourceOpener: the hook for server-side sources
//! processing.rs  Processing: per-session pre/post-processing hook
//! image.rs       JPEG/PNG decoding to RGB (reserved from the budget first), JPEG encoding
//! held.rs        bytes that hold their reservation until dropped
//! ```
//!
//! What a session makes kiln hold is reserved from the server's client-bytes
//! budget (`--max-client-bytes`) before it is allocated: frames waiting (their
//! message), decoded pixels (from the image header, before decoding), results
//! waiting to be sent; a frame beyond it is dropped (reason `memory`).

mod args;
mod frame;
mod held;
pub mod image;
pub mod processing;
pub mod protocol;
pub mod queue;
pub mod result;
mod session;
pub mod source;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::json;

pub use args::StreamArgs;
use kiln_core::models::Served;
use kiln_core::server::Server;
use source::SourceOpener;

/// The operator's settings for WebSocket streams (`--stream-*` flags).
#[derive(Clone)]
pub struct StreamConfig {
    /// Open sessions at most, server-wide (429 beyond).
    pub max_sessions: usize,
    /// The largest `max_inflight_frames` a session may ask.
    pub max_inflight_frames: usize,
    /// The largest message a client may send (close 1009 beyond).
    pub max_message_bytes: usize,
    /// How long a session may be idle (no message, nothing in flight).
    pub idle_timeout: Duration,
    /// How long after the upgrade the opening message may take (1001 beyond).
    pub open_timeout: Duration,
    /// Upgrades whose opening message has not come yet, at most (429 beyond).
    pub max_opening: usize,
    /// The largest result message kiln sends (a frame error instead beyond).
    pub max_result_bytes: usize,
    /// How long a client may leave its results unread before it is closed.
    pub write_timeout: Duration,
    /// Opens server-side sources (`"source"`); `None`: they are refused.
    pub sources: Option<Arc<dyn SourceOpener>>,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            max_sessions: 256,
            max_inflight_frames: 16,
            max_message_bytes: 16 << 20,
            idle_timeout: Duration::from_secs(60),
            open_timeout: Duration::from_secs(5),
            max_opening: 16,
            max_result_bytes: 16 << 20,
            write_timeout: Duration::from_secs(10),
            sources: None,
        }
    }
}

impl std::fmt::Debug for StreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConfig")
            .field("max_sessions", &self.max_sessions)
            .field("max_inflight_frames", &self.max_inflight_frames)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("idle_timeout", &self.idle_timeout)
            .field("open_timeout", &self.open_timeout)
            .field("max_opening", &self.max_opening)
            .field("max_result_bytes", &self.max_result_bytes)
            .field("write_timeout", &self.write_timeout)
            .field("sources", &self.sources.is_some())
            .finish()
    }
}

/// The streams' shared state: the settings and the open sessions.
pub struct Streams {
    pub config: StreamConfig,
    open: AtomicUsize,
    opening: AtomicUsize,
    next_key: AtomicU64,
}

impl Streams {
    /// No session open yet.
    pub fn new(config: StreamConfig) -> Streams {
        Streams {
            config,
            open: AtomicUsize::new(0),
            opening: AtomicUsize::new(0),
            next_key: AtomicU64::new(1),
        }
    }

    /// A place for one more session, or `None` at `max_sessions`.
    fn admit(self: &Arc<Self>) -> Option<SessionSlot> {
        take(&self.open, self.config.max_sessions).then(|| SessionSlot(Arc::clone(self)))
    }

    /// A place for one more upgrade not yet opened, or `None` at `max_opening`.
    fn admit_opening(self: &Arc<Self>) -> Option<OpeningSlot> {
        take(&self.opening, self.config.max_opening).then(|| OpeningSlot(Arc::clone(self)))
    }

    /// A session key kiln makes (`s1`, `s2`, ...) for a client that gives none.
    fn key(&self) -> String {
        format!("s{}", self.next_key.fetch_add(1, Ordering::Relaxed))
    }
}

/// One more of `count`, unless it is at `max`.
fn take(count: &AtomicUsize, max: usize) -> bool {
    count
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .is_ok()
}

/// A session's place among `max_sessions`, given back on drop.
struct SessionSlot(Arc<Streams>);

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An upgrade's place among `max_opening` until its opening message, given
/// back on drop: upgrades that never open hold a few places for a few seconds,
/// not every session's.
pub(crate) struct OpeningSlot(Arc<Streams>);

impl Drop for OpeningSlot {
    fn drop(&mut self) {
        self.0.opening.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `GET .../stream` for `group` (looked up by the model route): upgrades to a
/// WebSocket and starts the session's task on this actix-web worker thread. An
/// error is answered as the REST routes answer theirs (`http/error.rs`).
/// `socket` is a copy of the connection's descriptor (the HTTP layer's), which
/// the session shuts down when its client stops reading.
pub async fn open(
    server: &Server,
    streams: &Arc<Streams>,
    req: &HttpRequest,
    payload: web::Payload,
    group: Served,
    socket: Option<std::os::fd::OwnedFd>,
) -> Result<HttpResponse, kiln_core::ServerError> {
    let (response, ws, messages) = match actix_ws::handle(req, payload) {
        Ok(upgrade) => upgrade,
        Err(e) => {
            let status = e.error_response().status();
            return Ok(HttpResponse::build(status).json(json!({"error": e.to_string()})));
        }
    };
    let Some(opening) = streams.admit_opening() else {
        return Err(kiln_core::ServerError::Exhausted(format!(
            "{} WebSocket sessions are waiting for their opening message: the \
             server's --stream-max-opening",
            streams.config.max_opening
        )));
    };
    let Some(slot) = streams.admit() else {
        return Err(kiln_core::ServerError::Exhausted(format!(
            "{} WebSocket sessions are open: the server's --stream-max-sessions",
            streams.config.max_sessions
        )));
    };
    let max = streams.config.max_message_bytes;
    let messages = messages
        .max_frame_size(max)
        .aggregate_continuations()
        .max_continuation_size(max);
    let session = session::Session::new(server.clone(), Arc::clone(streams), group, socket);
    actix_web::rt::spawn(async move {
        session.run(ws, messages, opening).await;
        drop(slot);
    });
    Ok(response)
}
