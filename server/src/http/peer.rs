//! Noticing an HTTP/1 client that went away while its request waits for an answer.
//!
//! actix-web keeps running a handler whose client disconnected
//! (actix/actix-web#3462), so while a request waits for its answer the handler
//! also looks at the connection's socket every [`PERIOD`] (`poll` with no wait:
//! one system call per period of waiting, none for an answer that comes sooner).
//! It looks at the socket actix-web owns, by its descriptor number: no second
//! descriptor per connection. The number stays valid while the handler runs,
//! since the connection (which owns the socket) owns the handler too. When the
//! client is gone the handler returns and drops the request's reply channel, and
//! the dynamic batcher removes the request before it is batched.
//!
//! **Half-closed clients.** An end of stream (FIN) comes both from a client that
//! closed its socket and from one that only shut down its sending side and still
//! reads its answer (HTTP/1.1 allows it). They are told apart by what a closed
//! socket does with bytes sent to it: it answers with a reset. So at an end of
//! stream an HTTP/1.1 client is sent an interim `100 Continue` response, which
//! every HTTP/1.1 client must accept and skip (RFC 9110, 15.2); only when the
//! socket then reports a reset is the request cancelled. It is sent only while
//! the socket's send queue is empty (nothing of an earlier answer still on its
//! way), and once per connection. An HTTP/1.0 client may not be sent a 1xx
//! answer: its end of stream cancels the request, as before.

use std::any::Any;
use std::cell::Cell;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use actix_web::dev::Extensions;
use actix_web::http::Version;

/// How often a waiting request looks at its client's socket.
const PERIOD: Duration = Duration::from_millis(100);

/// How soon the socket is looked at again after the interim answer: a closed
/// socket's reset comes back within a round trip.
const AFTER_PROBE: Duration = Duration::from_millis(10);

/// The interim answer sent to tell a half-closed client from a gone one.
const PROBE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// The watch on one connection, kept in its connection data.
pub struct Peer {
    /// The connection's socket, owned by actix-web.
    fd: RawFd,
    /// Whether it carries TLS: no interim answer can be written to the socket
    /// then, and an end of stream cancels.
    tls: bool,
    /// Whether the interim answer was sent on this connection.
    probed: Cell<bool>,
}

/// What a look at the socket found.
#[derive(Debug, PartialEq, Eq)]
enum State {
    /// Nothing new, or bytes to read (a pipelined request): the client is there.
    Open,
    /// The client sent its end of stream: closed, or only half-closed.
    Ended,
    /// Reset or failed: the client is gone.
    Gone,
}

/// `HttpServer::on_connect` hook: note each connection's descriptor.
pub fn on_connect(connection: &dyn Any, data: &mut Extensions) {
    type Tls = actix_tls::accept::rustls_0_23::TlsStream<actix_web::rt::net::TcpStream>;
    let (fd, tls) = if let Some(tcp) = connection.downcast_ref::<actix_web::rt::net::TcpStream>() {
        (tcp.as_raw_fd(), false)
    } else if let Some(stream) = connection.downcast_ref::<Tls>() {
        (stream.get_ref().0.as_raw_fd(), true)
    } else {
        return;
    };
    data.insert(Peer {
        fd,
        tls,
        probed: Cell::new(false),
    });
}

/// A descriptor of its own (`dup`) for `req`'s connection socket, for a task that
/// outlives the handler: a WebSocket session shuts down (`shutdown(2)`) the socket
/// of a client that stopped reading, which ends actix-web's writes to it. Called
/// while the handler runs, when the number is the connection's (see above).
pub fn socket(req: &actix_web::HttpRequest) -> Option<std::os::fd::OwnedFd> {
    let fd = req.conn_data::<Peer>()?.fd;
    // SAFETY: the connection owns `fd` and outlives this handler's call.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    borrowed.try_clone_to_owned().ok()
}

impl Peer {
    /// Completes when the client has gone away (see the module documentation);
    /// `version` is the waiting request's.
    pub async fn closed(&self, version: Version) {
        let mut wait = PERIOD;
        loop {
            tokio::time::sleep(wait).await;
            wait = PERIOD;
            match self.state() {
                State::Open => {}
                State::Gone => return,
                State::Ended if self.tls || version != Version::HTTP_11 => return,
                State::Ended => {
                    if !self.probed.get() && self.send_queue_empty() {
                        self.probed.set(true);
                        if !self.probe() {
                            return;
                        }
                        wait = AFTER_PROBE;
                    }
                }
            }
        }
    }

    fn state(&self) -> State {
        let mut pfd = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid `pollfd`, no wait. `fd` is the connection's socket,
        // open while the handler that calls this runs.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        if n <= 0 {
            return State::Open;
        }
        if pfd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            State::Gone
        } else if pfd.revents & libc::POLLRDHUP != 0 {
            State::Ended
        } else {
            State::Open
        }
    }

    /// Whether every byte written to the socket has been acknowledged, so that
    /// nothing of an earlier answer is still to be sent.
    fn send_queue_empty(&self) -> bool {
        let mut queued: libc::c_int = 0;
        // SAFETY: `TIOCOUTQ` (`SIOCOUTQ`) writes one `c_int`; `fd` is open (above).
        let rc = unsafe { libc::ioctl(self.fd, libc::TIOCOUTQ, &mut queued) };
        rc == 0 && queued == 0
    }

    /// Sends [`PROBE`]; `false` when the socket refuses it (the client is gone).
    fn probe(&self) -> bool {
        // SAFETY: `PROBE` is valid for its length; `fd` is open (above).
        let sent = unsafe {
            libc::send(
                self.fd,
                PROBE.as_ptr().cast(),
                PROBE.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        sent >= 0
    }
}
