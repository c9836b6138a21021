//! REST over actix-web: KServe v2 core (health, metadata, infer), Triton's
//! extensions (model configuration, statistics, model repository, system shared
//! memory), kiln's worker API (load/unload), and Prometheus `/metrics`. Every error
//! is answered as `{"error": "..."}` with the status [`status_code`] gives
//! (`http/error.rs`, the one table of HTTP statuses).
//! Every route, the WebSocket upgrade and the `/ui` page included, sits behind
//! the one browser policy (`http/origin.rs`).

mod body;
mod compress;
mod encoded;
mod error;
mod jobs;
mod logging;
mod model_routes;
mod offload;
pub mod origin;
mod peer;
mod restricted;
mod routes;
mod shm_routes;
mod trace;
mod triton;

use std::net::SocketAddr;

use actix_web::{web, App, HttpServer};

use kiln_core::server::Server;

pub use error::{status_code, HttpError, HttpResult};
pub use kiln_protocol::http::{
    decode_request, decode_request_binary, decode_request_shm, decode_response,
    decode_response_binary, encode_request, encode_request_binary, encode_response,
    encode_response_binary, encode_response_shm, params_from_json, BinaryOutputs, Encoded,
    INFERENCE_HEADER_CONTENT_LENGTH,
};

/// Where each output of a response goes ([`kiln_protocol::http::OutputPlacement`]
/// over this server's shared memory).
pub type OutputPlacement =
    kiln_protocol::http::OutputPlacement<kiln_core::memory::shared_memory::ShmSlice>;

/// How to serve HTTP.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub addr: SocketAddr,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// actix-web worker threads.
    pub workers: usize,
    /// Whether the worker threads run under `SCHED_BATCH` ([`kiln_core::system::sched`]).
    pub sched_batch: bool,
    /// Open connections at most, shared out among the workers. At the cap the
    /// workers stop accepting: new connections wait in the listen backlog (no
    /// descriptor of kiln's) until a connection closes, which an idle one does
    /// after actix-web's keep-alive (5 s) and request-head (5 s) timeouts.
    pub max_connections: usize,
    /// TLS ([`crate::tls`]); `None`: plain HTTP.
    pub tls: Option<rustls::ServerConfig>,
    /// WebSocket streams ([`crate::stream`]) on the same port.
    pub stream: crate::stream::StreamConfig,
    /// The job store and dispatcher (`None`: the job routes answer 503).
    pub jobs: Option<std::sync::Arc<crate::jobs::Jobs>>,
    /// The browser policy: origins allowed beyond kiln's own ([`origin`]).
    pub origins: origin::OriginPolicy,
    /// The restricted APIs (`--http-restricted-api`; empty: none).
    pub restricted: std::sync::Arc<crate::restricted::Restrictions>,
}

/// Shared by every handler.
pub struct State {
    pub server: Server,
    pub max_body_bytes: usize,
    /// The WebSocket streams' settings and open sessions.
    pub streams: std::sync::Arc<crate::stream::Streams>,
    pub jobs: Option<std::sync::Arc<crate::jobs::Jobs>>,
    /// The restricted APIs ([`HttpConfig::restricted`]).
    pub restrictions: std::sync::Arc<crate::restricted::Restrictions>,
}

/// Binds and returns the running HTTP server (await it) and the bound addresses.
pub fn serve(
    server: Server,
    config: HttpConfig,
) -> std::io::Result<(actix_web::dev::Server, Vec<SocketAddr>)> {
    let restrictions = config.restricted;
    let state = web::Data::new(State {
        server,
        max_body_bytes: config.max_body_bytes,
        streams: std::sync::Arc::new(crate::stream::Streams::new(config.stream)),
        jobs: config.jobs.clone(),
        restrictions: std::sync::Arc::clone(&restrictions),
    });
    let sched_batch = config.sched_batch;
    let origins = std::sync::Arc::new(config.origins);
    // actix-web calls this once on each worker thread as it starts.
    let http = HttpServer::new(move || {
        if sched_batch {
            kiln_core::system::sched::serving_thread();
        }
        App::new()
            .wrap(origin::Origins(std::sync::Arc::clone(&origins)))
            .app_data(state.clone())
            .configure(|cfg| routes::configure(cfg, &restrictions))
            .default_service(web::to(routes::not_found))
    })
    .on_connect(peer::on_connect)
    // The binary handles SIGTERM and SIGINT itself (`crate::drain`): the listener
    // stays open while the server drains, so probes see 503, not a refusal.
    .disable_signals()
    .workers(config.workers.max(1))
    .max_connections(
        config
            .max_connections
            .div_ceil(config.workers.max(1))
            .max(1),
    );
    let http = match config.tls {
        Some(tls) => http.bind_rustls_0_23(config.addr, tls)?,
        None => http.bind(config.addr)?,
    };
    let addrs = http.addrs();
    Ok((http.run(), addrs))
}
