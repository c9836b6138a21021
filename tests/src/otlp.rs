//! A real OTLP/gRPC receiver for the tracing tests: the collector's
//! `TraceService` (from the `opentelemetry-proto` definitions) served with tonic
//! on a loopback port, keeping every span it is sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// The spans kept (unless only counting) and how many came.
#[derive(Clone, Default)]
struct Sink {
    spans: Arc<Mutex<Vec<Received>>>,
    count: Arc<AtomicU64>,
    count_only: bool,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let request = request.into_inner();
        let n: usize = request
            .resource_spans
            .iter()
            .flat_map(|rs| &rs.scope_spans)
            .map(|ss| ss.spans.len())
            .sum();
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        if self.count_only {
            return Ok(Response::new(ExportTraceServiceResponse {
                partial_success: None,
            }));
        }
        let mut spans = self.spans.lock().unwrap();
        for rs in request.resource_spans {
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
        OtlpReceiver::listen("127.0.0.1:0", false).await
    }

    /// A receiver on `addr` that keeps no span, only counts them (for benchmarks:
    /// `otlp-sink`).
    pub async fn counting(addr: &str) -> OtlpReceiver {
        OtlpReceiver::listen(addr, true).await
    }

    /// A receiver speaking OTLP/HTTP with protobuf bodies instead (`POST
    /// /v1/traces`, HTTP/1.1), on a free loopback port.
    pub async fn start_http() -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let sink = Sink::default();
        let serving = sink.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let sink = serving.clone();
                tokio::spawn(async move {
                    let _ = serve_http(stream, sink).await;
                });
            }
        });
        OtlpReceiver { url, sink, task }
    }

    async fn listen(addr: &str, count_only: bool) -> OtlpReceiver {
        let listener = TcpListener::bind(addr).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let sink = Sink {
            count_only,
            ..Sink::default()
        };
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

    /// Every span received so far (none when only counting).
    pub fn spans(&self) -> Vec<Received> {
        self.sink.spans.lock().unwrap().clone()
    }

    /// How many spans were received.
    pub fn count(&self) -> u64 {
        self.sink.count.load(Ordering::Relaxed)
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

/// One OTLP/HTTP connection: each request's protobuf body is an
/// `ExportTraceServiceRequest`, answered 200 with an empty response message; a
/// path other than `/v1/traces` is 404.
async fn serve_http(mut stream: tokio::net::TcpStream, sink: Sink) -> std::io::Result<()> {
    use prost::Message;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = Vec::new();
    loop {
        let end = loop {
            if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buffer.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buffer[..end]).to_string();
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        while buffer.len() < end + length {
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buffer.extend_from_slice(&chunk[..n]);
        }
        let body: Vec<u8> = buffer.drain(..end + length).skip(end).collect();
        let status = if head.starts_with("POST /v1/traces ") {
            let request = ExportTraceServiceRequest::decode(body.as_slice())
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            sink.export(Request::new(request))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            "200 OK"
        } else {
            "404 Not Found"
        };
        let answer = ExportTraceServiceResponse {
            partial_success: None,
        }
        .encode_to_vec();
        let head = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/x-protobuf\r\ncontent-length: {}\r\n\r\n",
            answer.len()
        );
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(&answer).await?;
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
