//! The routes that name a model, matched by hand rather than by actix-web's router:
//!
//! ```text
//! GET  /v2/models/{m}[/versions/{v}]          Metadata   (category Metadata)
//! GET  /v2/models/{m}[/versions/{v}]/ready    Ready      (Health)
//! GET  /v2/models/{m}[/versions/{v}]/config   Config     (ModelConfig)
//! GET  /v2/models/{m}[/versions/{v}]/stats    Stats      (Statistics)
//! POST /v2/models/{m}[/versions/{v}]/infer    Infer      (Inference)
//! GET  /v2/models/{m}[/versions/{v}]/stream   Stream     (Inference; a WebSocket)
//! GET|POST /v2/models/{m}/trace/setting       TraceSetting (Trace)
//! POST /v2/models/{m}/jobs                    Jobs       (Inference; docs/jobs.md)
//! ```
//!
//! Why by hand: actix-web's router turns a route with a `{segment}` into a regex and
//! tries the routes in order, so an inference request ran nine regex searches with
//! captures (`regex_lite`'s PikeVM: the eight model routes registered before it,
//! then its own) before reaching its handler: 24% of the server's CPU under
//! `kiln-load` (echo, HTTP JSON, c=32, `perf record -e cpu-clock`). Registering
//! `infer` first still costs one search per request (4.7% of the CPU); splitting
//! the path on `/` costs none (routing, actix-web's static matches included, is
//! now about 1%). Server CPU per HTTP JSON request at c=32 (`scripts/bench-ab`):
//! 17.9 µs before, 12.9 with `infer` first, 11.9–12.2 by hand.
//! `docs/benchmarks.md` ("HTTP routing without regexes") has the runs.
//!
//! `{m}` and `{v}` are what actix-web's `{name}` pattern captured: one non-empty
//! segment of the path as the router sees it (percent-decoded except `%2F`, `%25`
//! and `%2B`), so `/v2/models/a%2Fb/ready` names the model `a%2Fb`.

use actix_web::http::Method;

use crate::restricted::Category;

/// What a model route does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Metadata,
    Ready,
    Config,
    Stats,
    Infer,
    /// A WebSocket stream of frames ([`crate::stream`]).
    Stream,
    /// Triton's trace extension, for one model.
    TraceSetting,
    /// Submitting offline jobs (no version: a job runs on what is loaded).
    Jobs,
}

impl Action {
    /// Whether the route answers `method` (any other: 405).
    pub fn allows(self, method: &Method) -> bool {
        match self {
            Action::Infer | Action::Jobs => method == Method::POST,
            Action::TraceSetting => method == Method::GET || method == Method::POST,
            _ => method == Method::GET,
        }
    }

    /// The Triton API category the route belongs to (`--http-restricted-api`).
    pub fn category(self) -> Category {
        match self {
            Action::Metadata => Category::Metadata,
            Action::Ready => Category::Health,
            Action::Config => Category::ModelConfig,
            Action::Stats => Category::Statistics,
            Action::Infer | Action::Stream | Action::Jobs => Category::Inference,
            Action::TraceSetting => Category::Trace,
        }
    }
}

/// A path that names a model: the route, `{m}` and `{v}` (borrowed from the path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPath<'a> {
    pub action: Action,
    pub model: &'a str,
    pub version: Option<&'a str>,
}

/// The model route `path` names, if any (`None`: 404). `/v2/models` and
/// `/v2/models/stats` are not model routes: actix-web's router answers them
/// before it gets here.
pub fn parse(path: &str) -> Option<ModelPath<'_>> {
    let mut segments = path.strip_prefix("/v2/models/")?.split('/');
    let model = segments.next().filter(|s| !s.is_empty())?;
    let mut next = segments.next();
    let mut version = None;
    if next == Some("versions") {
        version = Some(segments.next().filter(|s| !s.is_empty())?);
        next = segments.next();
    }
    let action = match next {
        None => Action::Metadata,
        Some("ready") => Action::Ready,
        Some("config") => Action::Config,
        Some("stats") => Action::Stats,
        Some("infer") => Action::Infer,
        Some("stream") => Action::Stream,
        Some("jobs") if version.is_none() => Action::Jobs,
        // Triton's trace setting names no version.
        Some("trace") if version.is_none() && segments.next() == Some("setting") => {
            Action::TraceSetting
        }
        Some(_) => return None,
    };
    if segments.next().is_some() {
        return None;
    }
    Some(ModelPath {
        action,
        model,
        version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(path: &str) -> Option<(Action, &str, Option<&str>)> {
        parse(path).map(|p| (p.action, p.model, p.version))
    }

    #[test]
    fn every_model_route() {
        use Action::*;
        for (suffix, action) in [
            ("", Metadata),
            ("/ready", Ready),
            ("/config", Config),
            ("/stats", Stats),
            ("/infer", Infer),
            ("/stream", Stream),
        ] {
            assert_eq!(
                route(&format!("/v2/models/echo{suffix}")),
                Some((action, "echo", None))
            );
            assert_eq!(
                route(&format!("/v2/models/echo/versions/3{suffix}")),
                Some((action, "echo", Some("3")))
            );
        }
        assert_eq!(
            route("/v2/models/echo/trace/setting"),
            Some((TraceSetting, "echo", None))
        );
        assert_eq!(route("/v2/models/echo/versions/1/trace/setting"), None);
        assert_eq!(route("/v2/models/echo/trace"), None);
        assert_eq!(route("/v2/models/echo/trace/setting/x"), None);
    }

    #[test]
    fn segments_are_taken_as_actix_web_took_them() {
        use Action::*;
        // `{name}` is any non-empty segment, keywords included.
        assert_eq!(route("/v2/models/stats"), Some((Metadata, "stats", None)));
        assert_eq!(
            route("/v2/models/stats/ready"),
            Some((Ready, "stats", None))
        );
        assert_eq!(
            route("/v2/models/versions/versions/v/infer"),
            Some((Infer, "versions", Some("v")))
        );
        assert_eq!(
            route("/v2/models/versions/versions/infer"),
            Some((Metadata, "versions", Some("infer")))
        );
        assert_eq!(
            route("/v2/models/m/versions/ready"),
            Some((Metadata, "m", Some("ready")))
        );
        assert_eq!(
            route("/v2/models/a%2Fb/infer"),
            Some((Infer, "a%2Fb", None))
        );
    }

    #[test]
    fn other_paths_are_not_model_routes() {
        for path in [
            "/v2/models",
            "/v2/models/",
            "/v2/modelsx/echo",
            "/v2/models//infer",
            "/v2/models/echo/",
            "/v2/models/echo/infer/",
            "/v2/models/echo/infer/x",
            "/v2/models/echo/load",
            "/v2/models/echo/versions",
            "/v2/models/echo/versions/",
            "/v2/models/echo/versions//infer",
            "/v2/models/echo/versions/1/",
            "/v2/models/echo/versions/1/unknown",
            "/v2/models/echo/versions/1/infer/x",
            "/v2/models/echo/Infer",
            "/v2/Models/echo",
            "/v2/workers/echo/load",
        ] {
            assert_eq!(route(path), None, "{path}");
        }
    }

    #[test]
    fn methods_and_categories() {
        assert!(Action::Infer.allows(&Method::POST) && !Action::Infer.allows(&Method::GET));
        assert_eq!(Action::Infer.category(), Category::Inference);
        assert!(Action::Stream.allows(&Method::GET) && !Action::Stream.allows(&Method::POST));
        assert_eq!(Action::Stream.category(), Category::Inference);
        assert!(Action::Ready.allows(&Method::GET) && !Action::Ready.allows(&Method::POST));
        assert!(Action::TraceSetting.allows(&Method::GET));
        assert!(Action::TraceSetting.allows(&Method::POST));
        assert!(!Action::TraceSetting.allows(&Method::PUT));
        assert_eq!(Action::TraceSetting.category(), Category::Trace);
        assert_eq!(Action::Ready.category(), Category::Health);
        assert_eq!(Action::Stats.category(), Category::Statistics);
        assert_eq!(Action::Config.category(), Category::ModelConfig);
        assert_eq!(Action::Metadata.category(), Category::Metadata);
    }
}
