//! The video page (`GET /ui/video`): one HTML page, its script and its style,
//! built into the binary (no npm step, nothing fetched from elsewhere). The page
//! streams frames over the WebSocket (`/v2/models/{model}/stream`,
//! docs/websocket.md) and shows each frame's result, frames per second, latency and
//! dropped frames. Everything it does goes through the public REST and WebSocket
//! APIs: the server adds nothing for it but these three files.

use actix_web::http::header::{self, HeaderValue};
use actix_web::HttpResponse;

/// The page's HTML.
const PAGE: &str = include_str!("video.html");
/// The page's script.
const SCRIPT: &str = include_str!("video.js");
/// The page's style.
const STYLE: &str = include_str!("video.css");

/// What the page may load and connect to: its own files, the frames it makes
/// (`blob:`), the camera (`mediastream:`), and this server's REST and WebSocket
/// routes. No inline script, nothing from another origin.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' blob: data:; media-src 'self' blob: mediastream:; connect-src 'self'; \
     base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// `GET /ui/video`: the page.
pub async fn video_page() -> HttpResponse {
    asset(PAGE, "text/html; charset=utf-8")
}

/// `GET /ui/video.js`: the page's script.
pub async fn video_script() -> HttpResponse {
    asset(SCRIPT, "text/javascript; charset=utf-8")
}

/// `GET /ui/video.css`: the page's style.
pub async fn video_style() -> HttpResponse {
    asset(STYLE, "text/css; charset=utf-8")
}

fn asset(body: &'static str, content_type: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, HeaderValue::from_static(content_type)))
        // The files change with the binary: a browser asks again (and gets the
        // same bytes) rather than mixing an old script with a new page.
        .insert_header((header::CACHE_CONTROL, HeaderValue::from_static("no-cache")))
        .insert_header((
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ))
        .insert_header((
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ))
        .body(body)
}
