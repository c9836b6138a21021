//! Socket reads and writes the load generator's own clients share.

use std::io::IoSlice;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Writes every slice, in order, with as few `writev` calls as the socket allows.
pub async fn write_all(socket: &mut TcpStream, slices: &mut [IoSlice<'_>]) -> Result<(), String> {
    let mut rest = slices;
    IoSlice::advance_slices(&mut rest, 0);
    while !rest.is_empty() {
        let n = socket
            .write_vectored(rest)
            .await
            .map_err(|e| format!("send: {e}"))?;
        if n == 0 {
            return Err("send: connection closed".into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// Reads what the socket has into `read`'s spare capacity; an error when the
/// peer has closed the connection.
pub async fn read_more(socket: &mut TcpStream, read: &mut BytesMut) -> Result<(), String> {
    let n = socket
        .read_buf(read)
        .await
        .map_err(|e| format!("receive: {e}"))?;
    if n == 0 {
        return Err("the server closed the connection".into());
    }
    Ok(())
}
