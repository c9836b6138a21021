//! A small HTTP/1.1 server on 127.0.0.1 serving one file (the media tests' URL
//! source), counting the connections it accepts: a refused URL must make none.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Serves `GET /<name>` with the file's bytes (any other path: 404) until dropped.
pub struct FileServer {
    pub addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl FileServer {
    /// Starts serving `file` as `/<its file name>`.
    pub fn start(file: PathBuf) -> FileServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the file server");
        let addr = listener.local_addr().expect("file server address");
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, stopped) = (connections.clone(), stop.clone());
        let name = format!(
            "/{}",
            file.file_name().expect("a file name").to_string_lossy()
        );
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::Acquire) {
                    break;
                }
                let Ok(mut stream) = stream else { continue };
                count.fetch_add(1, Ordering::AcqRel);
                let (file, name) = (file.clone(), name.clone());
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().expect("clone the socket"));
                    let mut line = String::new();
                    if reader.read_line(&mut line).is_err() {
                        return;
                    }
                    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
                    // The rest of the head.
                    loop {
                        let mut header = String::new();
                        match reader.read_line(&mut header) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if header == "\r\n" => break,
                            Ok(_) => {}
                        }
                    }
                    let _ = if path == name {
                        let body = std::fs::read(&file).expect("read the served file");
                        write!(
                            stream,
                            "HTTP/1.1 200 OK\r\nContent-Type: video/mp4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                            body.len()
                        )
                        .and_then(|()| stream.write_all(&body))
                    } else {
                        stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    };
                });
            }
        });
        FileServer {
            addr,
            connections,
            stop,
        }
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }
}

impl Drop for FileServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}
