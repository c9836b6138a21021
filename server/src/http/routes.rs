//! The REST routes.

use actix_web::{web, HttpRequest, HttpResponse};
use kiln_protocol::http::load_params_from_json;
use serde_json::{json, Map, Value};

use super::body::{self, json_object, read_body, read_raw_body};
use super::encoded::EncodedResponse;
use super::model_routes::{self, Action};
use super::{
    jobs, logging, offload, restricted, shm_routes, trace, triton, HttpError, HttpResult, State,
    INFERENCE_HEADER_CONTENT_LENGTH,
};
use crate::restricted::{Category, Restrictions};
use crate::ui;
use kiln_core::error::ServerError;
use kiln_core::models::Served;
use kiln_core::observe::trace::Trace;
use kiln_core::request::serve::Call;

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
    add(
        Logging,
        web::resource("/v2/logging")
            .route(web::get().to(logging::get))
            .route(web::post().to(logging::post))
            .default_service(web::to(method_not_allowed)),
    );
    add(
        Trace,
        web::resource("/v2/trace/setting")
            .route(web::get().to(trace::server_setting))
            .route(web::post().to(trace::server_setting))
            .default_service(web::to(method_not_allowed)),
    );
    // Every other path under `/v2/models/` names a model: matched by hand, with
    // each route's category checked there ([`model_route`]). Registered before
    // the routes with a `{segment}` below, each of which actix-web tries as a regex.
    cfg.service(web::scope("/v2/models").default_service(web::to(model_route)));
    jobs::configure(cfg, restrictions);
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
        ModelRepository,
        post("/v2/repository/models/{model}/scale", repository_scale),
    );
    add(
        SharedMemory,
        get("/v2/systemsharedmemory/status", shm_routes::status_all),
    );
    add(
        SharedMemory,
        get(
            "/v2/systemsharedmemory/region/{region}/status",
            shm_routes::status_region,
        ),
    );
    add(
        SharedMemory,
        post(
            "/v2/systemsharedmemory/region/{region}/register",
            shm_routes::register,
        ),
    );
    add(
        SharedMemory,
        post(
            "/v2/systemsharedmemory/region/{region}/unregister",
            shm_routes::unregister,
        ),
    );
    add(
        SharedMemory,
        post(
            "/v2/systemsharedmemory/unregister",
            shm_routes::unregister_all,
        ),
    );
    // The video page (crate::ui): static files, in no Triton category. What the
    // page does goes through the routes above and the model's stream route.
    cfg.service(get("/ui/video", ui::video_page));
    cfg.service(get("/ui/video.js", ui::video_script));
    cfg.service(get("/ui/video.css", ui::video_style));
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

pub async fn not_found(req: HttpRequest) -> HttpResult {
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
async fn model_route(
    state: web::Data<State>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResult {
    let Some(path) = model_routes::parse(req.match_info().as_str()) else {
        return Err(no_route(&req));
    };
    let restrictions = &state.restrictions;
    restricted::check_request(restrictions, path.action.category(), &req)?;
    if !path.action.allows(req.method()) {
        return Ok(wrong_method(&req));
    }
    let group = state.server.lookup(path.model, path.version)?;
    match path.action {
        Action::Metadata => Ok(model_metadata(
            &group,
            state.server.versions(group.endpoint()),
        )),
        Action::Ready => Ok(model_ready(&group)),
        Action::Config => triton::config(&state.server, &group),
        Action::Stats => Ok(triton::model_stats(&*group)),
        Action::Infer => infer(&state, &req, payload, group).await,
        Action::Stream => {
            let streams = &state.streams;
            {
                let socket = super::peer::socket(&req);
                Ok(
                    crate::stream::open(&state.server, streams, &req, payload, group, socket)
                        .await?,
                )
            }
        }
        Action::TraceSetting => trace::setting(&state, &req, payload, Some(group.endpoint())).await,
        Action::Jobs => jobs::submit(&state, &req, payload, &group).await,
    }
}

/// `GET /v2/health/live`: `{"live": true}`, the Open Inference Protocol's REST body
/// (KServe's Python SDK parses it; Triton's clients look at the status only).
async fn live() -> HttpResponse {
    HttpResponse::Ok().json(json!({"live": true}))
}

/// `GET /v2/health/ready`: 200 `{"ready": true}`, or 503 `{"ready": false}` with
/// the reason in `error`.
async fn ready(state: web::Data<State>) -> HttpResponse {
    if state.server.is_ready() {
        HttpResponse::Ok().json(json!({"ready": true}))
    } else if state.server.is_stopping() {
        // Draining (SIGTERM): a balancer takes the replica out; live stays 200.
        HttpResponse::ServiceUnavailable()
            .json(json!({"ready": false, "error": "the server is stopping"}))
    } else {
        HttpResponse::ServiceUnavailable()
            .json(json!({"ready": false, "error": "the server is not ready"}))
    }
}

async fn server_metadata() -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "name": kiln_core::triton::SERVER_NAME,
        "version": kiln_core::triton::SERVER_VERSION,
        "extensions": kiln_core::triton::EXTENSIONS,
    }))
}

async fn list_models(state: web::Data<State>) -> HttpResponse {
    let models: Vec<Value> = state
        .server
        .models()
        .iter()
        .map(|s| {
            // An ensemble has no worker: its platform takes the place.
            let worker = s.group().map_or(kiln_core::triton::ENSEMBLE_PLATFORM, |g| g.worker.as_str());
            json!({"name": s.endpoint(), "version": s.version(), "worker": worker, "state": if s.is_ready() {"READY"} else {"UNAVAILABLE"}})
        })
        .collect();
    HttpResponse::Ok().json(json!({ "models": models }))
}

/// A model's metadata; `versions` are its loaded versions (Triton lists them all).
fn model_metadata(served: &Served, versions: Vec<String>) -> HttpResponse {
    let mut m = kiln_core::triton::ModelMetadata::of(served);
    if !versions.is_empty() {
        m.versions = versions;
    }
    let tensors = |tensors: &[kiln_core::triton::MetadataTensor]| -> Vec<Value> {
        tensors
            .iter()
            .map(|t| json!({"name": t.name, "datatype": t.dtype.as_str(), "shape": t.shape}))
            .collect()
    };
    // An ensemble has no batcher or instances of its own.
    let parameters = match m.group {
        None => json!({ "max_batch_size": m.max_batch_size }),
        Some(g) => json!({
            "max_batch_size": m.max_batch_size,
            "batch_size": g.batch_size,
            "batcher": g.batcher.as_str(),
            "instances": g.instances,
        }),
    };
    HttpResponse::Ok().json(json!({
        "name": m.name,
        "versions": m.versions,
        "platform": m.platform,
        "inputs": tensors(&m.inputs),
        "outputs": tensors(&m.outputs),
        "parameters": parameters,
    }))
}

fn model_ready(served: &Served) -> HttpResponse {
    if served.is_ready() {
        HttpResponse::Ok().finish()
    } else {
        HttpResponse::ServiceUnavailable()
            .json(json!({"error": format!("model `{}` is not ready", served.endpoint())}))
    }
}

/// An inference: its body read and decoded, then its [`Call`] (admission, answer,
/// trace, accounting), then its response encoded. The trace begins before the
/// body is read (see `kiln_core::observe::trace`).
async fn infer(
    state: &State,
    req: &HttpRequest,
    payload: web::Payload,
    group: Served,
) -> HttpResult {
    let trace = Trace::receive(|| trace::propagated(req));
    // `_held` keeps the body's bytes counted until the answer is built: the
    // decoded request may point into the body.
    let body::Body { bytes, held: _held } = read_body(
        req,
        payload,
        state.max_body_bytes,
        state.server.client_bytes(),
    )
    .await?;
    let header = req.headers().get(INFERENCE_HEADER_CONTENT_LENGTH);
    let decoded = offload::decode_request(
        &state.server,
        group.endpoint(),
        bytes,
        header.map(|v| v.as_bytes()),
    )
    .await;
    let request = decoded.as_ref().ok().map(|(r, _)| r);
    state.server.refuse_if_stopping(&group, request)?;
    let (mut call, placement) = Call::start(group, decoded, trace)?;
    let response = match req.conn_data::<super::peer::Peer>() {
        // Returning drops the call: a queued request is then cancelled.
        Some(peer) => tokio::select! {
            answer = call.answer() => answer?,
            () = peer.closed(req.version()) => {
                return Err(HttpError(ServerError::Unavailable("the client went away".into())))
            }
        },
        None => call.answer().await?,
    };
    let encoded = match offload::encode_response(response, placement).await {
        Ok(encoded) => match super::compress::negotiate(req) {
            None => Ok(encoded.into_response()),
            Some(encoding) => super::compress::respond(encoded, encoding).await,
        },
        Err(e) => Err(e),
    };
    Ok(call.end(encoded)?)
}

async fn load(
    state: web::Data<State>,
    path: web::Path<String>,
    payload: web::Payload,
) -> HttpResult {
    let body::Body {
        bytes: body,
        held: _held,
    } = read_raw_body(payload, &state).await?;
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
        .load_as(kiln_core::params::Origin::Client, &worker, params)
        .await?;
    Ok(HttpResponse::Ok().json(json!({ "endpoint": endpoint })))
}

async fn unload(state: web::Data<State>, path: web::Path<String>) -> HttpResult {
    state.server.unload(&path.into_inner()).await?;
    Ok(HttpResponse::Ok().json(json!({})))
}

/// Triton's repository index: every model in the repository with its state.
async fn repository_index(state: web::Data<State>, payload: web::Payload) -> HttpResult {
    let body = json_object(payload, &state).await?;
    let only_ready = index_request(&body)?;
    // Reads the repository's folders and files: not on the connection's thread.
    let server = state.server.clone();
    let index = web::block(move || kiln_core::triton::repository_index(&server, only_ready))
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
) -> HttpResult {
    state.server.model_control().check_api()?;
    let params = repository_parameters(payload, &state).await?;
    let name = path.into_inner();
    // Reads the model's files: not on the connection's thread.
    let (server, model) = (state.server.clone(), name.clone());
    let (resolved, keys) = web::block(move || server.resolve_client_load(&model, params))
        .await
        .map_err(blocking_failed)??;
    state.server.load_resolved(&name, resolved, keys).await?;
    Ok(HttpResponse::Ok().json(json!({})))
}

/// The `parameters` object of a repository load or unload body, as parameters.
async fn repository_parameters(
    payload: web::Payload,
    state: &State,
) -> Result<Vec<kiln_core::Param>, HttpError> {
    let mut body = json_object(payload, state).await?;
    let parameters = match body.remove("parameters") {
        None => Map::new(),
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(HttpError(ServerError::invalid(format!(
                "`parameters` must be an object, got {other}"
            ))))
        }
    };
    Ok(load_params_from_json(parameters)?)
}

fn blocking_failed(e: actix_web::error::BlockingError) -> HttpError {
    HttpError(ServerError::Internal(format!(
        "a blocking task failed: {e}"
    )))
}

/// Triton's repository unload: every version of the model; `parameters.version`
/// (kiln's) unloads that version alone, the others serving on. Other parameters
/// (Triton's `unload_dependents`) change nothing.
async fn repository_unload(
    state: web::Data<State>,
    path: web::Path<String>,
    payload: web::Payload,
) -> HttpResult {
    state.server.model_control().check_api()?;
    let params = repository_parameters(payload, &state).await?;
    state
        .server
        .unload_client_model(&path.into_inner(), params)
        .await?;
    Ok(HttpResponse::Ok().json(json!({})))
}

/// Scales a loaded model: `{"instances": N}` raises or lowers its worker instances
/// while it serves (docs/operations.md, "Scaling"); answers the count and the
/// buffer sets its pool now holds.
async fn repository_scale(
    state: web::Data<State>,
    path: web::Path<String>,
    payload: web::Payload,
) -> HttpResult {
    let body = json_object(payload, &state).await?;
    if let Some(field) = body.keys().find(|k| k.as_str() != "instances") {
        return Err(HttpError(ServerError::invalid(format!(
            "unexpected field `{field}` in the scale request (only `instances` is known)"
        ))));
    }
    let instances = body
        .get("instances")
        .and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            HttpError(ServerError::invalid(
                "the scale request needs `instances`, a whole number of at least 1",
            ))
        })?;
    let name = path.into_inner();
    state.server.scale(&name, instances).await?;
    let served = state.server.model(&name)?;
    let group = served.scalable()?;
    Ok(HttpResponse::Ok().json(json!({
        "instances": group.instance_count(),
        "buffer_sets": group.buffer_sets(),
    })))
}

async fn metrics(state: web::Data<State>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.server.metrics_text())
}
