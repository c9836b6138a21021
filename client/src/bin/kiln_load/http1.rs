//! HTTP/1.1 calls over one keep-alive connection, written for the load generator:
//! each call writes the same request, encoded once (head and body in one vectored
//! write), and reads the answer's head and its whole body (`Content-Length` or
//! chunked) before the next. The body is counted, not parsed. Sequence runs swap
//! the body between calls (`set_body`).

use std::io::IoSlice;

use bytes::{Buf, Bytes, BytesMut};
use tokio::net::TcpStream;

use super::io;

/// The most header fields an answer may have.
const MAX_HEADERS: usize = 32;

/// One connection, one call at a time.
pub struct Http1 {
    socket: TcpStream,
    addr: String,
    path: String,
    head: Bytes,
    body: Bytes,
    read: BytesMut,
}

/// How the answer's body is delimited.
enum Length {
    Fixed(usize),
    Chunked,
}

impl Http1 {
    /// Connects to `addr` (`HOST:PORT`) for `POST path` requests with `headers`
    /// (name, value) and `body`.
    pub async fn connect(
        addr: &str,
        path: &str,
        headers: &[(&str, String)],
        body: Bytes,
    ) -> Result<Http1, String> {
        let socket = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        socket.set_nodelay(true).map_err(|e| e.to_string())?;
        let mut http = Http1 {
            socket,
            addr: addr.to_owned(),
            path: path.to_owned(),
            head: Bytes::new(),
            body: Bytes::new(),
            read: BytesMut::with_capacity(16 * 1024),
        };
        http.set_body(headers, body);
        Ok(http)
    }

    /// What the next calls send: `headers` (name, value) and `body`.
    pub fn set_body(&mut self, headers: &[(&str, String)], body: Bytes) {
        let (addr, path) = (&self.addr, &self.path);
        let mut head = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\n");
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
        self.head = Bytes::from(head);
        self.body = body;
    }

    /// One call: `Ok` for a 2xx answer.
    pub async fn call(&mut self) -> Result<(), String> {
        let mut slices = [IoSlice::new(&self.head), IoSlice::new(&self.body)];
        io::write_all(&mut self.socket, &mut slices).await?;
        let (status, length) = loop {
            if let Some(parsed) = parse_head(&mut self.read)? {
                break parsed;
            }
            self.fill().await?;
        };
        match length {
            Length::Fixed(n) => self.skip(n).await?,
            Length::Chunked => loop {
                let size = loop {
                    if let Some(end) = find_crlf(&self.read) {
                        let line = std::str::from_utf8(&self.read[..end]).unwrap_or("");
                        let digits = line.split(';').next().unwrap_or("").trim();
                        let size = usize::from_str_radix(digits, 16)
                            .map_err(|_| format!("bad chunk size `{line}`"))?;
                        self.read.advance(end + 2);
                        break size;
                    }
                    self.fill().await?;
                };
                if size == 0 {
                    // Trailer fields, then the empty line.
                    loop {
                        if let Some(end) = find_crlf(&self.read) {
                            self.read.advance(end + 2);
                            if end == 0 {
                                break;
                            }
                        } else {
                            self.fill().await?;
                        }
                    }
                    break;
                }
                self.skip(size + 2).await?; // the chunk and its CRLF
            },
        }
        if (200..300).contains(&status) {
            Ok(())
        } else {
            Err(format!("HTTP {status}"))
        }
    }

    /// Reads more of the answer.
    async fn fill(&mut self) -> Result<(), String> {
        self.read.reserve(16 * 1024);
        io::read_more(&mut self.socket, &mut self.read).await
    }

    /// Consumes `n` bytes of the answer.
    async fn skip(&mut self, mut n: usize) -> Result<(), String> {
        loop {
            let here = n.min(self.read.len());
            self.read.advance(here);
            n -= here;
            if n == 0 {
                return Ok(());
            }
            self.fill().await?;
        }
    }
}

/// The status and body length of the answer head at the start of `read` (which
/// loses the head), or `None` until the head is complete.
fn parse_head(read: &mut BytesMut) -> Result<Option<(u16, Length)>, String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    let head_len = match response.parse(read) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("bad answer: {e}")),
    };
    let status = response.code.unwrap_or_default();
    let mut length = Length::Fixed(0);
    for h in response.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or("bad content-length")?;
            length = Length::Fixed(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding")
            && h.value.eq_ignore_ascii_case(b"chunked")
        {
            length = Length::Chunked;
        }
    }
    read.advance(head_len);
    Ok(Some((status, length)))
}

fn find_crlf(b: &[u8]) -> Option<usize> {
    b.windows(2).position(|w| w == b"\r\n")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn heads_give_status_and_length() {
        let mut read = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"[..]);
        let (status, length) = parse_head(&mut read).unwrap().unwrap();
        assert_eq!(status, 200);
        assert!(matches!(length, Length::Fixed(5)));
        assert_eq!(&read[..], b"hello");
        let mut partial = BytesMut::from(&b"HTTP/1.1 429 Too"[..]);
        assert!(parse_head(&mut partial).unwrap().is_none());
        let mut chunked =
            BytesMut::from(&b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n"[..]);
        let (status, length) = parse_head(&mut chunked).unwrap().unwrap();
        assert_eq!(status, 400);
        assert!(matches!(length, Length::Chunked));
    }
}
