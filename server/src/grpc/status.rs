//! The one table of gRPC status codes: every [`ServerError`] an RPC returns is
//! answered with the code [`code`] gives, and tonic's own size-limit status is
//! mapped to the one Triton answers.

use tonic::codegen::http::{HeaderMap, HeaderValue};
use tonic::{Code, Status};

use kiln_core::error::ServerError;

/// The gRPC status code for `e`.
pub fn code(e: &ServerError) -> Code {
    match e {
        ServerError::InvalidRequest(_)
        | ServerError::LoadFailed { .. }
        | ServerError::TooLarge(_) => Code::InvalidArgument,
        ServerError::NotFound(_) => Code::NotFound,
        ServerError::AlreadyExists(_) => Code::AlreadyExists,
        ServerError::Conflict(_) => Code::FailedPrecondition,
        ServerError::QueueFull { .. }
        | ServerError::Exhausted(_)
        | ServerError::LimitExceeded(_) => Code::ResourceExhausted,
        ServerError::Unavailable(_) | ServerError::Restricted(_) => Code::Unavailable,
        ServerError::WorkerFailed(_) | ServerError::Internal(_) => Code::Internal,
    }
}

/// A [`ServerError`] as a gRPC status, with the code [`code`] gives.
pub fn status(e: ServerError) -> Status {
    Status::new(code(&e), e.to_string())
}

/// tonic refuses a message over its size limit with `OUT_OF_RANGE`; Triton answers
/// `RESOURCE_EXHAUSTED`. kiln itself never answers `OUT_OF_RANGE`.
pub(super) fn triton_status(status: Status) -> Status {
    if status.code() == Code::OutOfRange {
        Status::resource_exhausted(status.message())
    } else {
        status
    }
}

/// [`triton_status`] for a status in headers or trailers.
pub(super) fn triton_code(headers: &mut HeaderMap) {
    if headers
        .get(Status::GRPC_STATUS)
        .is_some_and(|s| Code::from_bytes(s.as_bytes()) == Code::OutOfRange)
    {
        let code = Code::ResourceExhausted as i32;
        headers.insert(Status::GRPC_STATUS, HeaderValue::from(code));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_requests_are_invalid_argument_and_quotas_resource_exhausted() {
        assert_eq!(code(&ServerError::invalid("bad")), Code::InvalidArgument);
        let limit = ServerError::LimitExceeded("--max-instances = 1".into());
        assert_eq!(code(&limit), Code::ResourceExhausted);
        let restricted = status(ServerError::Restricted("no key".into()));
        assert_eq!(restricted.code(), Code::Unavailable);
        assert_eq!(restricted.message(), "no key");
        let tonic_limit = triton_status(Status::out_of_range("too big"));
        assert_eq!(tonic_limit.code(), Code::ResourceExhausted);
    }

    /// A request parameter the worker's rules refuse (`params::RequestRules`) is
    /// INVALID_ARGUMENT over gRPC.
    #[test]
    fn a_refused_request_parameter_is_invalid_argument() {
        use kiln_worker_sdk::{params_from_pairs, ParamKind, ParamSpec};
        let specs = [ParamSpec::request(
            "increment",
            ParamKind::Int { min: 0, max: 9 },
        )];
        let rules = kiln_core::params::RequestRules::new(&specs);
        let err = rules
            .check(&params_from_pairs(&[("increment", "10")]))
            .unwrap_err();
        assert_eq!(code(&err), Code::InvalidArgument);
    }
}
