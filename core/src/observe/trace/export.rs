//! The tracer spans are built with, and its provider: the SDK's batch span
//! processor (a thread of its own, with a bounded queue that drops when full) in
//! front of the exporter kiln-server gives ([`super::export`]).
//!
//! The service name and resource attributes come from the standard
//! `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (the service is `kiln` when
//! neither names one); the batch processor reads `OTEL_BSP_*`.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider, SpanExporter};
use opentelemetry_sdk::Resource;

/// The running export: the tracer and its provider (flushed at shutdown).
pub(crate) struct Exporting {
    pub(crate) tracer: SdkTracer,
    provider: SdkTracerProvider,
}

impl Exporting {
    pub(crate) fn start<E: SpanExporter + 'static>(exporter: E) -> Exporting {
        let provider = SdkTracerProvider::builder()
            // kiln samples (Triton's trace_rate) before a span is built: the SDK
            // keeps every span it is given, whatever the caller's sampled flag.
            .with_sampler(Sampler::AlwaysOn)
            .with_resource(resource())
            .with_batch_exporter(exporter)
            .build();
        let tracer = provider.tracer("kiln");
        Exporting { tracer, provider }
    }

    /// Exports what is queued and stops the exporter.
    pub(crate) fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            spdlog::warn!("trace export shutdown: {e}");
        }
    }
}

/// The resource: the SDK's detectors (`OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`), with `kiln` as the service when they name none.
fn resource() -> Resource {
    let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| {
            v.split(',')
                .any(|kv| kv.trim().starts_with("service.name="))
        });
    let builder = Resource::builder();
    if named {
        builder.build()
    } else {
        builder.with_service_name("kiln").build()
    }
}
