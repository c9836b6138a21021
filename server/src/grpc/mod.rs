//! gRPC: Triton's `inference.GRPCInferenceService` (KServe v2 plus Triton's
//! extensions) over tonic, from `proto/inference.proto`.
//!
//! Requests decode into the same protocol-free `InferRequest` as REST
//! ([`convert`]), and every error's status code comes from
//! [`ServerError::grpc_code`](crate::error::ServerError::grpc_code). The binary runs
//! the service on its own multi-thread tokio runtime ([`GrpcServer::start`]); an
//! application with a tokio runtime of its own can serve [`service`] itself.

pub mod convert;
mod service;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::server::TcpIncoming;

pub use service::{status, KilnGrpc};

use crate::server::Server;
use proto::grpc_inference_service_server::GrpcInferenceServiceServer;

/// The protocol's messages, server and client, generated from `proto/inference.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod proto {
    tonic::include_proto!("inference");
}

/// `proto/inference.proto` compiled to a `FileDescriptorSet` (protobuf bytes).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/inference_descriptor.bin"));

/// How to serve gRPC.
#[derive(Debug, Clone)]
pub struct GrpcConfig {
    pub addr: SocketAddr,
    /// Largest message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// Threads of the runtime [`GrpcServer::start`] creates.
    pub threads: usize,
}

/// The service over `server`, with message size limits of `max_message_bytes`.
pub fn service(server: Server, max_message_bytes: usize) -> GrpcInferenceServiceServer<KilnGrpc> {
    GrpcInferenceServiceServer::new(KilnGrpc::new(server))
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(max_message_bytes)
}

/// Serves `server` on `listener` until `shutdown` resolves, then lets the open
/// calls finish.
pub async fn serve(
    server: Server,
    listener: TcpListener,
    max_message_bytes: usize,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(service(server, max_message_bytes))
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await
}

/// A gRPC server running on its own tokio runtime.
pub struct GrpcServer {
    addr: SocketAddr,
    shutdown: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    runtime: tokio::runtime::Runtime,
}

impl GrpcServer {
    /// Creates a runtime of `config.threads` threads, binds `config.addr` and
    /// starts serving.
    pub fn start(server: Server, config: GrpcConfig) -> std::io::Result<GrpcServer> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads.max(1))
            .thread_name("grpc")
            .enable_all()
            .build()?;
        // Bound here, not on the runtime: the caller may be inside another runtime.
        let std_listener = std::net::TcpListener::bind(config.addr)?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let listener = {
            let _context = runtime.enter();
            TcpListener::from_std(std_listener)?
        };
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = runtime.spawn(serve(server, listener, config.max_message_bytes, async {
            let _ = stop.await;
        }));
        Ok(GrpcServer {
            addr,
            shutdown,
            task,
            runtime,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting calls, waits up to `grace` for the open ones (a stream the
    /// client keeps open is cut then), and stops the runtime.
    pub async fn stop(self, grace: Duration) {
        let _ = self.shutdown.send(());
        match tokio::time::timeout(grace, self.task).await {
            Ok(Ok(Err(e))) => spdlog::warn!("gRPC server: {e}"),
            Ok(Err(e)) => spdlog::warn!("gRPC server task: {e}"),
            Err(_) => spdlog::warn!("gRPC server: open calls cut after {grace:?}"),
            Ok(Ok(Ok(()))) => {}
        }
        self.runtime.shutdown_background();
    }
}
