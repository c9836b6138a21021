//! Noticing an HTTP/1 client that went away while its request waits for an answer.
//! actix-web keeps running a handler whose client disconnected
//! (actix/actix-web#3462), so each connection keeps a duplicate of its socket; while
//! a request waits, the handler also waits for that socket's end of stream. When it
//! comes, the handler returns and drops the request's reply channel, and the dynamic
//! batcher removes the request before it is batched.

use std::any::Any;
use std::os::fd::AsFd;
use std::sync::{Mutex, OnceLock};

use actix_web::dev::Extensions;

/// The watch on one connection, kept in its connection data.
pub struct Peer {
    socket: Mutex<Option<std::net::TcpStream>>,
    /// Registered with the worker's runtime on first use, then reused: no system
    /// call per request unless the socket becomes readable.
    watched: OnceLock<Option<tokio::net::TcpStream>>,
}

/// `HttpServer::on_connect` hook: keep a duplicate of each plain TCP connection.
pub fn on_connect(connection: &dyn Any, data: &mut Extensions) {
    let Some(tcp) = connection.downcast_ref::<actix_web::rt::net::TcpStream>() else {
        return;
    };
    if let Ok(fd) = tcp.as_fd().try_clone_to_owned() {
        data.insert(Peer {
            socket: Mutex::new(Some(std::net::TcpStream::from(fd))),
            watched: OnceLock::new(),
        });
    }
}

impl Peer {
    fn stream(&self) -> Option<&tokio::net::TcpStream> {
        self.watched
            .get_or_init(|| {
                let socket = self.socket.lock().ok()?.take()?;
                socket.set_nonblocking(true).ok()?;
                tokio::net::TcpStream::from_std(socket).ok()
            })
            .as_ref()
    }

    /// Completes when the client has closed the connection. Bytes waiting (a
    /// pipelined next request) mean it is still there: then this never completes.
    pub async fn closed(&self) {
        let Some(stream) = self.stream() else {
            return std::future::pending().await;
        };
        let mut byte = [0u8; 1];
        match stream.peek(&mut byte).await {
            Ok(0) | Err(_) => {}
            Ok(_) => std::future::pending().await,
        }
    }
}
