//! gRPC: Triton's `inference.GRPCInferenceService` (KServe v2 plus Triton's
//! extensions) over tonic, from `proto/inference.proto`.
//!
//! Requests decode into the same protocol-free `InferRequest` as REST
//! ([`convert`]), and every error's status code comes from [`code`]
//! (`grpc/status.rs`, the one table of gRPC codes). The binary runs
//! the service on threads of its own, one single-threaded tokio runtime each
//! ([`GrpcServer::start`]); an application with a tokio runtime of its own can
//! [`serve`] it there. Connections are hyper's HTTP/2 server running
//! [`GrpcRoutes`], which answers `ModelInfer` itself and every other RPC through
//! the tonic-generated service.

mod connection;
pub mod convert;
mod gather;
mod logging;
mod message_budget;
mod routes;
mod service;
mod status;
mod trace;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};

pub use routes::GrpcRoutes;
pub use service::KilnGrpc;
pub use status::{code, status};

use connection::{Activity, Greeting, Order, Orders, Slot, Slots, Timeouts, Verdict, Watch};
use kiln_core::server::Server;

/// The protocol's messages, server and client ([`kiln_protocol::grpc::proto`]).
pub use kiln_protocol::grpc::proto;
/// `proto/inference.proto` compiled to a `FileDescriptorSet` (protobuf bytes).
pub use kiln_protocol::grpc::FILE_DESCRIPTOR_SET;

/// How to serve gRPC.
#[derive(Debug, Clone)]
pub struct GrpcConfig {
    /// Address to listen on (port 0: any free port).
    pub addr: SocketAddr,
    /// Serving threads [`GrpcServer::start`] creates.
    pub threads: usize,
    /// Whether those threads run under `SCHED_BATCH` ([`kiln_core::system::sched`]).
    pub sched_batch: bool,
    /// Limits on messages and connections.
    pub limits: GrpcLimits,
    /// TLS ([`crate::tls`], offering `h2`); `None`: plain HTTP/2.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The restricted APIs (`--grpc-restricted-protocol`; empty: none).
    pub restricted: Arc<crate::restricted::Restrictions>,
}

/// What one client may hold of the gRPC server (`docs/security.md`, "Connections").
#[derive(Debug, Clone)]
pub struct GrpcLimits {
    /// Largest message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// Time from the accept to the client's HTTP/2 preface (after TLS's handshake).
    pub handshake_timeout: Duration,
    /// A connection without a call for this long (to twice as long) is closed.
    pub idle_timeout: Duration,
    /// Idle time after which a connection is probed (TCP keepalive; `None`: never).
    pub keepalive_time: Option<Duration>,
    /// How long a probe's answer may take before the connection is dropped.
    pub keepalive_timeout: Duration,
    /// Open connections; beyond, a new one is closed at once.
    pub max_connections: usize,
    /// Concurrent streams (calls) per connection, announced in HTTP/2's SETTINGS.
    pub max_concurrent_streams: u32,
    /// Bytes held by unfinished messages, server-wide; beyond, RESOURCE_EXHAUSTED.
    pub max_pending_bytes: usize,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        GrpcLimits {
            max_message_bytes: 64 << 20,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            keepalive_time: Some(Duration::from_millis(7_200_000)),
            keepalive_timeout: Duration::from_millis(20_000),
            max_connections: crate::fdlimit::default_max_connections(1024),
            max_concurrent_streams: 128,
            max_pending_bytes: 1 << 30,
        }
    }
}

/// Serves `server` on `listener`, on the caller's runtime, until `shutdown`
/// resolves, then lets the open calls finish.
pub async fn serve(
    server: Server,
    listener: TcpListener,
    limits: GrpcLimits,
    restricted: Arc<crate::restricted::Restrictions>,
    shutdown: impl Future<Output = ()> + Send,
) {
    let (stop, stopped) = watch::channel(false);
    let (handoff, take) = mpsc::unbounded_channel();
    let slots = Slots::new(limits.max_connections);
    tokio::spawn(accept_loop(listener, vec![handoff], stopped, slots));
    let routes = GrpcRoutes::new(server, &limits, restricted);
    let signal = async move {
        shutdown.await;
        let _ = stop.send(true);
    };
    serve_incoming(routes, &limits, None, take, signal).await
}

/// Serves the connections `incoming` yields until `shutdown` resolves, then lets
/// the open calls finish.
///
/// Each connection is hyper's HTTP/2 server (prior knowledge, as gRPC clients
/// speak it) running [`GrpcRoutes`]; tonic's own server stack (an axum router and
/// tower layers in front of every call) is not used, [`GrpcRoutes`] does what of it
/// kiln needs. Responses carry no `Date` header (gRPC servers such as Triton's send
/// none). Each connection runs under the timeouts of [`connection`]; with `tls`, the
/// TLS handshake must end within the handshake timeout as well.
async fn serve_incoming(
    routes: GrpcRoutes,
    limits: &GrpcLimits,
    tls: Option<Arc<rustls::ServerConfig>>,
    mut incoming: mpsc::UnboundedReceiver<(std::net::TcpStream, Slot)>,
    shutdown: impl Future<Output = ()>,
) {
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .auto_date_header(false)
        .max_concurrent_streams(limits.max_concurrent_streams);
    let http2 = Arc::new(http2);
    let timeouts = Timeouts {
        handshake: limits.handshake_timeout,
        idle: limits.idle_timeout,
    };
    // Told to close gracefully; each connection holds a sender of `alive`.
    let (stop, stopping) = watch::channel(false);
    let (alive, mut all_closed) = mpsc::channel::<()>(1);
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, slot) = tokio::select! {
            _ = &mut shutdown => break,
            next = incoming.recv() => match next {
                Some(next) => next,
                None => break,
            },
        };
        let stream = match TcpStream::from_std(stream).and_then(|s| {
            s.set_nodelay(true)?;
            if let Some(idle) = limits.keepalive_time {
                keepalive(&s, idle, limits.keepalive_timeout)?;
            }
            Ok(s)
        }) {
            Ok(stream) => stream,
            Err(e) => {
                spdlog::debug!("gRPC connection: {e}");
                continue;
            }
        };
        let (http2, routes) = (Arc::clone(&http2), routes.clone());
        let (stopping, alive, tls) = (stopping.clone(), alive.clone(), tls.clone());
        let accepted = tokio::time::Instant::now();
        tokio::spawn(async move {
            match tls {
                None => connection(&http2, stream, &routes, timeouts, accepted, stopping).await,
                Some(tls) => {
                    let handshake = tls.accept(stream);
                    match tokio::time::timeout_at(accepted + timeouts.handshake, handshake).await {
                        Ok(Ok(stream)) => {
                            connection(&http2, stream, &routes, timeouts, accepted, stopping).await
                        }
                        Ok(Err(e)) => spdlog::debug!("gRPC TLS handshake: {e}"),
                        Err(_) => spdlog::debug!("gRPC TLS handshake: timed out"),
                    }
                }
            }
            drop((slot, alive));
        });
    }
    // New calls are refused; the open ones finish.
    let _ = stop.send(true);
    drop(alive);
    let _ = all_closed.recv().await;
}

/// Triton's `--grpc-keepalive-time` and `--grpc-keepalive-timeout` as TCP
/// keepalive: after `idle` without traffic the kernel probes the client, and drops
/// the connection when a probe is not answered within `timeout`. hyper's HTTP/2
/// PINGs would do the same one layer up, but they read the clock and poll a timer
/// at every wake-up of the connection: measured, 0.3–0.9 µs of server CPU per small
/// call (up to 6%) for a probe sent every two hours; the kernel's costs nothing
/// per call.
fn keepalive(socket: &TcpStream, idle: Duration, timeout: Duration) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let secs = |d: Duration| d.as_secs().clamp(1, i32::MAX as u64) as libc::c_int;
    let options = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(idle)),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, secs(timeout)),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 1),
    ];
    for (level, name, value) in options {
        // SAFETY: an open socket and one `c_int` option value of its size.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Serves one connection under its timeouts until it closes, or `stopping`
/// closes it gracefully. The timers run in a watchdog task of their own
/// ([`watchdog`]), which gives the connection its [`Orders`]: the connection's
/// task, woken for every frame, then pays one atomic load per wake-up instead of
/// polling a timer and the stop signal each time (measured: those polls were
/// about 1.5% of the server's CPU at 100k small calls/s).
async fn connection<I>(
    http2: &hyper::server::conn::http2::Builder<TokioExecutor>,
    io: I,
    routes: &GrpcRoutes,
    timeouts: Timeouts,
    accepted: tokio::time::Instant,
    stopping: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::default());
    let io = TokioIo::new(Greeting::new(io, Arc::clone(&activity)));
    let orders = Arc::new(Orders::default());
    let (_ended, ended) = oneshot::channel::<()>();
    tokio::spawn(watchdog(
        Watch::new(timeouts, Arc::clone(&activity)),
        Arc::clone(&orders),
        accepted + timeouts.handshake,
        stopping,
        ended,
    ));
    let connection = http2.serve_connection(io, routes.on_connection(activity));
    let mut connection = std::pin::pin!(connection);
    let mut closing = false;
    let done = std::future::poll_fn(|cx| {
        match orders.take(cx) {
            Order::Drop => return std::task::Poll::Ready(Ok(())),
            Order::Close if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
            _ => {}
        }
        connection.as_mut().poll(cx)
    })
    .await;
    if let Err(e) = done {
        spdlog::debug!("gRPC connection: {e}");
    }
}

/// A connection's timers: the handshake and idle timeouts, the graceful close's
/// deadline, and the server's stop. Ends when the connection does (`ended`).
async fn watchdog(
    mut watch: Watch,
    orders: Arc<Orders>,
    mut next: tokio::time::Instant,
    mut stopping: watch::Receiver<bool>,
    mut ended: oneshot::Receiver<()>,
) {
    let timeouts = watch.timeouts();
    // Set once a graceful close began: idle (bounded in time) or stopping.
    let mut closing: Option<tokio::time::Instant> = None;
    let mut stopped = false;
    loop {
        tokio::select! {
            _ = &mut ended => return,
            () = tokio::time::sleep_until(closing.unwrap_or(next)) => {
                if closing.is_some() {
                    spdlog::debug!("gRPC connection: dropped, its graceful close took too long");
                    return orders.give(Order::Drop);
                }
                match watch.check() {
                    Verdict::Serve(at) => next = at,
                    Verdict::Drop => {
                        spdlog::debug!("gRPC connection: no HTTP/2 preface within the handshake timeout");
                        return orders.give(Order::Drop);
                    }
                    Verdict::Idle if stopped => next = tokio::time::Instant::now() + timeouts.idle,
                    Verdict::Idle => {
                        spdlog::debug!("gRPC connection: idle, closing");
                        orders.give(Order::Close);
                        closing = Some(tokio::time::Instant::now() + watch.grace());
                    }
                }
            }
            _ = stopping.wait_for(|&stop| stop), if !stopped && closing.is_none() => {
                stopped = true;
                orders.give(Order::Close);
            }
        }
    }
}

/// Blocking threads of each serving thread's runtime, for big messages: more wait.
const BLOCKING_THREADS: usize = 2;

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
            .map(|_| mpsc::unbounded_channel::<(std::net::TcpStream, Slot)>())
            .unzip();
        // One cap and one budget of unfinished messages for every thread.
        let slots = Slots::new(config.limits.max_connections);
        let routes = GrpcRoutes::new(server, &config.limits, config.restricted);
        // The first thread accepts: it takes the listener and every handoff.
        let mut acceptor = Some((std_listener, handoff, slots));
        let mut workers = Vec::with_capacity(threads);
        for (i, take) in takes.into_iter().enumerate() {
            let (cut, cut_rx) = oneshot::channel();
            let (served_tx, served) = oneshot::channel();
            let (finished_tx, finished) = oneshot::channel();
            // Its blocking threads decode and encode big messages (routes.rs).
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .max_blocking_threads(BLOCKING_THREADS)
                .thread_name(format!("grpc-{i}-blocking"))
                .build()?;
            let acceptor = acceptor.take();
            let (routes, stopped) = (routes.clone(), stopped.clone());
            let (limits, sched_batch) = (config.limits.clone(), config.sched_batch);
            let tls = config.tls.clone();
            std::thread::Builder::new()
                .name(format!("grpc-{i}"))
                .spawn(move || {
                    if sched_batch {
                        kiln_core::system::sched::serving_thread();
                    }
                    runtime.block_on(async move {
                        if let Some((listener, handoff, slots)) = acceptor {
                            match TcpListener::from_std(listener) {
                                Ok(l) => {
                                    tokio::spawn(accept_loop(l, handoff, stopped.clone(), slots));
                                }
                                Err(e) => spdlog::error!("gRPC listener: {e}"),
                            }
                        }
                        let mut stopped = stopped;
                        let signal = async move {
                            let _ = stopped.wait_for(|&stop| stop).await;
                        };
                        tokio::select! {
                            () = serve_incoming(routes, &limits, tls, take, signal) => {
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
/// turn; past the cap of `slots`, a connection is closed at once.
async fn accept_loop(
    listener: TcpListener,
    handoff: Vec<mpsc::UnboundedSender<(std::net::TcpStream, Slot)>>,
    mut stopped: watch::Receiver<bool>,
    slots: Arc<Slots>,
) {
    let mut next = 0;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.wait_for(|&stop| stop) => return,
        };
        let accepted = accepted.and_then(|(stream, _)| {
            let Some(slot) = slots.take() else {
                // Closed at once: a refusal the client sees as UNAVAILABLE.
                return Ok(None);
            };
            Ok(Some((stream.into_std()?, slot)))
        });
        let stream = match accepted {
            Ok(Some(stream)) => stream,
            Ok(None) => continue,
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
