//! gRPC: Triton's `inference.GRPCInferenceService` (KServe v2 plus Triton's
//! extensions) over tonic, from `proto/inference.proto`.
//!
//! Requests decode into the same protocol-free `InferRequest` as REST
//! ([`convert`]), and every error's status code comes from
//! [`ServerError::grpc_code`](crate::error::ServerError::grpc_code). The binary runs
//! the service on threads of its own, one single-threaded tokio runtime each
//! ([`GrpcServer::start`]); an application with a tokio runtime of its own can
//! [`serve`] it there. Connections are hyper's HTTP/2 server running
//! [`GrpcRoutes`], which answers `ModelInfer` itself and every other RPC through
//! the tonic-generated service.

pub mod convert;
mod routes;
mod service;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::TcpIncoming;

pub use routes::GrpcRoutes;
pub use service::{status, KilnGrpc};

use crate::server::Server;

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
    /// Address to listen on (port 0: any free port).
    pub addr: SocketAddr,
    /// Largest message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// Serving threads [`GrpcServer::start`] creates.
    pub threads: usize,
    /// Whether those threads run under `SCHED_BATCH` ([`crate::sched`]).
    pub sched_batch: bool,
}

/// Serves `server` on `listener`, on the caller's runtime, until `shutdown`
/// resolves, then lets the open calls finish.
pub async fn serve(
    server: Server,
    listener: TcpListener,
    max_message_bytes: usize,
    shutdown: impl Future<Output = ()> + Send,
) {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    serve_incoming(server, incoming, max_message_bytes, shutdown).await
}

/// Serves `server` on the connections `incoming` yields until `shutdown` resolves,
/// then lets the open calls finish.
///
/// Each connection is hyper's HTTP/2 server (prior knowledge, as gRPC clients
/// speak it) running [`GrpcRoutes`]; tonic's own server stack (an axum router and
/// tower layers in front of every call) is not used, [`GrpcRoutes`] does what of it
/// kiln needs. Responses carry no `Date` header (gRPC servers such as Triton's send
/// none), and streams per connection are not limited (as tonic serves them).
async fn serve_incoming(
    server: Server,
    incoming: impl Stream<Item = std::io::Result<TcpStream>>,
    max_message_bytes: usize,
    shutdown: impl Future<Output = ()>,
) {
    let routes = GrpcRoutes::new(server, max_message_bytes);
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .auto_date_header(false)
        .max_concurrent_streams(None);
    let connections = GracefulShutdown::new();
    let mut incoming = std::pin::pin!(incoming);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            stream = incoming.next() => match stream {
                Some(Ok(stream)) => stream,
                Some(Err(e)) => {
                    spdlog::debug!("gRPC connection: {e}");
                    continue;
                }
                None => break,
            },
        };
        let connection = http2.serve_connection(TokioIo::new(stream), routes.clone());
        let connection = connections.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                spdlog::debug!("gRPC connection: {e}");
            }
        });
    }
    // New calls are refused; the open ones finish.
    connections.shutdown().await;
}

/// A gRPC server on threads of its own: `threads` single-threaded tokio runtimes
/// (as actix-web runs its HTTP workers), each serving the connections that one
/// acceptor hands it in turn. A connection and its calls stay on one thread, so a
/// call wakes no other thread of the server beyond the request's own batch.
pub struct GrpcServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    workers: Vec<Worker>,
}

/// One serving thread, as [`GrpcServer::stop`] sees it.
struct Worker {
    /// Told once the grace period is over: drop what is still open.
    cut: oneshot::Sender<()>,
    /// Answered when the serving loop is done, its connections closed.
    served: oneshot::Receiver<()>,
    /// Answered when the thread has dropped its runtime.
    finished: oneshot::Receiver<()>,
}

impl GrpcServer {
    /// Binds `config.addr`, starts `config.threads` serving threads (the first
    /// also accepts connections and hands them out in turn) and starts serving.
    pub fn start(server: Server, config: GrpcConfig) -> std::io::Result<GrpcServer> {
        // Bound here, not on a runtime: the caller may be inside another runtime.
        let std_listener = std::net::TcpListener::bind(config.addr)?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (stop, stopped) = watch::channel(false);
        let threads = config.threads.max(1);
        let (handoff, takes): (Vec<_>, Vec<_>) = (0..threads)
            .map(|_| mpsc::unbounded_channel::<std::net::TcpStream>())
            .unzip();
        // The first thread accepts: it takes the listener and every handoff.
        let mut acceptor = Some((std_listener, handoff));
        let mut workers = Vec::with_capacity(threads);
        for (i, take) in takes.into_iter().enumerate() {
            let (cut, cut_rx) = oneshot::channel();
            let (served_tx, served) = oneshot::channel();
            let (finished_tx, finished) = oneshot::channel();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let acceptor = acceptor.take();
            let (server, stopped) = (server.clone(), stopped.clone());
            let (max_message_bytes, sched_batch) = (config.max_message_bytes, config.sched_batch);
            std::thread::Builder::new()
                .name(format!("grpc-{i}"))
                .spawn(move || {
                    if sched_batch {
                        crate::sched::serving_thread();
                    }
                    runtime.block_on(async move {
                        if let Some((listener, handoff)) = acceptor {
                            match TcpListener::from_std(listener) {
                                Ok(l) => {
                                    tokio::spawn(accept_loop(l, handoff, stopped.clone()));
                                }
                                Err(e) => spdlog::error!("gRPC listener: {e}"),
                            }
                        }
                        let incoming = UnboundedReceiverStream::new(take).map(|s| {
                            let s = TcpStream::from_std(s)?;
                            s.set_nodelay(true)?;
                            Ok::<_, std::io::Error>(s)
                        });
                        let mut stopped = stopped;
                        let signal = async move {
                            let _ = stopped.wait_for(|&stop| stop).await;
                        };
                        tokio::select! {
                            () = serve_incoming(server, incoming, max_message_bytes, signal) => {
                                let _ = served_tx.send(());
                            }
                            _ = cut_rx => {}
                        }
                    });
                    // Dropping the runtime drops the connections still open.
                    drop(runtime);
                    let _ = finished_tx.send(());
                })?;
            workers.push(Worker {
                cut,
                served,
                finished,
            });
        }
        Ok(GrpcServer {
            addr,
            stop,
            workers,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting calls, waits up to `grace` for the open ones (a stream the
    /// client keeps open is cut then), and stops the serving threads.
    pub async fn stop(self, grace: Duration) {
        let _ = self.stop.send(true);
        let deadline = tokio::time::Instant::now() + grace;
        let mut cut_any = false;
        for worker in self.workers {
            if tokio::time::timeout_at(deadline, worker.served)
                .await
                .is_err()
            {
                cut_any = true;
            }
            let _ = worker.cut.send(());
            let _ = worker.finished.await;
        }
        if cut_any {
            spdlog::warn!("gRPC server: open calls cut after {grace:?}");
        }
    }
}

/// Accepts connections until `stopped`, handing them to the serving threads in
/// turn.
async fn accept_loop(
    listener: TcpListener,
    handoff: Vec<mpsc::UnboundedSender<std::net::TcpStream>>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut next = 0;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.wait_for(|&stop| stop) => return,
        };
        let stream = match accepted.and_then(|(s, _)| s.into_std()) {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was taken.
                spdlog::debug!("gRPC accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if let Some(worker) = handoff.get(next % handoff.len()) {
            let _ = worker.send(stream);
        }
        next = next.wrapping_add(1);
    }
}
