//! A real OTLP/gRPC receiver for the tracing tests: the collector's
//! `TraceService` (from the `opentelemetry-proto` definitions) served with tonic
//! on a loopback port, keeping every span it is sent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// A received span with its resource's attributes.
#[derive(Debug, Clone)]
pub struct Received {
    pub resource: HashMap<String, String>,
    pub span: Span,
}

impl Received {
    /// The span's attribute `key`, as a string (ints printed).
    pub fn attr(&self, key: &str) -> Option<String> {
        attributes(&self.span.attributes).remove(key)
    }
}

/// Attributes as strings (ints and bools printed).
pub fn attributes(kvs: &[KeyValue]) -> HashMap<String, String> {
    kvs.iter()
        .filter_map(|kv| Some((kv.key.clone(), text(kv.value.as_ref()?)?)))
        .collect()
}

fn text(v: &AnyValue) -> Option<String> {
    Some(match v.value.as_ref()? {
        any_value::Value::StringValue(s) => s.clone(),
        any_value::Value::IntValue(i) => i.to_string(),
        any_value::Value::BoolValue(b) => b.to_string(),
        any_value::Value::DoubleValue(d) => d.to_string(),
        _ => return None,
    })
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<Received>>>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let resource = rs
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push(Received {
                        resource: resource.clone(),
                        span,
                    });
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The receiver, serving until dropped.
pub struct OtlpReceiver {
    /// `http://127.0.0.1:PORT`, for `--trace-otlp-endpoint`.
    pub url: String,
    sink: Sink,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    /// Listens on a free loopback port (call inside a tokio runtime).
    pub async fn start() -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let sink = Sink::default();
        let service = TraceServiceServer::new(sink.clone());
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        OtlpReceiver { url, sink, task }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        self.sink.0.lock().unwrap().clone()
    }

    /// Waits (up to `within`) until `done` holds for the spans received; returns
    /// them either way.
    pub async fn wait_for(
        &self,
        within: Duration,
        done: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let until = Instant::now() + within;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() > until {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
