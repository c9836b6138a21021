//! `--http-restricted-api` on the REST routes: a route of a restricted category is
//! registered behind a check of its header (403 as Triton answers without it); a
//! route of an unrestricted category is registered as it is, so it pays nothing.
//! The model routes, matched by hand, call [`check_request`] instead.

use std::future::Future;
use std::sync::Arc;

use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use actix_web::{web, HttpRequest, Resource, ResponseError};

use super::HttpError;
use crate::restricted::{Category, Restriction, Restrictions};
use kiln_core::error::ServerError;

/// Registers `resource`, behind the check of `category`'s header when it is
/// restricted.
pub fn add(
    cfg: &mut web::ServiceConfig,
    restrictions: &Restrictions,
    category: Category,
    resource: Resource,
) {
    match restrictions.get(category) {
        None => {
            cfg.service(resource);
        }
        Some(restriction) => {
            let restriction = Arc::clone(restriction);
            cfg.service(resource.wrap_fn(move |req, srv| check(&restriction, req, srv)));
        }
    }
}

/// What a restricted route does with a request: calls its handler, or refuses it.
enum Step<F> {
    Call(F),
    Refuse(ServiceRequest, ServerError),
}

/// Passes `req` to `srv` when it carries the restriction's header with its value;
/// otherwise answers 403 `{"error": "This API is restricted, expecting header
/// '<key>'"}` (before the method is checked or the body read, as Triton does).
fn check<S>(
    restriction: &Restriction,
    req: ServiceRequest,
    srv: &S,
) -> impl Future<Output = Result<ServiceResponse, actix_web::Error>>
where
    S: Service<ServiceRequest, Response = ServiceResponse, Error = actix_web::Error>,
{
    let step = if allows(restriction, req.request()) {
        Step::Call(srv.call(req))
    } else {
        Step::Refuse(req, restriction.refusal())
    };
    async move {
        match step {
            Step::Call(call) => call.await,
            Step::Refuse(req, refusal) => {
                Ok(req.into_response(HttpError(refusal).error_response()))
            }
        }
    }
}

/// Whether `req` carries the restriction's header with its value.
fn allows(restriction: &Restriction, req: &HttpRequest) -> bool {
    let value = req
        .headers()
        .get(restriction.lookup_name())
        .map(|v| v.as_bytes());
    restriction.allows(value)
}

/// For a route matched outside actix-web's router (`super::model_routes`): the
/// same 403 as [`check`] when `category` is restricted and `req` lacks its header.
pub fn check_request(
    restrictions: &Restrictions,
    category: Category,
    req: &HttpRequest,
) -> Result<(), HttpError> {
    match restrictions.get(category) {
        Some(restriction) if !allows(restriction, req) => Err(HttpError(restriction.refusal())),
        _ => Ok(()),
    }
}
