//! Triton's logging extension over REST: `GET /v2/logging` reads the log settings,
//! `POST /v2/logging` changes the ones it names and answers with all of them
//! ([`crate::log_settings`]).

use actix_web::{web, HttpResponse};
use serde_json::{Map, Value};

use super::body::json_object;
use super::{HttpError, HttpResult, State};
use crate::log_settings::{self, LogSettingValue, LogSettings};
use kiln_core::error::ServerError;

pub(super) async fn get() -> HttpResult {
    let settings = log_settings::settings().ok_or_else(unmanaged)?;
    Ok(HttpResponse::Ok().json(as_json(&settings)))
}

pub(super) async fn post(state: web::Data<State>, payload: web::Payload) -> HttpResult {
    let body = json_object(payload, &state).await?;
    let changes = body
        .into_iter()
        .map(|(name, value)| Ok((name.clone(), setting_value(&name, value)?)))
        .collect::<Result<Vec<_>, HttpError>>()?;
    let settings =
        log_settings::update(&changes).map_err(|e| HttpError(ServerError::InvalidRequest(e.0)))?;
    Ok(HttpResponse::Ok().json(as_json(&settings)))
}

fn unmanaged() -> HttpError {
    HttpError(ServerError::Unavailable(
        "this process does not manage its logging".into(),
    ))
}

/// A JSON value as a setting: a boolean, an unsigned 32-bit integer or a string.
fn setting_value(name: &str, value: Value) -> Result<LogSettingValue, HttpError> {
    match value {
        Value::Bool(b) => Ok(LogSettingValue::Bool(b)),
        Value::String(s) => Ok(LogSettingValue::String(s)),
        Value::Number(n) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(LogSettingValue::Uint)
            .ok_or_else(|| {
                HttpError(ServerError::invalid(format!(
                    "log setting `{name}`: {n} is not an unsigned 32-bit integer"
                )))
            }),
        other => Err(HttpError(ServerError::invalid(format!(
            "log setting `{name}` must be a boolean, a number or a string, got {other}"
        )))),
    }
}

fn as_json(settings: &LogSettings) -> Map<String, Value> {
    log_settings::as_pairs(settings)
        .into_iter()
        .map(|(name, value)| {
            let value = match value {
                LogSettingValue::Bool(b) => Value::Bool(b),
                LogSettingValue::Uint(n) => Value::from(n),
                LogSettingValue::String(s) => Value::String(s),
            };
            (name.to_owned(), value)
        })
        .collect()
}
