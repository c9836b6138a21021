//! The OTLP exporter of kiln's traces (`kiln_core::observe::trace`, which has no transport):
//! spans go in batches (the SDK's batch span processor, on a
//! thread of its own, with a bounded queue that drops when full) to an OTLP
//! receiver over gRPC or HTTP/protobuf. The transport runs on a one-thread tokio
//! runtime of its own (`kiln-otlp`), so neither a request's thread nor the
//! server's runtimes ever wait on the receiver.
//!
//! The service name and resource attributes come from the standard
//! `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (the service is `kiln` when
//! neither names one); the batch processor reads `OTEL_BSP_*`.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::SpanData;
use opentelemetry_sdk::Resource;

use kiln_core::error::{Result, ServerError};

/// How spans reach the receiver (`OTEL_EXPORTER_OTLP_PROTOCOL`'s values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/gRPC (`grpc`; the receiver's port 4317 by convention).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (`http/protobuf`; port 4318, `/v1/traces`).
    HttpProtobuf,
}

impl Protocol {
    /// `grpc`, `http/protobuf` (or `http`).
    pub fn parse(s: &str) -> Result<Protocol> {
        match s.trim() {
            "grpc" => Ok(Protocol::Grpc),
            "http" | "http/protobuf" => Ok(Protocol::HttpProtobuf),
            other => Err(ServerError::invalid(format!(
                "OTLP protocol `{other}` is not served (grpc or http/protobuf)"
            ))),
        }
    }

    /// The protocol an endpoint's URL suggests when none is named: HTTP for
    /// port 4318 or a `/v1/traces` path, gRPC otherwise.
    pub fn guess(endpoint: &str) -> Protocol {
        let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.ends_with(":4318") || path.trim_end_matches('/').ends_with("v1/traces") {
            Protocol::HttpProtobuf
        } else {
            Protocol::Grpc
        }
    }
}

/// Where spans are exported.
#[derive(Debug, Clone)]
pub struct OtlpConfig {
    pub endpoint: String,
    pub protocol: Protocol,
}

/// Starts exporting kiln's spans to `config`'s receiver
/// ([`kiln_core::observe::trace::export`]). Once per process, before serving.
pub fn start(config: &OtlpConfig) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kiln-otlp")
        .enable_all()
        .build()
        .map_err(|e| ServerError::Internal(format!("the OTLP exporter's runtime: {e}")))?;
    // tonic's channel and hyper's client spawn onto the runtime they are made in.
    let exporter = {
        let _inside = runtime.enter();
        build(config)?
    };
    kiln_core::observe::trace::export(OnRuntime {
        inner: Arc::new(tokio::sync::Mutex::new(exporter)),
        runtime,
    })
}

fn build(config: &OtlpConfig) -> Result<opentelemetry_otlp::SpanExporter> {
    let timeout = Duration::from_secs(10);
    let built = match config.protocol {
        Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.endpoint.clone())
            .with_timeout(timeout)
            .build(),
        Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(http_endpoint(&config.endpoint))
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_timeout(timeout)
            .build(),
    };
    built.map_err(|e| ServerError::invalid(format!("OTLP endpoint `{}`: {e}", config.endpoint)))
}

/// An HTTP endpoint without a path gets the signal's path, as
/// `OTEL_EXPORTER_OTLP_ENDPOINT` does.
fn http_endpoint(endpoint: &str) -> String {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    match rest.split_once('/') {
        None => format!("{endpoint}/v1/traces"),
        Some((_, "")) => format!("{endpoint}v1/traces"),
        Some(_) => endpoint.to_owned(),
    }
}

/// Runs the OTLP exporter's calls on the exporter's runtime: the batch processor's
/// thread only waits for the result.
/// It owns the runtime, which ends with it (on the batch processor's thread, at
/// shutdown).
#[derive(Debug)]
struct OnRuntime {
    inner: Arc<tokio::sync::Mutex<opentelemetry_otlp::SpanExporter>>,
    runtime: tokio::runtime::Runtime,
}

impl opentelemetry_sdk::trace::SpanExporter for OnRuntime {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let inner = Arc::clone(&self.inner);
        let task = self
            .runtime
            .spawn(async move { inner.lock().await.export(batch).await });
        task.await
            .unwrap_or_else(|e| Err(OTelSdkError::InternalFailure(e.to_string())))
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        match self.inner.try_lock() {
            Ok(mut inner) => inner.shutdown_with_timeout(timeout),
            Err(_) => Ok(()),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        if let Ok(mut inner) = self.inner.try_lock() {
            inner.set_resource(resource);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_from_the_url_or_its_name() {
        assert_eq!(Protocol::guess("http://127.0.0.1:4317"), Protocol::Grpc);
        assert_eq!(
            Protocol::guess("http://collector:4318"),
            Protocol::HttpProtobuf
        );
        assert_eq!(
            Protocol::guess("http://collector:9000/v1/traces"),
            Protocol::HttpProtobuf
        );
        assert_eq!(
            Protocol::parse("http/protobuf").unwrap(),
            Protocol::HttpProtobuf
        );
        assert!(Protocol::parse("http/json").is_err());
        assert_eq!(http_endpoint("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(http_endpoint("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            http_endpoint("http://c:1/x/v1/traces"),
            "http://c:1/x/v1/traces"
        );
    }
}
