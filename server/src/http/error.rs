//! The one table of HTTP statuses: every [`ServerError`] a REST route returns is
//! answered here, as `{"error": "..."}` with the status [`status_code`] gives (and
//! `Retry-After` when the error says to retry).

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};

use kiln_core::error::ServerError;

/// The HTTP status for `e`.
pub fn status_code(e: &ServerError) -> StatusCode {
    match e {
        ServerError::InvalidRequest(_)
        | ServerError::AlreadyExists(_)
        | ServerError::LoadFailed { .. }
        | ServerError::LimitExceeded(_) => StatusCode::BAD_REQUEST,
        ServerError::Restricted(_) => StatusCode::FORBIDDEN,
        ServerError::NotFound(_) => StatusCode::NOT_FOUND,
        ServerError::Conflict(_) => StatusCode::CONFLICT,
        ServerError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        ServerError::QueueFull { .. } | ServerError::Exhausted(_) => StatusCode::TOO_MANY_REQUESTS,
        ServerError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        ServerError::WorkerFailed(_) | ServerError::Internal(_) => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

/// A [`ServerError`] as an HTTP response.
#[derive(Debug)]
pub struct HttpError(pub ServerError);

/// What a REST handler returns: its response, or the error answered in the
/// protocol's shape ([`HttpError`]).
pub type HttpResult = Result<HttpResponse, HttpError>;

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<ServerError> for HttpError {
    fn from(e: ServerError) -> Self {
        HttpError(e)
    }
}

impl From<kiln_protocol::ProtocolError> for HttpError {
    fn from(e: kiln_protocol::ProtocolError) -> Self {
        HttpError(e.into())
    }
}

impl ResponseError for HttpError {
    fn status_code(&self) -> StatusCode {
        status_code(&self.0)
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status_code());
        if let Some(after) = self.0.retry_after() {
            response.insert_header(("Retry-After", after.as_secs().max(1).to_string()));
        }
        response.json(serde_json::json!({ "error": self.0.to_string() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_loads_and_bad_requests_are_400_and_overload_429_with_retry() {
        for e in [
            ServerError::invalid("bad"),
            ServerError::LimitExceeded("--max-instances = 1".into()),
            ServerError::LoadFailed {
                worker: "w".into(),
                reason: "r".into(),
            },
        ] {
            assert_eq!(status_code(&e).as_u16(), 400, "{e:?}");
            assert_eq!(e.retry_after(), None);
        }
        let full = HttpError(ServerError::QueueFull {
            model: "m".into(),
            capacity: 1,
        });
        let response = full.error_response();
        assert_eq!(response.status().as_u16(), 429);
        assert_eq!(response.headers().get("Retry-After").unwrap(), "1");
    }

    /// A client load that sets an operator-only parameter (`params::check_client_keys`) is a 400.
    #[test]
    fn a_client_setting_an_operator_parameter_is_400() {
        use kiln_core::params::{check_client_keys, client_keys, Origin};
        use kiln_worker_sdk::{params_from_pairs, ParamSpec};
        let specs = [ParamSpec::operator("runtime")];
        let params = params_from_pairs(&[("RUNTIME", "/tmp/x.so")]);
        let err =
            check_client_keys("w", &specs, &client_keys(Origin::Client, &params)).unwrap_err();
        assert_eq!(status_code(&err).as_u16(), 400);
    }
}
