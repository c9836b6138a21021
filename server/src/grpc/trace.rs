//! Triton's trace extension over gRPC (`TraceSetting`): the same settings as REST
//! (`kiln_core::observe::trace::settings`), each value a list of strings.

use tonic::Status;

use super::proto::trace_setting_response;
use super::proto::{TraceSettingRequest, TraceSettingResponse};
use super::status::status;
use kiln_core::observe::trace::{self, SettingMap, Update};
use kiln_core::server::Server;

/// Applies the request's settings (if any) to the server's or its model's, then
/// answers the settings in force. A model that is not served is NOT_FOUND.
pub(super) fn trace_setting(
    server: &Server,
    request: TraceSettingRequest,
) -> Result<TraceSettingResponse, Status> {
    let model = (!request.model_name.is_empty()).then_some(request.model_name.as_str());
    if let Some(name) = model {
        server.model(name).map_err(status)?;
    }
    let updates: Vec<Update> = request
        .settings
        .into_iter()
        .map(|(name, value)| {
            let values = Some(value.value).filter(|v| !v.is_empty());
            (name, values)
        })
        .collect();
    let map = if updates.is_empty() {
        trace::get_settings(model)
    } else {
        trace::update_settings(model, &updates).map_err(status)?
    };
    Ok(response(map))
}

fn response(map: SettingMap) -> TraceSettingResponse {
    TraceSettingResponse {
        settings: map
            .into_iter()
            .map(|(name, value)| {
                let value = trace_setting_response::SettingValue {
                    value: value.values(),
                };
                (name, value)
            })
            .collect(),
    }
}
