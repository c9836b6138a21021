//! The one browser policy (docs/security.md, "Browsers"), in front of every route
//! a browser can reach: REST (jobs and logging included), the WebSocket upgrade
//! and the `/ui` page.
//!
//! - A request with no `Origin` (curl, tritonclient, perf_analyzer, kiln-load, a
//!   browser's same-origin GET or navigation) passes untouched — unless it says
//!   `Sec-Fetch-Site: cross-site` outside a navigation: an `<img>` or `<script>`
//!   of another site's page reading a kiln route.
//! - An `Origin` that is kiln's own (the scheme of the connection and the
//!   request's `Host`) or one of `--cors-allow-origin` (`*`: any) passes; a
//!   cross-origin one gets `Access-Control-Allow-Origin` on its answer.
//! - Any other `Origin` is refused 403 in the REST error shape, before the route
//!   runs: no body read, no upgrade, nothing applied.
//! - A CORS preflight (`OPTIONS` with `Access-Control-Request-Method`) from an
//!   allowed origin is answered 204 with the usual headers, without a route.
//! - A browser's request (one with `Origin` or `Sec-Fetch-Site`) must name kiln
//!   by an IP address, `localhost` or an `--allowed-host` name: DNS rebinding
//!   (a hostile name resolved to kiln's address) makes the attacker's page kiln's
//!   "own origin", which only the `Host` gives away.
//!
//! Not `actix-cors`: it answers a refused origin 400 in plain text, and knows no
//! "the request's own origin" but through a callback per request; the policy here
//! is one function deciding, refusals in the REST error shape (http/error.rs).
//! Cost for a request without `Origin`: two header lookups.

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Service, Transform};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderMap, HeaderValue};
use actix_web::http::Method;
use actix_web::{HttpResponse, ResponseError};
use std::future::{Future, Ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use super::HttpError;
use kiln_core::error::ServerError;

/// The methods a preflight is told kiln's routes take.
const METHODS: &str = "GET, POST, DELETE, OPTIONS";
/// Response headers a cross-origin script may read (the binary extension's).
const EXPOSE: &str = "Inference-Header-Content-Length, Content-Encoding, Retry-After";
/// How long a browser may keep a preflight's answer, in seconds.
const MAX_AGE: &str = "600";

/// The origins the operator allows beyond kiln's own (`--cors-allow-origin`).
#[derive(Debug, Clone, Default)]
pub struct OriginPolicy {
    /// `scheme://host[:port]`, lower case, default port removed.
    allowed: Vec<String>,
    /// `*` was given: every origin is allowed.
    any: bool,
    /// Host names a browser may reach kiln by (`--allowed-host`), lower case,
    /// without port; IP literals and `localhost` always pass.
    hosts: Vec<String>,
    /// `--allowed-host *`: any name (no DNS-rebinding check).
    any_host: bool,
}

impl OriginPolicy {
    /// The policy allowing `origins` (`*` for any); an origin that is not
    /// `http(s)://host[:port]` is an error for the operator.
    pub fn new(origins: &[String]) -> Result<OriginPolicy, String> {
        let mut policy = OriginPolicy::default();
        for origin in origins {
            let origin = origin.trim();
            if origin == "*" {
                policy.any = true;
                continue;
            }
            match normalize(origin) {
                Some(o) => policy.allowed.push(o),
                None => {
                    return Err(format!(
                        "--cors-allow-origin {origin:?}: an origin is `*` or \
                         `http(s)://host[:port]`, with no path"
                    ))
                }
            }
        }
        Ok(policy)
    }

    /// The same policy, also letting browsers reach kiln by the host names
    /// `hosts` (`--allowed-host`; `*` for any name).
    pub fn with_hosts(mut self, hosts: &[String]) -> Result<OriginPolicy, String> {
        for host in hosts {
            let host = host.trim().to_ascii_lowercase();
            if host == "*" {
                self.any_host = true;
            } else if host.is_empty() || host.contains(['/', ':', ' ']) {
                return Err(format!(
                    "--allowed-host {host:?}: a host name (no scheme, port or path), or `*`"
                ));
            } else {
                self.hosts.push(host);
            }
        }
        Ok(self)
    }

    /// Whether a browser may reach kiln by the request's `Host`: an IP literal,
    /// `localhost` or a name the operator allowed. A page of a hostile name made
    /// to resolve to kiln's address (DNS rebinding) is "same origin" to the
    /// browser, so its `Origin` cannot tell it; its `Host` does.
    fn host_allowed(&self, headers: &HeaderMap) -> Result<(), String> {
        if self.any_host {
            return Ok(());
        }
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase();
        let name = match host.strip_prefix('[') {
            // `[v6]:port`: an address.
            Some(_) => return Ok(()),
            None => host.rsplit_once(':').map_or(host.as_str(), |(n, _)| n),
        };
        let local = name == "localhost" || name.ends_with(".localhost");
        if local || name.parse::<std::net::IpAddr>().is_ok() || self.hosts.iter().any(|h| h == name)
        {
            Ok(())
        } else {
            Err(format!(
                "a browser's request to host {:?} (a name this server was not given with \
                 --allowed-host)",
                cut(name)
            ))
        }
    }

    /// What to do with a request carrying these headers over `scheme`.
    fn decide(&self, headers: &HeaderMap, scheme: &str) -> Decision {
        // A browser says where a request comes from (`Sec-Fetch-Site`, and
        // `Origin` on all but same-origin GETs); only browsers are subject to DNS
        // rebinding, and curl, tritonclient or a proxy send neither.
        let from_browser =
            headers.contains_key("sec-fetch-site") || headers.contains_key(header::ORIGIN);
        if from_browser {
            if let Err(what) = self.host_allowed(headers) {
                return Decision::Refuse(what);
            }
        }
        let Some(origin) = headers.get(header::ORIGIN) else {
            let cross_site = headers
                .get("sec-fetch-site")
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"));
            let navigate = headers
                .get("sec-fetch-mode")
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"navigate"));
            return if cross_site && !navigate {
                Decision::Refuse("a cross-site request from a browser".to_owned())
            } else {
                Decision::Pass
            };
        };
        let text = origin.to_str().unwrap_or("");
        let Some(normal) = normalize(text) else {
            return Decision::Refuse(format!("origin {:?}", cut(text)));
        };
        let own = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .and_then(|host| normalize(&format!("{scheme}://{host}")));
        if own.as_deref() == Some(normal.as_str()) {
            Decision::Pass
        } else if self.any || self.allowed.contains(&normal) {
            Decision::Cors(origin.clone())
        } else {
            Decision::Refuse(format!("origin {:?}", cut(text)))
        }
    }
}

enum Decision {
    /// No origin, or kiln's own: nothing to add.
    Pass,
    /// An allowed cross origin: answer with CORS headers naming it.
    Cors(HeaderValue),
    /// Refused (403), naming what.
    Refuse(String),
}

/// `scheme://host[:port]` lower case with the scheme's default port removed;
/// `None` for anything but http(s) (`null`, `file://`, garbage).
fn normalize(origin: &str) -> Option<String> {
    let origin = origin.to_ascii_lowercase();
    let (scheme, rest) = origin.split_once("://")?;
    let default = match scheme {
        "http" | "ws" => ":80",
        "https" | "wss" => ":443",
        _ => return None,
    };
    if rest.is_empty() || rest.contains('/') {
        return None;
    }
    let authority = rest.strip_suffix(default).unwrap_or(rest);
    Some(format!("{scheme}://{authority}"))
}

/// At most 200 bytes of a client's string, for an error message.
fn cut(text: &str) -> &str {
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The middleware (`App::wrap(Origins(policy))`): refuses, answers a preflight,
/// or passes the request on and adds CORS headers to its answer. Written as a
/// `Transform` rather than `middleware::from_fn`, which boxes a future and clones
/// the policy's `Arc` per request: here a passed request costs the two header
/// lookups and nothing else.
#[derive(Clone)]
pub struct Origins(pub Arc<OriginPolicy>);

impl<S, B> Transform<S, ServiceRequest> for Origins
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
    S::Future: Unpin,
    B: MessageBody,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = actix_web::Error;
    type Transform = OriginService<S>;
    type InitError = ();
    type Future = Ready<Result<OriginService<S>, ()>>;

    fn new_transform(&self, service: S) -> Self::Future {
        std::future::ready(Ok(OriginService {
            service,
            policy: Arc::clone(&self.0),
        }))
    }
}

/// [`Origins`] in front of one actix worker's service.
pub struct OriginService<S> {
    service: S,
    policy: Arc<OriginPolicy>,
}

impl<S, B> Service<ServiceRequest> for OriginService<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
    S::Future: Unpin,
    B: MessageBody,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = actix_web::Error;
    type Future = Checked<S::Future, B>;

    actix_web::dev::forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let scheme = if req.app_config().secure() {
            "https"
        } else {
            "http"
        };
        let origin = match self.policy.decide(req.headers(), scheme) {
            Decision::Pass => None,
            Decision::Cors(origin) => Some(origin),
            Decision::Refuse(what) => {
                let refusal = ServerError::Restricted(format!(
                    "{what} is not allowed here: the server answers browsers at its own \
                     origin and --cors-allow-origin only, by an address, localhost or \
                     --allowed-host"
                ));
                let response = HttpError(refusal).error_response();
                return Checked::Answered(Some(req.into_response(response).map_into_right_body()));
            }
        };
        let preflight = req.method() == Method::OPTIONS
            && req.headers().contains_key("access-control-request-method");
        if let (Some(origin), true) = (&origin, preflight) {
            let mut response = HttpResponse::NoContent();
            if let Some(asked) = req.headers().get("access-control-request-headers") {
                response.insert_header(("access-control-allow-headers", asked.clone()));
            }
            let mut response = response
                .insert_header(("access-control-allow-methods", METHODS))
                .insert_header(("access-control-max-age", MAX_AGE))
                .finish();
            cors_headers(response.headers_mut(), origin);
            return Checked::Answered(Some(req.into_response(response).map_into_right_body()));
        }
        Checked::Passed {
            route: self.service.call(req),
            origin,
        }
    }
}

/// What [`OriginService`] answers: the route's answer (with CORS headers for an
/// allowed cross origin), or its own (a refusal, a preflight's 204).
pub enum Checked<F, B> {
    Passed {
        route: F,
        origin: Option<HeaderValue>,
    },
    Answered(Option<ServiceResponse<EitherBody<B>>>),
}

// Nothing is pinned through `Checked` but the route's future, which is `Unpin`;
// the answer is moved out whole.
impl<F: Unpin, B> Unpin for Checked<F, B> {}

impl<F, B> Future for Checked<F, B>
where
    F: Future<Output = Result<ServiceResponse<B>, actix_web::Error>> + Unpin,
    B: MessageBody,
{
    type Output = Result<ServiceResponse<EitherBody<B>>, actix_web::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Checked::Passed { route, origin } => {
                let mut response = ready!(Pin::new(route).poll(cx))?;
                if let Some(origin) = origin.take() {
                    cors_headers(response.headers_mut(), &origin);
                }
                Poll::Ready(Ok(response.map_into_left_body()))
            }
            Checked::Answered(answer) => Poll::Ready(answer.take().ok_or_else(|| {
                actix_web::error::ErrorInternalServerError("origin check polled after its answer")
            })),
        }
    }
}

fn cors_headers(headers: &mut HeaderMap, origin: &HeaderValue) {
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
    headers.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(EXPOSE),
    );
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                header::HeaderName::from_static(k),
                HeaderValue::from_static(v),
            );
        }
        map
    }

    fn decide(policy: &OriginPolicy, pairs: &[(&'static str, &'static str)]) -> &'static str {
        match policy.decide(&headers(pairs), "http") {
            Decision::Pass => "pass",
            Decision::Cors(_) => "cors",
            Decision::Refuse(_) => "refuse",
        }
    }

    #[test]
    fn own_origin_passes_others_are_refused_unless_allowed() {
        let none = OriginPolicy::new(&[]).unwrap();
        let host = ("host", "127.0.0.1:8000");
        assert_eq!(decide(&none, &[host]), "pass");
        assert_eq!(
            decide(&none, &[host, ("origin", "http://127.0.0.1:8000")]),
            "pass"
        );
        let kiln = none.clone().with_hosts(&["kiln".into()]).unwrap();
        assert_eq!(
            decide(&kiln, &[("host", "Kiln"), ("origin", "http://kiln:80")]),
            "pass"
        );
        for evil in [
            "https://127.0.0.1:8000",
            "http://127.0.0.1:8001",
            "https://evil.example",
            "null",
            "file://",
        ] {
            let origin = HeaderValue::from_static(evil);
            let mut map = headers(&[host]);
            map.insert(header::ORIGIN, origin);
            assert!(
                matches!(none.decide(&map, "http"), Decision::Refuse(_)),
                "{evil}"
            );
        }
        let some = OriginPolicy::new(&["https://App.example:443".into()]).unwrap();
        assert_eq!(
            decide(&some, &[host, ("origin", "https://app.example")]),
            "cors"
        );
        assert_eq!(
            decide(&some, &[host, ("origin", "https://evil.example")]),
            "refuse"
        );
        let any = OriginPolicy::new(&["*".into()]).unwrap();
        assert_eq!(
            decide(&any, &[host, ("origin", "https://evil.example")]),
            "cors"
        );
    }

    #[test]
    fn cross_site_fetches_without_origin_are_refused_but_navigations_pass() {
        let none = OriginPolicy::new(&[]).unwrap();
        let host = ("host", "127.0.0.1:8000");
        let cross = ("sec-fetch-site", "cross-site");
        assert_eq!(decide(&none, &[host, cross]), "refuse");
        let navigate = ("sec-fetch-mode", "navigate");
        assert_eq!(decide(&none, &[host, cross, navigate]), "pass");
        let same = ("sec-fetch-site", "same-origin");
        assert_eq!(decide(&none, &[host, same]), "pass");
    }

    #[test]
    fn browsers_reach_kiln_by_address_localhost_or_an_allowed_name_only() {
        let policy = OriginPolicy::new(&[]).unwrap();
        let same = ("sec-fetch-site", "same-origin");
        for host in ["127.0.0.1:8000", "[::1]:8000", "localhost:8000", "10.1.2.3"] {
            let mut map = headers(&[same]);
            map.insert(header::HOST, HeaderValue::from_str(host).unwrap());
            assert!(
                matches!(policy.decide(&map, "http"), Decision::Pass),
                "{host}"
            );
        }
        // A rebinding page: same origin to the browser, a name kiln was not given.
        let rebound = [("host", "evil.example:8000"), same];
        assert_eq!(decide(&policy, &rebound), "refuse");
        let post = [
            ("host", "evil.example:8000"),
            ("origin", "http://evil.example:8000"),
        ];
        assert_eq!(decide(&policy, &post), "refuse");
        // Not a browser (curl, tritonclient, a proxy): any Host, as before.
        assert_eq!(decide(&policy, &[("host", "evil.example:8000")]), "pass");
        let named = policy
            .clone()
            .with_hosts(&["Kiln.Internal".into()])
            .unwrap();
        assert_eq!(
            decide(&named, &[("host", "kiln.internal:8000"), same]),
            "pass"
        );
        assert_eq!(decide(&named, &rebound), "refuse");
        let any = policy.with_hosts(&["*".into()]).unwrap();
        assert_eq!(decide(&any, &rebound), "pass");
        assert!(OriginPolicy::default()
            .with_hosts(&["http://x".into()])
            .is_err());
    }

    #[test]
    fn bad_operator_origins_are_errors() {
        for bad in ["evil.example", "ftp://x", "https://x/path/"] {
            assert!(OriginPolicy::new(&[bad.into()]).is_err(), "{bad}");
        }
    }
}
