//! Triton's restricted APIs: `--http-restricted-api` and `--grpc-restricted-protocol`
//! (`<API_1>,<API_2>,...:<key>=<value>`, repeatable) make each listed category of
//! the protocol answer only requests that carry the header `key` with exactly
//! `value` (over gRPC the header is `triton-grpc-protocol-<key>`). Anything else is
//! refused as Triton refuses it: HTTP 403 `{"error": "This API is restricted,
//! expecting header '<key>'"}`, gRPC `UNAVAILABLE` "This protocol is restricted,
//! expecting header 'triton-grpc-protocol-<key>'".
//!
//! The flags are parsed once at start-up; a server without them keeps no
//! restriction at all, so its requests pay nothing for the feature (REST wraps only
//! the routes of restricted categories, gRPC checks only when one is restricted).

use std::sync::Arc;

use kiln_core::error::ServerError;

/// The header prefix Triton puts before a gRPC restriction's key (HTTP/2 header
/// names are lower case).
pub const GRPC_HEADER_PREFIX: &str = "triton-grpc-protocol-";

/// Triton's API categories, in the order of its `RestrictedCategory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// Server and model liveness and readiness.
    Health,
    /// Server and model metadata (and kiln's list of models).
    Metadata,
    /// Inference: `infer`, `ModelInfer`, `ModelStreamInfer`.
    Inference,
    /// The system (and CUDA) shared-memory extension.
    SharedMemory,
    /// Model configuration (`/config`, `ModelConfig`).
    ModelConfig,
    /// The model repository, and kiln's worker load and unload.
    ModelRepository,
    /// Statistics (`/stats`, `ModelStatistics`, and kiln's `/metrics`).
    Statistics,
    /// Trace settings (Triton's trace extension: `/v2/trace/setting`, `TraceSetting`).
    Trace,
    /// Log settings (kiln serves none).
    Logging,
    /// kiln's own: listing every job (`GET /v2/jobs`), an operator's act. Unlike
    /// Triton's categories it is closed unless restricted: listing answers 403
    /// until `--http-restricted-api jobs-admin:KEY=VALUE` names the header that
    /// opens it (a job's own routes need only its unguessable id). See
    /// docs/jobs.md.
    JobsAdmin,
}

impl Category {
    /// Every category, in Triton's order, then kiln's own.
    pub const ALL: [Category; 10] = [
        Category::Health,
        Category::Metadata,
        Category::Inference,
        Category::SharedMemory,
        Category::ModelConfig,
        Category::ModelRepository,
        Category::Statistics,
        Category::Trace,
        Category::Logging,
        Category::JobsAdmin,
    ];

    /// Its name on the command line, as Triton spells it.
    pub fn name(self) -> &'static str {
        match self {
            Category::Health => "health",
            Category::Metadata => "metadata",
            Category::Inference => "inference",
            Category::SharedMemory => "shared-memory",
            Category::ModelConfig => "model-config",
            Category::ModelRepository => "model-repository",
            Category::Statistics => "statistics",
            Category::Trace => "trace",
            Category::Logging => "logging",
            Category::JobsAdmin => "jobs-admin",
        }
    }

    /// The category named `name`, if any.
    pub fn from_name(name: &str) -> Option<Category> {
        Category::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The category of a gRPC method (`/inference.GRPCInferenceService/ModelInfer`),
    /// as Triton's gRPC server files each RPC; `None` for a path it does not know.
    pub fn of_grpc_path(path: &str) -> Option<Category> {
        if path == "/grpc.health.v1.Health/Check" {
            return Some(Category::Health);
        }
        let method = path.strip_prefix("/inference.GRPCInferenceService/")?;
        Some(match method {
            "ServerLive" | "ServerReady" | "ModelReady" => Category::Health,
            "ServerMetadata" | "ModelMetadata" => Category::Metadata,
            "ModelInfer" | "ModelStreamInfer" => Category::Inference,
            "ModelConfig" => Category::ModelConfig,
            "ModelStatistics" => Category::Statistics,
            "RepositoryIndex" | "RepositoryModelLoad" | "RepositoryModelUnload" => {
                Category::ModelRepository
            }
            "SystemSharedMemoryStatus"
            | "SystemSharedMemoryRegister"
            | "SystemSharedMemoryUnregister"
            | "CudaSharedMemoryStatus"
            | "CudaSharedMemoryRegister"
            | "CudaSharedMemoryUnregister" => Category::SharedMemory,
            "TraceSetting" => Category::Trace,
            "LogSettings" => Category::Logging,
            _ => return None,
        })
    }
}

/// Which protocol a set of restrictions is for: the flag's name, the word its
/// messages use, and the header prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http,
    Grpc,
}

impl Protocol {
    fn flag(self) -> &'static str {
        match self {
            Protocol::Http => "--http-restricted-api",
            Protocol::Grpc => "--grpc-restricted-protocol",
        }
    }

    /// Triton's word for a category in this protocol's messages.
    fn feature(self) -> &'static str {
        match self {
            Protocol::Http => "api",
            Protocol::Grpc => "protocol",
        }
    }
}

/// A restriction flag that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestrictionError {
    /// Not `<API_1>,<API_2>,...:<key>=<value>` with each part non-empty.
    #[error("{flag} option format is '<API_1>,<API_2>,...:<key>=<value>'. Got {arg}")]
    Format { flag: &'static str, arg: String },
    /// A category Triton does not have.
    #[error("unknown restricted {feature} '{name}' (known: {known})")]
    Unknown {
        feature: &'static str,
        name: String,
        known: String,
    },
    /// A category listed in two groups (or twice in one).
    #[error("restricted {feature} '{name}' can not be specified in multiple config groups")]
    Repeated { feature: &'static str, name: String },
}

/// The header a restricted category asks for, and its value.
#[derive(Debug, PartialEq, Eq)]
pub struct Restriction {
    /// The header's name as configured (with the gRPC prefix), for messages.
    header: String,
    /// The same, lower case, for lookups.
    lookup: String,
    value: String,
    protocol: Protocol,
}

impl Restriction {
    /// Whether a request whose header has `value` (`None`: absent) may pass.
    pub fn allows(&self, value: Option<&[u8]>) -> bool {
        value == Some(self.value.as_bytes())
    }

    /// The (lower-case) name of the header to look up.
    pub fn lookup_name(&self) -> &str {
        &self.lookup
    }

    /// The error a refused request is answered with: HTTP 403, gRPC `UNAVAILABLE`,
    /// with Triton's message.
    pub fn refusal(&self) -> ServerError {
        let what = match self.protocol {
            Protocol::Http => "API",
            Protocol::Grpc => "protocol",
        };
        ServerError::Restricted(format!(
            "This {what} is restricted, expecting header '{}'",
            self.header
        ))
    }
}

/// The restrictions of one protocol: for each category, the header it asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Restrictions {
    by_category: [Option<Arc<Restriction>>; Category::ALL.len()],
}

impl Restrictions {
    /// Parses the flag's values (`<API_1>,<API_2>,...:<key>=<value>` each), as
    /// Triton's command-line parser does: the first `:` ends the categories, the
    /// first `=` after it ends the key; none of the three may be empty; a category
    /// must be known and appear in one group only.
    pub fn parse(protocol: Protocol, groups: &[String]) -> Result<Restrictions, RestrictionError> {
        let mut restrictions = Restrictions::default();
        for arg in groups {
            let format = || RestrictionError::Format {
                flag: protocol.flag(),
                arg: arg.clone(),
            };
            let (apis, setting) = arg.split_once(':').ok_or_else(format)?;
            let (key, value) = setting.split_once('=').ok_or_else(format)?;
            if apis.is_empty() || key.is_empty() || value.is_empty() {
                return Err(format());
            }
            let header = match protocol {
                Protocol::Http => key.to_owned(),
                Protocol::Grpc => format!("{GRPC_HEADER_PREFIX}{key}"),
            };
            let restriction = Arc::new(Restriction {
                lookup: header.to_ascii_lowercase(),
                header,
                value: value.to_owned(),
                protocol,
            });
            for name in apis.split(',') {
                let category =
                    Category::from_name(name).ok_or_else(|| RestrictionError::Unknown {
                        feature: protocol.feature(),
                        name: name.to_owned(),
                        known: Category::ALL.map(Category::name).join(", "),
                    })?;
                let slot = &mut restrictions.by_category[category as usize];
                if slot.is_some() {
                    return Err(RestrictionError::Repeated {
                        feature: protocol.feature(),
                        name: name.to_owned(),
                    });
                }
                *slot = Some(Arc::clone(&restriction));
            }
        }
        Ok(restrictions)
    }

    /// The restriction on `category`, if it is restricted.
    pub fn get(&self, category: Category) -> Option<&Arc<Restriction>> {
        self.by_category[category as usize].as_ref()
    }

    /// Whether nothing is restricted.
    pub fn is_empty(&self) -> bool {
        self.by_category.iter().all(Option::is_none)
    }
}

/// The restrictions of both protocols, as the server keeps them
/// ([`crate::Server::restrict`]).
#[derive(Debug, Default, Clone)]
pub struct RestrictedApis {
    /// `--http-restricted-api`.
    pub http: Arc<Restrictions>,
    /// `--grpc-restricted-protocol`.
    pub grpc: Arc<Restrictions>,
}

impl RestrictedApis {
    /// Parses both flags' values (see [`Restrictions::parse`]).
    pub fn parse(http: &[String], grpc: &[String]) -> Result<RestrictedApis, RestrictionError> {
        Ok(RestrictedApis {
            http: Arc::new(Restrictions::parse(Protocol::Http, http)?),
            grpc: Arc::new(Restrictions::parse(Protocol::Grpc, grpc)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(protocol: Protocol, groups: &[&str]) -> Result<Restrictions, RestrictionError> {
        let groups: Vec<String> = groups.iter().map(|s| s.to_string()).collect();
        Restrictions::parse(protocol, &groups)
    }

    #[test]
    fn groups_categories_and_headers() {
        let r = parse(
            Protocol::Grpc,
            &[
                "model-repository,shared-memory:Admin-Key=s3cret",
                "inference:k=v",
            ],
        )
        .unwrap();
        let admin = r.get(Category::ModelRepository).unwrap();
        assert_eq!(admin.lookup_name(), "triton-grpc-protocol-admin-key");
        assert!(admin.allows(Some(b"s3cret")));
        assert!(!admin.allows(Some(b"S3cret")));
        assert!(!admin.allows(None));
        assert_eq!(r.get(Category::SharedMemory), Some(admin));
        assert!(r.get(Category::Inference).unwrap().allows(Some(b"v")));
        assert_eq!(r.get(Category::Health), None);
        assert_eq!(
            admin.refusal().to_string(),
            "This protocol is restricted, expecting header 'triton-grpc-protocol-Admin-Key'"
        );
        let http = parse(Protocol::Http, &["statistics:a=b=c"]).unwrap();
        let stats = http.get(Category::Statistics).unwrap();
        assert!(
            stats.allows(Some(b"b=c")),
            "the value is all after the first ="
        );
        assert_eq!(
            stats.refusal().to_string(),
            "This API is restricted, expecting header 'a'"
        );
        assert!(parse(Protocol::Http, &[]).unwrap().is_empty());
    }

    #[test]
    fn bad_flags_are_refused_as_triton_refuses_them() {
        for bad in [
            "health",
            "health:k",
            ":k=v",
            "health:=v",
            "health:k=",
            "health=v:k",
        ] {
            let err = parse(Protocol::Http, &[bad]).unwrap_err();
            assert!(
                matches!(err, RestrictionError::Format { .. }),
                "{bad}: {err}"
            );
            assert!(err
                .to_string()
                .starts_with("--http-restricted-api option format"));
        }
        let err = parse(Protocol::Http, &["model-reposit,health:k1=v1"]).unwrap_err();
        assert!(err
            .to_string()
            .starts_with("unknown restricted api 'model-reposit'"));
        let err = parse(
            Protocol::Grpc,
            &["model-repository,health:k1=v1", "metadata,health:k2=v2"],
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "restricted protocol 'health' can not be specified in multiple config groups"
        );
        assert!(parse(Protocol::Http, &["health,health:k=v"]).is_err());
    }

    #[test]
    fn grpc_methods_fall_in_tritons_categories() {
        let of = |m: &str| Category::of_grpc_path(&format!("/inference.GRPCInferenceService/{m}"));
        assert_eq!(of("ModelStreamInfer"), Some(Category::Inference));
        assert_eq!(of("RepositoryModelLoad"), Some(Category::ModelRepository));
        assert_eq!(of("ModelReady"), Some(Category::Health));
        assert_eq!(
            of("SystemSharedMemoryRegister"),
            Some(Category::SharedMemory)
        );
        assert_eq!(of("Nope"), None);
        assert_eq!(Category::of_grpc_path("/other.Service/ModelInfer"), None);
    }
}
