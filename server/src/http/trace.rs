//! Triton's trace extension over REST (`GET/POST /v2/trace/setting` and
//! `/v2/models/{m}/trace/setting`), and the W3C trace headers of a request.

use actix_web::http::Method;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::{Map, Value};

use super::body::json_object;
use super::{HttpError, State};
use kiln_core::error::ServerError;
use kiln_core::observe::trace::{self, Propagated, SettingMap, SettingValue, Update};

/// The caller's `traceparent` and `tracestate` headers.
pub fn propagated(req: &HttpRequest) -> Propagated {
    Propagated::from_headers(|name| req.headers().get(name).and_then(|v| v.to_str().ok()))
}

/// `GET/POST /v2/trace/setting`: the server's settings.
pub async fn server_setting(
    state: web::Data<State>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, HttpError> {
    setting(&state, &req, payload, None).await
}

/// GET answers the settings in force for `model` (`None`: the server's); POST
/// applies a JSON object of settings (a `null` clears one) and answers the
/// settings then in force.
pub async fn setting(
    state: &State,
    req: &HttpRequest,
    payload: web::Payload,
    model: Option<&str>,
) -> Result<HttpResponse, HttpError> {
    let map = if req.method() == Method::POST {
        let body = json_object(payload, state).await?;
        trace::update_settings(model, &updates(body)?)?
    } else {
        trace::get_settings(model)
    };
    Ok(HttpResponse::Ok().json(to_json(map)))
}

fn updates(body: Map<String, Value>) -> Result<Vec<Update>, HttpError> {
    body.into_iter()
        .map(|(name, value)| {
            let strings = match value {
                Value::Null => None,
                Value::Array(items) => Some(
                    items
                        .into_iter()
                        .map(|v| scalar(&name, v))
                        .collect::<Result<_, _>>()?,
                ),
                v => Some(vec![scalar(&name, v)?]),
            };
            Ok((name, strings))
        })
        .collect()
}

/// A setting's value: a string (Triton's form) or a number.
fn scalar(name: &str, v: Value) -> Result<String, HttpError> {
    match v {
        Value::String(s) => Ok(s),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(HttpError(ServerError::invalid(format!(
            "trace setting `{name}` must be a string, got {other}"
        )))),
    }
}

fn to_json(map: SettingMap) -> Value {
    map.into_iter()
        .map(|(name, value)| {
            let value = match value {
                SettingValue::One(s) => Value::String(s),
                SettingValue::Many(v) => Value::Array(v.into_iter().map(Value::String).collect()),
            };
            (name, value)
        })
        .collect::<Map<String, Value>>()
        .into()
}
