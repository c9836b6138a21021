//! Triton's logging extension over gRPC (`LogSettings`): the settings a request
//! names are changed, all of them answered ([`crate::log_settings`]). An empty
//! request reads them.

use tonic::Status;

use super::proto::log_settings_request::setting_value::ParameterChoice as In;
use super::proto::log_settings_response::setting_value::ParameterChoice as Out;
use super::proto::{log_settings_response, LogSettingsRequest, LogSettingsResponse};
use super::status::status;
use crate::log_settings::{self, LogSettingValue};
use kiln_core::error::ServerError;

/// Answers one `LogSettings` call.
pub fn log_settings(request: LogSettingsRequest) -> Result<LogSettingsResponse, Status> {
    let changes = request
        .settings
        .into_iter()
        .map(|(name, value)| match value.parameter_choice {
            Some(In::BoolParam(b)) => Ok((name, LogSettingValue::Bool(b))),
            Some(In::Uint32Param(n)) => Ok((name, LogSettingValue::Uint(n))),
            Some(In::StringParam(s)) => Ok((name, LogSettingValue::String(s))),
            None => Err(status(ServerError::invalid(format!(
                "log setting `{name}` has no value"
            )))),
        })
        .collect::<Result<Vec<_>, Status>>()?;
    let settings = if changes.is_empty() {
        log_settings::settings().ok_or_else(|| {
            status(ServerError::Unavailable(
                "this process does not manage its logging".into(),
            ))
        })?
    } else {
        log_settings::update(&changes).map_err(|e| status(ServerError::InvalidRequest(e.0)))?
    };
    let settings = log_settings::as_pairs(&settings)
        .into_iter()
        .map(|(name, value)| {
            let choice = match value {
                LogSettingValue::Bool(b) => Out::BoolParam(b),
                LogSettingValue::Uint(n) => Out::Uint32Param(n),
                LogSettingValue::String(s) => Out::StringParam(s),
            };
            let value = log_settings_response::SettingValue {
                parameter_choice: Some(choice),
            };
            (name.to_owned(), value)
        })
        .collect();
    Ok(LogSettingsResponse { settings })
}
