//! The REST routes.

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use kiln_protocol::http::load_params_from_json;
use serde_json::{json, Map, Value};

use super::body::EncodedResponse;
use super::model_routes::{self, Action};
use super::{offload, restricted, shm, triton, HttpError, INFERENCE_HEADER_CONTENT_LENGTH};
use crate::error::ServerError;
use crate::group::WorkerGroup;
use crate::infer::expected_shape;
use crate::restricted::{Category, Restrictions};
use crate::server::Server;

/// Shared by every handler.
pub struct State {
    pub server: Server,
    pub max_body_bytes: usize,
}

type Reply = Result<HttpResponse, HttpError>;

/// Registers every route, each in its Triton API category (a restricted category's
/// routes behind the check of its header, [`super::restricted`]); a known path with
/// the wrong method answers 405. The routes that name a model are matched by hand
/// behind one scope ([`model_route`], [`model_routes`]).
pub fn configure(cfg: &mut web::ServiceConfig, restrictions: &Restrictions) {
    use Category::*;
    let mut add = |category, resource| restricted::add(cfg, restrictions, category, resource);
    add(Health, get("/v2/health/live", live));
    add(Health, get("/v2/health/ready", ready));
    add(Metadata, get("/v2", server_metadata));
    add(Metadata, get("/v2/models", list_models));
    add(Statistics, get("/v2/models/stats", triton::all_stats));
    // Triton serves metrics on a port of its own, unrestricted; kiln's are on the
    // HTTP port and tell what statistics tell, so `statistics` covers them.
    add(Statistics, get("/metrics", metrics));
    // Every other path under `/v2/models/` names a model: matched by hand, with
    // each route's category checked there ([`model_route`]). Registered before
    // the routes with a `{segment}` below, each of which actix-web tries as a regex.
    cfg.service(web::scope("/v2/models").default_service(web::to(model_route)));
    let mut add = |category, resource| restricted::add(cfg, restrictions, category, resource);
    add(ModelRepository, post("/v2/workers/{worker}/load", load));
    add(
        ModelRepository,
        post("/v2/workers/{endpoint}/unload", unload),
    );
    add(
        ModelRepository,
        post("/v2/repository/index", repository_index),
    );
    add(
        ModelRepository,
        post("/v2/repository/models/{model}/load", repository_load),
    );
    add(
        ModelRepository,
        post("/v2/repository/models/{model}/unload", repository_unload),
    );
    add(
        SharedMemory,
        get("/v2/systemsharedmemory/status", shm::status_all),
    );
    add(
        SharedMemory,
        get(
            "/v2/systemsharedmemory/region/{region}/status",
            shm::status_region,
        ),
    );
    add(
        SharedMemory,
        post(
            "/v2/systemsharedmemory/region/{region}/register",
            shm::register,
        ),
    );
    add(
        SharedMemory,
        post(
            "/v2/systemsharedmemory/region/{region}/unregister",
            shm::unregister,
        ),
    );
    add(
        SharedMemory,
        post("/v2/systemsharedmemory/unregister", shm::unregister_all),
    );
}

fn get<F, Args>(path: &str, handler: F) -> actix_web::Resource
where
    F: actix_web::Handler<Args>,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    web::resource(path)
        .route(web::get().to(handler))
        .default_service(web::to(method_not_allowed))
}

fn post<F, Args>(path: &str, handler: F) -> actix_web::Resource
where
    F: actix_web::Handler<Args>,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    web::resource(path)
        .route(web::post().to(handler))
        .default_service(web::to(method_not_allowed))
}

pub async fn not_found(req: HttpRequest) -> Reply {
    Err(no_route(&req))
}

fn no_route(req: &HttpRequest) -> HttpError {
    HttpError(ServerError::NotFound(format!(
        "no route for {} {}",
        req.method(),
        req.path()
    )))
}

async fn method_not_allowed(req: HttpRequest) -> HttpResponse {
    wrong_method(&req)
}

fn wrong_method(req: &HttpRequest) -> HttpResponse {
    HttpResponse::MethodNotAllowed().json(json!({
        "error": format!("{} is not allowed on {}", req.method(), req.path())
    }))
}

/// A path under `/v2/models/` ([`model_routes`]): 404 unless it names a model
/// route; then, as for a route registered with actix-web, 403 when its category
/// is restricted and the header is missing, 405 for another method; then the
/// model's lookup (404) and the route's handler.
async fn model_route(state: web::Data<State>, req: HttpRequest, payload: web::Payload) -> Reply {
    let Some(path) = model_routes::parse(req.match_info().as_str()) else {
        return Err(no_route(&req));
    };
    let restrictions = &state.server.restricted().http;
    restricted::check_request(restrictions, path.action.category(), &req)?;
    if req.method() != path.action.method() {
        return Ok(wrong_method(&req));
    }
    let group = crate::triton::lookup(&state.server, path.model, path.version)?;
    match path.action {
        Action::Metadata => Ok(model_metadata(&group)),
        Action::Ready => Ok(model_ready(&group)),
        Action::Config => Ok(triton::config(&group)),
        Action::Stats => Ok(triton::model_stats(&group)),
        Action::Infer => infer(&state, &req, payload, &group).await,
    }
}

async fn live() -> HttpResponse {
    HttpResponse::Ok().finish()
}

async fn ready(state: web::Data<State>) -> HttpResponse {
    if state.server.is_ready() {
        HttpResponse::Ok().finish()
    } else {
        HttpResponse::ServiceUnavailable().json(json!({"error": "the server is not ready"}))
    }
}

async fn server_metadata() -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "name": crate::triton::SERVER_NAME,
        "version": crate::triton::SERVER_VERSION,
        "extensions": crate::triton::EXTENSIONS,
    }))
}

async fn list_models(state: web::Data<State>) -> HttpResponse {
    let models: Vec<Value> = state
        .server
        .models()
        .iter()
        .map(|g| json!({"name": g.endpoint, "version": g.version, "worker": g.worker, "state": if g.is_ready() {"READY"} else {"UNAVAILABLE"}}))
        .collect();
    HttpResponse::Ok().json(json!({ "models": models }))
}

fn model_metadata(group: &WorkerGroup) -> HttpResponse {
    let batching = group.info.max_batch_size > 0;
    let tensors = |specs: &[kiln_worker_sdk::TensorSpec]| -> Vec<Value> {
        specs
            .iter()
            .map(|s| json!({"name": s.name.as_str(), "datatype": s.dtype.as_str(), "shape": expected_shape(s, batching)}))
            .collect()
    };
    HttpResponse::Ok().json(json!({
        "name": group.endpoint,
        "versions": [group.version],
        "platform": crate::triton::platform(&group.worker),
        "inputs": tensors(&group.info.inputs),
        "outputs": tensors(&group.info.outputs),
        "parameters": {
            "max_batch_size": group.info.max_batch_size,
            "batch_size": group.settings.batch_size,
            "batcher": group.settings.batcher.as_str(),
            "instances": group.instance_count(),
        },
    }))
}

fn model_ready(group: &WorkerGroup) -> HttpResponse {
    if group.is_ready() {
        HttpResponse::Ok().finish()
    } else {
        HttpResponse::ServiceUnavailable()
            .json(json!({"error": format!("model `{}` is not ready", group.endpoint)}))
    }
}

/// Reads a control request's whole body (not compressed), up to `limit` bytes.
async fn read_raw_body(payload: web::Payload, limit: usize) -> Result<Bytes, HttpError> {
    match payload.to_bytes_limited(limit).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(e)) => Err(HttpError(ServerError::invalid(format!(
            "cannot read the request body: {e}"
        )))),
        Err(_) => Err(HttpError(ServerError::TooLarge(format!(
            "request body exceeds the limit of {limit} bytes"
        )))),
    }
}

/// Reads an inference request's whole body, up to `limit` bytes (413 beyond). A body sent with
/// `Content-Encoding: gzip` or `deflate` (tritonclient's request compression) is
/// decoded first, and the limit applies to what it decodes to.
async fn read_body(
    req: &HttpRequest,
    payload: web::Payload,
    limit: usize,
) -> Result<Bytes, HttpError> {
    let encoding = req
        .headers()
        .get(actix_web::http::header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase());
    let too_large = || {
        HttpError(ServerError::TooLarge(format!(
            "request body exceeds the limit of {limit} bytes"
        )))
    };
    let unreadable = |e: &dyn std::fmt::Display| {
        HttpError(ServerError::invalid(format!(
            "cannot read the request body: {e}"
        )))
    };
    match encoding.as_deref() {
        None | Some("identity") => read_raw_body(payload, limit).await,
        Some("gzip" | "x-gzip" | "deflate") => {
            let mut stream =
                actix_web::dev::Decompress::from_headers(payload.into_inner(), req.headers());
            let mut body = bytes::BytesMut::new();
            while let Some(chunk) = std::future::poll_fn(|cx| {
                futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)
            })
            .await
            {
                let chunk = chunk.map_err(|e| unreadable(&e))?;
                if body.len() + chunk.len() > limit {
                    return Err(too_large());
                }
                body.extend_from_slice(&chunk);
            }
            Ok(body.freeze())
        }
        Some(other) => Err(HttpError(ServerError::invalid(format!(
            "Content-Encoding `{other}` is not supported (gzip, deflate or identity)"
        )))),
    }
}

async fn infer(
    state: &State,
    req: &HttpRequest,
    payload: web::Payload,
    group: &WorkerGroup,
) -> Reply {
    let body = read_body(req, payload, state.max_body_bytes).await?;
    let header = req.headers().get(INFERENCE_HEADER_CONTENT_LENGTH);
    let (request, placement) = offload::decode_request(
        &state.server,
        &group.endpoint,
        body,
        header.map(|v| v.as_bytes()),
    )
    .await
    .inspect_err(|_| group.record_invalid())?;
    let reply = group.submit(request)?;
    let answer = match req.conn_data::<super::peer::Peer>() {
        // Returning drops the reply channel: a queued request is then cancelled.
        Some(peer) => tokio::select! {
            answer = reply => answer,
            () = peer.closed(req.version()) => {
                return Err(HttpError(ServerError::Unavailable("the client went away".into())))
            }
        },
        None => reply.await,
    };
    let response = answer.map_err(|_| {
        HttpError(ServerError::Internal(
            "the worker dropped the request".into(),
        ))
    })??;
    let encoded = offload::encode_response(response, placement).await?;
    match super::compress::negotiate(req) {
        None => Ok(encoded.into_response()),
        Some(encoding) => Ok(super::compress::respond(encoded, encoding).await?),
    }
}

async fn load(state: web::Data<State>, path: web::Path<String>, payload: web::Payload) -> Reply {
    let body = read_raw_body(payload, state.max_body_bytes).await?;
    let params = if body.iter().all(u8::is_ascii_whitespace) {
        Vec::new()
    } else {
        let map: Map<String, Value> = serde_json::from_slice(&body).map_err(|e| {
            HttpError(ServerError::invalid(format!(
                "load parameters must be a JSON object: {e}"
            )))
        })?;
        load_params_from_json(map)?
    };
    let worker = path.into_inner().to_ascii_lowercase();
    let endpoint = state
        .server
        .load_as(crate::worker_params::Origin::Client, &worker, params)
        .await?;
    Ok(HttpResponse::Ok().json(json!({ "endpoint": endpoint })))
}

async fn unload(state: web::Data<State>, path: web::Path<String>) -> Reply {
    state.server.unload(&path.into_inner()).await?;
    Ok(HttpResponse::Ok().json(json!({})))
}

/// Reads an optional JSON object body.
pub(super) async fn json_object(
    payload: web::Payload,
    limit: usize,
) -> Result<Map<String, Value>, HttpError> {
    let body = read_raw_body(payload, limit).await?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    serde_json::from_slice(&body).map_err(|e| {
        HttpError(ServerError::invalid(format!(
            "the request body must be a JSON object: {e}"
        )))
    })
}

/// Triton's repository index: every model in the repository with its state.
async fn repository_index(state: web::Data<State>, payload: web::Payload) -> Reply {
    let body = json_object(payload, state.max_body_bytes).await?;
    let only_ready = index_request(&body)?;
    // Reads the repository's folders and files: not on the connection's thread.
    let server = state.server.clone();
    let index = web::block(move || crate::triton::repository_index(&server, only_ready))
        .await
        .map_err(blocking_failed)??;
    let index: Vec<Value> = index
        .into_iter()
        .map(
            |e| json!({"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}),
        )
        .collect();
    Ok(HttpResponse::Ok().json(index))
}

/// The `ready` of a repository-index request body (`{"ready": bool}`, optional);
/// any other field, or a `ready` that is not a boolean, is a 400.
fn index_request(body: &Map<String, Value>) -> Result<bool, HttpError> {
    if let Some(field) = body.keys().find(|k| k.as_str() != "ready") {
        return Err(HttpError(ServerError::invalid(format!(
            "unexpected field `{field}` in the repository index request (only `ready` is known)"
        ))));
    }
    match body.get("ready") {
        None => Ok(false),
        Some(Value::Bool(ready)) => Ok(*ready),
        Some(other) => Err(HttpError(ServerError::invalid(format!(
            "`ready` must be a boolean, got {other}"
        )))),
    }
}

/// Triton's repository load; `parameters` may override the model's config, and
/// `parameters.version` picks a version.
async fn repository_load(
    state: web::Data<State>,
    path: web::Path<String>,
    payload: web::Payload,
) -> Reply {
    let mut body = json_object(payload, state.max_body_bytes).await?;
    let overrides = match body.remove("parameters") {
        None => Map::new(),
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(HttpError(ServerError::invalid(format!(
                "`parameters` must be an object, got {other}"
            ))))
        }
    };
    let mut params = load_params_from_json(overrides)?;
    let version = crate::triton::take_version(&mut params)?;
    let name = path.into_inner();
    let keys = crate::worker_params::client_keys(crate::worker_params::Origin::Client, &params);
    // Reads the model's files: not on the connection's thread.
    let (server, model) = (state.server.clone(), name.clone());
    let resolved = web::block(move || server.resolve_model(&model, version, params))
        .await
        .map_err(blocking_failed)??;
    state.server.load_resolved(&name, resolved, keys).await?;
    Ok(HttpResponse::Ok().json(json!({})))
}

fn blocking_failed(e: actix_web::error::BlockingError) -> HttpError {
    HttpError(ServerError::Internal(format!(
        "a blocking task failed: {e}"
    )))
}

async fn repository_unload(state: web::Data<State>, path: web::Path<String>) -> Reply {
    state.server.unload(&path.into_inner()).await?;
    Ok(HttpResponse::Ok().json(json!({})))
}

async fn metrics(state: web::Data<State>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.server.metrics_text())
}
